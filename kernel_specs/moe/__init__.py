"""MoE routing kernels."""
