"""Built-in kernel specs, one file per kernel, grouped by family.

INDEX lets `tkjit.get` import just the one spec module it needs (a fresh process serving a cached
kernel should not import the whole catalog); a name missing here is still found by a full scan.
"""

INDEX = {
    "sinkhorn_fwd": "kernel_specs.mhc.sinkhorn",
    "sinkhorn_bwd": "kernel_specs.mhc.sinkhorn_bwd",
    "topk_gate": "kernel_specs.moe.topk_gate",
    "get_fused_mapping": "kernel_specs.moe.get_fused_mapping",
    "normalize_weight": "kernel_specs.moe.normalize_weight",
    "mask_indices_by_tp": "kernel_specs.moe.mask_indices_by_tp",
    "inplace_unique_group_indices": "kernel_specs.moe.inplace_unique_group_indices",
    "expand_to_fused": "kernel_specs.moe.expand_to_fused",
    "reduce_fused": "kernel_specs.moe.reduce_fused",
    "group_count": "kernel_specs.moe.group_count",
    "aux_fi": "kernel_specs.moe.group_count",
    "topk_sum_and_topk_group_idx": "kernel_specs.moe.topk_sum_and_topk_group_idx",
    "per_token_cast": "kernel_specs.quant.per_token_cast",
    "per_token_cast_colmajor": "kernel_specs.quant.per_token_cast",
    "transpose": "kernel_specs.transpose.transpose",
    "batched_transpose": "kernel_specs.transpose.transpose",
}
