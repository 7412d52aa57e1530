"""TileKernels' `mhc` kernel module: it exports nothing (its ops are `modeling.mhc.ops`)."""
