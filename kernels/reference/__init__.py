"""Plain-PyTorch kernels: the CPU implementation, and the reference for the planned GPU kernels."""
