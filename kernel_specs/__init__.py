"""Built-in kernel specs, one file per kernel, grouped by family."""
