"""Plain-PyTorch kernels: the CPU implementation and the reference for GPU kernels."""
