"""Data-movement kernels: transposes."""
