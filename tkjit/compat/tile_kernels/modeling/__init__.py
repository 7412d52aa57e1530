"""TileKernels' `modeling`: the autograd-level ops of mHC and Engram."""

from tkjit.compat.tile_kernels.modeling import engram, mhc

__all__ = ["engram", "mhc"]
