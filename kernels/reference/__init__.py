"""Plain-PyTorch kernels: the CPU implementation, and the reference (oracle) for the Triton GPU kernels."""
