"""mHC (manifold-constrained hyper-connection) kernels."""
