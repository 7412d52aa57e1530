"""Compatibility layers: other packages' public APIs served by tkjit's kernels.

    import tkjit.compat.tile_kernels as tile_kernels   # TileKernels' API, for the ops tkjit has

Nothing here imports the package it mirrors.
"""
