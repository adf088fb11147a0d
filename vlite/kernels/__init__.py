"""Attention and KV-cache kernels: torch implementations (CPU) and Triton (CUDA)."""
