"""Built-in kernel specs, one file per kernel, grouped by family.

INDEX lets `tkjit.get` import just the one spec module it needs (a fresh process serving a cached
kernel should not import the whole catalog); a name missing here is still found by a full scan.
"""

INDEX = {
    "sinkhorn_fwd": "tkjit_kernels.mhc.sinkhorn",
    "sinkhorn_bwd": "tkjit_kernels.mhc.sinkhorn_bwd",
    "expand_to_mhc": "tkjit_kernels.mhc.expand_to_mhc",
    "expand_to_mhc_bwd": "tkjit_kernels.mhc.expand_to_mhc_bwd",
    "pre_apply_mix": "tkjit_kernels.mhc.pre_apply_mix",
    "pre_apply_mix_bwd": "tkjit_kernels.mhc.pre_apply_mix_bwd",
    "pre_apply_mix_bwd_acc": "tkjit_kernels.mhc.pre_apply_mix_bwd",
    "topk_gate": "tkjit_kernels.moe.topk_gate",
    "get_fused_mapping": "tkjit_kernels.moe.get_fused_mapping",
    "normalize_weight": "tkjit_kernels.moe.normalize_weight",
    "mask_indices_by_tp": "tkjit_kernels.moe.mask_indices_by_tp",
    "inplace_unique_group_indices": "tkjit_kernels.moe.inplace_unique_group_indices",
    "expand_to_fused": "tkjit_kernels.moe.expand_to_fused",
    "reduce_fused": "tkjit_kernels.moe.reduce_fused",
    "expand_to_fused_with_sf": "tkjit_kernels.moe.expand_to_fused_with_sf",
    "expand_to_fused_with_sf_colmajor": "tkjit_kernels.moe.expand_to_fused_with_sf",
    "group_count": "tkjit_kernels.moe.group_count",
    "aux_fi": "tkjit_kernels.moe.group_count",
    "topk_sum_and_topk_group_idx": "tkjit_kernels.moe.topk_sum_and_topk_group_idx",
    "top2_sum_gate": "tkjit_kernels.moe.top2_sum_gate",
    "per_token_cast": "tkjit_kernels.quant.per_token_cast",
    "per_token_cast_colmajor": "tkjit_kernels.quant.per_token_cast",
    "per_block_cast": "tkjit_kernels.quant.per_block_cast",
    "per_block_cast_colmajor": "tkjit_kernels.quant.per_block_cast",
    "per_block_cast_with_sf": "tkjit_kernels.quant.per_block_cast",
    "transpose": "tkjit_kernels.transpose.transpose",
    "batched_transpose": "tkjit_kernels.transpose.transpose",
    "engram_hash": "tkjit_kernels.engram.engram_hash",
    "fused_weight": "tkjit_kernels.engram.fused_weight",
    "cast_back": "tkjit_kernels.quant.cast_back",
    "cast_back_colmajor": "tkjit_kernels.quant.cast_back",
    "per_channel_cast": "tkjit_kernels.quant.per_channel_cast",
    "per_channel_cast_and_transpose": "tkjit_kernels.quant.per_channel_cast_and_transpose",
    "per_channel_cast_fused": "tkjit_kernels.quant.per_channel_cast_fused",
    "mhc_post_fwd": "tkjit_kernels.mhc.post",
    "mhc_post_bwd": "tkjit_kernels.mhc.post_bwd",
}
