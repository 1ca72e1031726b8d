"""Kernels written in plain PyTorch for `torch.compile` to fuse (the fast CPU path)."""
