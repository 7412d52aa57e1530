"""Quantisation kernels (FP8 casts with scaling factors)."""
