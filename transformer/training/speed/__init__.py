"""Measured speed switches: backends, precision, torch.compile, CUDA graphs (docs/performance.md)."""
