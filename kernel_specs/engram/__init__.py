"""Engram kernels: n-gram hash embedding indices and the gate's fused RMSNorm weights."""
