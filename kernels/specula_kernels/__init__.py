"""Compute kernels of the model worker.

Each kernel lives in its own module with a wrapper that checks shapes and dtypes and a plain-PyTorch
reference. The reference is what the CPU path runs and what accelerated (Triton, flash-attn) versions are
tested against.
"""
