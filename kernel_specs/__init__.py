"""Built-in kernel specs, one file per kernel, grouped by family.

INDEX lets `tkjit.get` import just the one spec module it needs (a fresh process serving a cached
kernel should not import the whole catalog); a name missing here is still found by a full scan.
"""

INDEX = {
    "sinkhorn_fwd": "kernel_specs.mhc.sinkhorn",
    "sinkhorn_bwd": "kernel_specs.mhc.sinkhorn_bwd",
    "topk_gate": "kernel_specs.moe.topk_gate",
    "per_token_cast": "kernel_specs.quant.per_token_cast",
    "per_token_cast_colmajor": "kernel_specs.quant.per_token_cast",
    "transpose": "kernel_specs.transpose.transpose",
    "batched_transpose": "kernel_specs.transpose.transpose",
}
