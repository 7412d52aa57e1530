"""The kernels as torch custom ops, `torch.ops.tkjit.*`, registered when `tkjit.ops` is imported.

    torch.ops.tkjit.sinkhorn_fwd(x, repeat=10, eps=1e-6, config=None, bwd_config=None)  # differentiable
    torch.ops.tkjit.sinkhorn_bwd(grad_out, x, repeat=10, eps=1e-6, config=None)
    torch.ops.tkjit.topk_gate(scores, k, config=None)
    torch.ops.tkjit.per_token_cast(x, group=128, round_scale=False, config=None)           # (q, scales)
    torch.ops.tkjit.per_token_cast_colmajor(x, group=128, round_scale=False, config=None)  # (q, padded storage)
    torch.ops.tkjit.transpose(x, config=None)                                               # 2-D or 3-D
    torch.ops.tkjit.normalize_weight(topk_weights, config=None)                             # (denominator, normalized)
    torch.ops.tkjit.mask_indices_by_tp(indices, n, num_ep_ranks, tp_rank, num_tp_ranks, config=None)
    torch.ops.tkjit.inplace_unique_group_indices(group_indices, num_groups, config=None)   # in place, None
    torch.ops.tkjit.top2_sum_gate(logits, bias, num_topk, ..., scoring_func, mask=None, fix_routing_mask=None,
                                  to_physical_map=None, logical_count=None, unmapped_topk_idx=None,
                                  config=None)          # (topk_idx, topk_weights); unmapped_topk_idx in place
    torch.ops.tkjit.cast_back(x, sf, block_tokens=1, block_channels=128, out_dtype='bfloat16', config=None)
    torch.ops.tkjit.cast_back_colmajor(x, sf_storage, ...)                          # column-major scales' s.T

Each op's real implementation is `tkjit.get(...)(...)`: the shape is read off the tensors, the kernel
comes from the memo, the disk cache or a compile. Its fake implementation computes the outputs'
shapes, dtypes and strides from the inputs, so torch.compile traces the ops without a graph break
(and FakeTensor inputs never reach a launcher). `config` is a kernel config as the text of a dict,
e.g. "{'layout': 'thread', ...}" (`encode_config` writes it); None takes the tuned or default one.

Each op's implementation is also a plain function (`<op>_impl`): `tkjit.ops` calls it directly
in eager code that needs neither tracing nor autograd, which skips the dispatcher. Through the
dispatcher, a call that needs no gradient skips custom_op's Python layers (`dispatch.lean_dispatch`).

Custom ops may not return views, so the column-major scales come back as their padded storage
(num_groups, align(num_tokens, 4)); `tkjit.ops.per_token_cast(..., col_major_scales=True)` returns
the (num_tokens, num_groups) view of it.

One module per kernel family (`mhc`, `moe`, `quant`, `transpose`, `engram`, as under kernel_specs/), on two
shared ones: `serve` (the config text, the kernel object a call gets) and `checks` (what an op checks before its
kernel, eager or traced). This package's namespace holds every family's public names (`torch_ops.<op>_impl`).
"""

import torch

from tkjit.torch_ops.dispatch import LEAN_OPS, LEAN_SKIPPED, lean_dispatch, version_bump
from tkjit.torch_ops.engram import *  # noqa: F403
from tkjit.torch_ops.mhc import *  # noqa: F403
from tkjit.torch_ops.moe import *  # noqa: F403
from tkjit.torch_ops.quant import *  # noqa: F403
from tkjit.torch_ops.serve import encode_config
from tkjit.torch_ops.transpose import *  # noqa: F403

# A star import of this package takes these; every family's public names are attributes here too (above).
__all__ = ["LEAN_OPS", "LEAN_SKIPPED", "OPS", "encode_config"]

OPS = [v for v in list(globals().values()) if isinstance(v, torch._library.custom_ops.CustomOpDef)]  # every op
for _op in OPS:
    version_bump(_op)
    lean_dispatch(_op)
del _op
