"""Triton kernels and their launchers only: no torch.library, no autograd, no argument validation."""
