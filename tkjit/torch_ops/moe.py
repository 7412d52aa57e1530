"""torch.ops.tkjit ops of the MoE family: gating (topk_gate, top2_sum_gate, topk_sum_and_topk_group_idx),
routing maps (get_fused_mapping, mask_indices_by_tp, inplace_unique_group_indices), counts (group_count,
aux_fi), normalize_weight, and the expand / reduce of the fused rows."""

import functools
from typing import Any

import torch

from tkjit.errors import ShapeError, TensorError
from tkjit.kernel import dtype_name
from tkjit.scales import tma_aligned
from tkjit.torch_ops.checks import check, check_indices, check_indices_on, fake_check, need, need_dtype
from tkjit.torch_ops.serve import kernel_for, kernel_of

# -- topk_gate -------------------------------------------------------------------------------------

def topk_gate_impl(scores, k, config=None):
    """(num_tokens, num_experts) float32 -> int64 (num_tokens, k) expert indices, best first."""
    def shape_of():
        need(scores, (2,), "topk_gate")
        return {"num_tokens": max(1, scores.shape[0]), "num_experts": scores.shape[1], "k": k}

    return kernel_for("topk_gate", scores, (k,), config, shape_of)(scores)


topk_gate = torch.library.custom_op(
    "tkjit::topk_gate", mutates_args=(), schema="(Tensor scores, int k, str? config=None) -> Tensor"
)(topk_gate_impl)


@topk_gate.register_fake
def _(scores, k, config=None):
    need(scores, (2,), "topk_gate")
    fake_check("topk_gate", {"num_experts": int(scores.shape[1]), "k": k}, scores)
    return scores.new_empty((scores.shape[0], k), dtype=torch.int64)


# -- normalize_weight -------------------------------------------------------------------------------

def normalize_weight_impl(topk_weights, config=None):
    """(num_tokens, num_topk) float32 -> (denominator (num_tokens,), normalized (num_tokens, num_topk))."""
    need(topk_weights, (2,), "normalize_weight")
    shape = {"num_tokens": max(1, topk_weights.shape[0]), "num_topk": topk_weights.shape[1]}
    return kernel_of("normalize_weight", shape, topk_weights, config)(topk_weights)


normalize_weight = torch.library.custom_op(
    "tkjit::normalize_weight", mutates_args=(),
    schema="(Tensor topk_weights, str? config=None) -> (Tensor, Tensor)",
)(normalize_weight_impl)


@normalize_weight.register_fake
def _(topk_weights, config=None):
    need(topk_weights, (2,), "normalize_weight")
    fake_check("normalize_weight", {"num_topk": int(topk_weights.shape[1])}, topk_weights)
    return topk_weights.new_empty((topk_weights.shape[0],)), topk_weights.new_empty(topk_weights.shape)


# -- mask_indices_by_tp -----------------------------------------------------------------------------

def tp_scalars(op: str, n: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int) -> tuple[int, int, int]:
    """The kernel's (per_gpu, tp_rank, num_tp_ranks), or ShapeError naming the bad argument: sizes
    positive, n >= num_ep_ranks (per_gpu = n // num_ep_ranks >= 1, as TileKernels divides by it),
    0 <= tp_rank < num_tp_ranks, num_tp_ranks * per_gpu within int32 (the kernel's arithmetic)."""
    for name, v in (("n", n), ("num_ep_ranks", num_ep_ranks), ("tp_rank", tp_rank), ("num_tp_ranks", num_tp_ranks)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ShapeError(f"{op}: {name} must be an int, got {v!r}")
    if num_ep_ranks < 1:
        raise ShapeError(f"{op}: num_ep_ranks ({num_ep_ranks}) must be >= 1")
    if n < num_ep_ranks:
        raise ShapeError(f"{op}: n ({n}) must be >= num_ep_ranks ({num_ep_ranks}): n // num_ep_ranks experts per GPU")
    if num_tp_ranks < 1:
        raise ShapeError(f"{op}: num_tp_ranks ({num_tp_ranks}) must be >= 1")
    if not 0 <= tp_rank < num_tp_ranks:
        raise ShapeError(f"{op}: tp_rank ({tp_rank}) must be in [0, num_tp_ranks ({num_tp_ranks}))")
    per_gpu = n // num_ep_ranks
    if per_gpu * num_tp_ranks >= 1 << 31:
        raise ShapeError(f"{op}: num_tp_ranks * (n // num_ep_ranks) = {per_gpu * num_tp_ranks} exceeds int32")
    return per_gpu, tp_rank, num_tp_ranks


def _need_index_dtype(x, what: str) -> None:
    if x.dtype not in (torch.int32, torch.int64):
        raise TensorError(f"{what}: indices has dtype {x.dtype}, expected torch.int32 or torch.int64")


def mask_indices_by_tp_impl(indices, n, num_ep_ranks, tp_rank, num_tp_ranks, config=None):
    """(num_tokens, num_topk) int32/int64 expert indices -> this TP rank's local indices, -1 elsewhere."""
    need(indices, (2,), "mask_indices_by_tp")
    _need_index_dtype(indices, "mask_indices_by_tp")
    scalars = tp_scalars("mask_indices_by_tp", n, num_ep_ranks, tp_rank, num_tp_ranks)
    check_indices("mask_indices_by_tp", "indices", indices, n)
    shape = {"num_tokens": max(1, indices.shape[0]), "num_topk": indices.shape[1], "dtype": dtype_name(indices.dtype)}
    return kernel_of("mask_indices_by_tp", shape, indices, config)(indices, *scalars)


mask_indices_by_tp = torch.library.custom_op(
    "tkjit::mask_indices_by_tp", mutates_args=(),
    schema="(Tensor indices, int n, int num_ep_ranks, int tp_rank, int num_tp_ranks, str? config=None) -> Tensor",
)(mask_indices_by_tp_impl)


@mask_indices_by_tp.register_fake
def _(indices, n, num_ep_ranks, tp_rank, num_tp_ranks, config=None):
    need(indices, (2,), "mask_indices_by_tp")
    _need_index_dtype(indices, "mask_indices_by_tp")
    tp_scalars("mask_indices_by_tp", n, num_ep_ranks, tp_rank, num_tp_ranks)
    fake_check("mask_indices_by_tp", {"num_topk": int(indices.shape[1]), "dtype": dtype_name(indices.dtype)}, indices)
    return torch.empty_like(indices, memory_format=torch.contiguous_format)


# -- inplace_unique_group_indices -------------------------------------------------------------------

def inplace_unique_group_indices_impl(group_indices, num_groups, config=None):
    """In place on (num_tokens, num_topk) int64: repeats of an id in [0, num_groups) after its first
    occurrence in the row become -1. Returns None."""
    need(group_indices, (2,), "inplace_unique_group_indices")
    check_indices("inplace_unique_group_indices", "group_indices", group_indices, num_groups)
    shape = {"num_tokens": max(1, group_indices.shape[0]), "num_topk": group_indices.shape[1], "num_groups": num_groups}
    kernel_of("inplace_unique_group_indices", shape, group_indices, config)(group_indices)


inplace_unique_group_indices = torch.library.custom_op(
    "tkjit::inplace_unique_group_indices", mutates_args=("group_indices",),
    schema="(Tensor(a!) group_indices, int num_groups, str? config=None) -> ()",
)(inplace_unique_group_indices_impl)


@inplace_unique_group_indices.register_fake
def _(group_indices, num_groups, config=None):
    need(group_indices, (2,), "inplace_unique_group_indices")
    fake_check("inplace_unique_group_indices",
                {"num_topk": int(group_indices.shape[1]), "num_groups": num_groups}, group_indices)


# -- group_count -------------------------------------------------------------------------------------

def group_count_impl(group_idx, num_groups, config=None):
    """int64 (num_tokens, num_topk) ids -> int32 (num_groups,) counts; entries < 0 (or >= num_groups) skipped."""
    need(group_idx, (2,), "group_count")
    check_indices("group_count", "group_idx", group_idx, num_groups)
    shape = {"num_tokens": max(1, group_idx.shape[0]), "num_topk": group_idx.shape[1], "num_groups": num_groups}
    return kernel_of("group_count", shape, group_idx, config)(group_idx)


group_count = torch.library.custom_op(
    "tkjit::group_count", mutates_args=(), schema="(Tensor group_idx, int num_groups, str? config=None) -> Tensor"
)(group_count_impl)


@group_count.register_fake
def _(group_idx, num_groups, config=None):
    need(group_idx, (2,), "group_count")
    fake_check("group_count", {"num_topk": int(group_idx.shape[1]), "num_groups": num_groups}, group_idx)
    return group_idx.new_empty((num_groups,), dtype=torch.int32)


# -- aux_fi ------------------------------------------------------------------------------------------

def aux_fi_impl(topk_idx, num_experts, num_aux_topk, config=None):
    """int64 (num_tokens, num_topk) expert ids -> float32 (num_experts,)
    count * num_experts / (num_tokens * num_aux_topk); entries < 0 (or >= num_experts) skipped."""
    need(topk_idx, (2,), "aux_fi")
    check_indices("aux_fi", "topk_idx", topk_idx, num_experts)
    shape = {"num_tokens": max(1, topk_idx.shape[0]), "num_topk": topk_idx.shape[1], "num_experts": num_experts}
    fi, _counts = kernel_of("aux_fi", shape, topk_idx, config)(topk_idx, num_aux_topk)
    return fi


aux_fi = torch.library.custom_op(
    "tkjit::aux_fi", mutates_args=(),
    schema="(Tensor topk_idx, int num_experts, int num_aux_topk, str? config=None) -> Tensor",
)(aux_fi_impl)


@aux_fi.register_fake
def _(topk_idx, num_experts, num_aux_topk, config=None):
    need(topk_idx, (2,), "aux_fi")
    fake_check("aux_fi", {"num_topk": int(topk_idx.shape[1]), "num_experts": num_experts}, topk_idx)
    return topk_idx.new_empty((num_experts,), dtype=torch.float32)


# -- topk_sum_and_topk_group_idx ---------------------------------------------------------------------

def _group_shape(scores, num_topk_sum, num_topk_groups):
    return {"num_groups": scores.shape[1], "num_experts_per_group": scores.shape[2],
            "num_topk_sum": num_topk_sum, "num_topk_groups": num_topk_groups}


def topk_sum_and_topk_group_idx_impl(scores, num_topk_sum, num_topk_groups, config=None):
    """(num_tokens, num_groups, experts_per_group) float32 -> int64 (num_tokens, num_topk_groups): the groups
    with the largest sums of their num_topk_sum best scores, best first, ties to the smaller group."""
    need(scores, (3,), "topk_sum_and_topk_group_idx")
    shape = {"num_tokens": max(1, scores.shape[0]), **_group_shape(scores, num_topk_sum, num_topk_groups)}
    return kernel_of("topk_sum_and_topk_group_idx", shape, scores, config)(scores)


topk_sum_and_topk_group_idx = torch.library.custom_op(
    "tkjit::topk_sum_and_topk_group_idx", mutates_args=(),
    schema="(Tensor scores, int num_topk_sum, int num_topk_groups, str? config=None) -> Tensor",
)(topk_sum_and_topk_group_idx_impl)


@topk_sum_and_topk_group_idx.register_fake
def _(scores, num_topk_sum, num_topk_groups, config=None):
    need(scores, (3,), "topk_sum_and_topk_group_idx")
    shape = _group_shape(scores, num_topk_sum, num_topk_groups)
    fake_check("topk_sum_and_topk_group_idx", {k: int(v) for k, v in shape.items()}, scores)
    return scores.new_empty((scores.shape[0], num_topk_groups), dtype=torch.int64)


# -- expand_to_fused ---------------------------------------------------------------------------------

def _expand_static(x, token_topk_to_pos) -> dict:
    return {"hidden": int(x.shape[1]), "num_topk": int(token_topk_to_pos.shape[1]), "dtype": dtype_name(x.dtype)}


def expand_to_fused_impl(x, token_topk_to_pos, pos_to_expert, config=None):
    """x (num_tokens, hidden) -> (num_expanded_tokens, hidden): row t copied to each valid position
    token_topk_to_pos[t, k], padding rows (pos_to_expert < 0) zero; bit-exact, any element type."""
    need(x, (2,), "expand_to_fused")
    need(token_topk_to_pos, (2,), "expand_to_fused")
    need(pos_to_expert, (1,), "expand_to_fused")
    (n, h), p = x.shape, pos_to_expert.shape[0]
    check_indices("expand_to_fused", "token_topk_to_pos", token_topk_to_pos, p)
    if n == 0:  # nothing launches: every row is padding or unmapped, zero (TileKernels' reference)
        fake_check("expand_to_fused", _expand_static(x, token_topk_to_pos), x, token_topk_to_pos, pos_to_expert)
        return x.new_zeros((p, h))
    shape = {"num_tokens": n, "num_expanded_tokens": max(1, p), **_expand_static(x, token_topk_to_pos)}
    return kernel_of("expand_to_fused", shape, x, config)(x, token_topk_to_pos, pos_to_expert)


expand_to_fused = torch.library.custom_op(
    "tkjit::expand_to_fused", mutates_args=(),
    schema="(Tensor x, Tensor token_topk_to_pos, Tensor pos_to_expert, str? config=None) -> Tensor",
)(expand_to_fused_impl)


@expand_to_fused.register_fake
def _(x, token_topk_to_pos, pos_to_expert, config=None):
    need(x, (2,), "expand_to_fused")
    need(token_topk_to_pos, (2,), "expand_to_fused")
    need(pos_to_expert, (1,), "expand_to_fused")
    fake_check("expand_to_fused", _expand_static(x, token_topk_to_pos), x, token_topk_to_pos, pos_to_expert)
    return x.new_empty((pos_to_expert.shape[0], x.shape[1]))


# -- reduce_fused ------------------------------------------------------------------------------------

_REDUCE_ARGS = "Tensor x, Tensor? topk_weights, Tensor token_topk_to_pos, str fp8_format='', Tensor? sf=None, " \
               "Tensor? x_sf=None"


def _reduce_static(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf) -> dict:
    if fp8_format not in ("", "e4m3"):
        raise ShapeError(f"reduce_fused: fp8_format must be '' or 'e4m3', got {fp8_format!r}")
    return {"hidden": int(x.shape[1]), "num_topk": int(token_topk_to_pos.shape[1]), "in_dtype": dtype_name(x.dtype),
            "e4m3_out": fp8_format == "e4m3", "has_weights": topk_weights is not None,
            "has_x_sf": x_sf is not None, "has_sf": sf is not None}


def _reduce(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf, config, out):
    for t in (x, token_topk_to_pos):
        need(t, (2,), "reduce_fused")
    static = _reduce_static(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf)
    n, p = token_topk_to_pos.shape[0], x.shape[0]
    check_indices("reduce_fused", "token_topk_to_pos", token_topk_to_pos, p)
    shape = {"num_tokens": max(1, n), "num_expanded_tokens": max(1, p), **static}
    kern = kernel_of("reduce_fused", shape, x, config)
    args = [t for t in (x, topk_weights, token_topk_to_pos, sf, x_sf) if t is not None]
    if p == 0 and n:  # no rows to read: every slot is skipped, each token sums to +0 (nothing launches)
        got = kern(*args, out=out) if out is not None else kern(*args)
        return got.zero_()
    return kern(*args, out=out) if out is not None else kern(*args)


def reduce_fused_impl(x, topk_weights, token_topk_to_pos, fp8_format="", sf=None, x_sf=None, config=None):
    """(num_expanded_tokens, hidden) bf16/f16/f32/e4m3 -> (num_tokens, hidden) x's dtype or e4m3: each token's
    valid rows summed in slot order, one FMA per slot (weight times x_sf[pos]), times sf, cast."""
    return _reduce(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf, config, None)


reduce_fused = torch.library.custom_op(
    "tkjit::reduce_fused", mutates_args=(), schema=f"({_REDUCE_ARGS}, str? config=None) -> Tensor",
)(reduce_fused_impl)


def _reduce_fake(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf):
    for t in (x, token_topk_to_pos):
        need(t, (2,), "reduce_fused")
    static = _reduce_static(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf)
    fake_check("reduce_fused", static, *[t for t in (x, topk_weights, token_topk_to_pos, sf, x_sf) if t is not None])
    return torch.float8_e4m3fn if static["e4m3_out"] else x.dtype


@reduce_fused.register_fake
def _(x, topk_weights, token_topk_to_pos, fp8_format="", sf=None, x_sf=None, config=None):
    dtype = _reduce_fake(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf)
    return x.new_empty((token_topk_to_pos.shape[0], x.shape[1]), dtype=dtype)


def reduce_fused_out_impl(x, topk_weights, token_topk_to_pos, out, fp8_format="", sf=None, x_sf=None, config=None):
    """reduce_fused into the caller's `out` (num_tokens, hidden), contiguous, of the output dtype."""
    _reduce(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf, config, out)


reduce_fused_out = torch.library.custom_op(
    "tkjit::reduce_fused_out", mutates_args=("out",),
    schema="(Tensor x, Tensor? topk_weights, Tensor token_topk_to_pos, Tensor(a!) out, str fp8_format='', "
           "Tensor? sf=None, Tensor? x_sf=None, str? config=None) -> ()",
)(reduce_fused_out_impl)


@reduce_fused_out.register_fake
def _(x, topk_weights, token_topk_to_pos, out, fp8_format="", sf=None, x_sf=None, config=None):
    _reduce_fake(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf)


# -- get_fused_mapping -----------------------------------------------------------------------------

_FUSED_SCHEMA = ("(Tensor topk_idx, int num_experts, int num_expanded_tokens, int alignment, str? config=None) -> "
                 "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _fused_static(topk_idx, num_experts, num_expanded_tokens, alignment) -> dict:
    """The shape but num_tokens (a size of topk_idx, symbolic in a fake call): num_expanded_tokens is an
    argument, range-checked with the static params."""
    need(topk_idx, (2,), "get_fused_mapping")
    if not isinstance(num_expanded_tokens, (int, torch.SymInt)) or num_expanded_tokens < 0:
        raise ShapeError(f"get_fused_mapping: num_expanded_tokens must be an int >= 0, got {num_expanded_tokens!r}")
    # Runtime sizes of 0 launch nothing: the impl builds those outputs itself (see below).
    return {"num_expanded_tokens": max(1, num_expanded_tokens), "num_topk": int(topk_idx.shape[1]),
            "num_experts": num_experts, "alignment": alignment}


def _fused_shape(topk_idx, num_experts, num_expanded_tokens, alignment) -> dict:
    static = _fused_static(topk_idx, num_experts, num_expanded_tokens, alignment)
    return {"num_tokens": max(1, topk_idx.shape[0]), **static}


def _fused_buffers(n: int, k: int, e: int, nexp: int, dev, pooled: bool) -> tuple:
    """The workspace (WS_ROWS, e) and the seven outputs, each contiguous and starting on 16 bytes (the
    kernel's `TensorArg.align`). pooled: ONE allocation, the tensors views of it at 16-byte offsets (the
    eager path; torch.empty on the GPU host costs µs a call). Otherwise (the custom op, whose outputs may
    not share storage) one allocation per output, the workspace in pos_to_expert's, past its rows."""
    sizes = _fused_sizes(n, k, e, nexp, pooled)
    if pooled:
        total, pieces, at = sizes
        parts = torch.empty(total, dtype=torch.int32, device=dev).split_with_sizes(pieces)
        ws, p2e, p2t, p2tk, ttp, start, end, count = [parts[i] for i in at]
    else:
        i32 = torch.int32
        p2e, _, ws = torch.empty(sizes[0], dtype=i32, device=dev).split_with_sizes(sizes[1])
        p2t, p2tk = (torch.empty(nexp, dtype=i32, device=dev) for _ in range(2))
        ttp = torch.empty(n * k, dtype=i32, device=dev)
        start, end, count = (torch.empty(e, dtype=i32, device=dev) for _ in range(3))
    return ws.view(-1, e), (p2e, p2t, p2tk, ttp.view(n, k), start, end, count)


@functools.lru_cache(maxsize=64)
def _fused_sizes(n: int, k: int, e: int, nexp: int, pooled: bool) -> tuple:
    from tkjit_kernels.moe.get_fused_mapping import WS_ROWS

    def pad(m: int) -> int:  # int32 elements up to the next 16 bytes
        return -m % 4

    ws = WS_ROWS * e
    if not pooled:  # pos_to_expert (at offset 0), padding, then the workspace: (total, split sizes)
        return nexp + pad(nexp) + ws, (nexp, pad(nexp), ws)
    pieces, at = [], []
    for m in (ws, nexp, nexp, nexp, n * k, e, e, e):  # each piece, then its padding to 16 bytes (if any)
        at.append(len(pieces))
        pieces += (m, pad(m)) if pad(m) else (m,)
    return sum(pieces), tuple(pieces), tuple(at)


def get_fused_mapping_impl(topk_idx, num_experts, num_expanded_tokens, alignment, config=None):
    """topk_idx (num_tokens, num_topk) int64 -> (pos_to_expert, pos_to_token, pos_to_token_topk: int32
    (num_expanded_tokens,); token_topk_to_pos int32 (num_tokens, num_topk); expert_start, expert_end,
    num_tokens_per_expert: int32 (num_experts,)). Entries outside [-1, num_experts) count as -1; positions
    at or past num_expanded_tokens are dropped (token_topk_to_pos -1), or with TKJIT_CHECK_INDICES=1 a
    ShapeError (one device sync)."""
    return _fused_mapping(topk_idx, num_experts, num_expanded_tokens, alignment, config, False)


def get_fused_mapping_pooled(topk_idx, num_experts, num_expanded_tokens, alignment, config=None):
    """get_fused_mapping_impl with the outputs views of one allocation (`tkjit.ops`' eager path; the
    custom op's outputs may not share storage): one torch.empty a call instead of eight."""
    return _fused_mapping(topk_idx, num_experts, num_expanded_tokens, alignment, config, True)


def _fused_mapping(topk_idx, num_experts, num_expanded_tokens, alignment, config, pooled):
    shape = _fused_shape(topk_idx, num_experts, num_expanded_tokens, alignment)
    checking = check_indices_on()  # (read once: an environment lookup)
    if checking:
        check_indices("get_fused_mapping", "topk_idx", topk_idx, num_experts)
    n, k = topk_idx.shape
    dev, i32 = topk_idx.device, torch.int32
    if n == 0:  # nothing routed: every position is padding, every segment empty (checked all the same)
        fake_check("get_fused_mapping", shape, topk_idx)
        pos = [torch.full((num_expanded_tokens,), -1, dtype=i32, device=dev) for _ in range(3)]
        return (*pos, torch.empty((0, k), dtype=i32, device=dev),
                *[torch.zeros(num_experts, dtype=i32, device=dev) for _ in range(3)])
    kernel = kernel_of("get_fused_mapping", shape, topk_idx, config)
    # The workspace of per-block counts (its content on entry is ignored) and the outputs, allocated
    # together; the call into them (out=) checks them as it checks inputs (a plan after the first call).
    # An int num_experts outside the spec's range is refused by `get` above, before any allocation.
    workspace, outs = _fused_buffers(n, k, num_experts, shape["num_expanded_tokens"], dev, pooled)
    kernel(topk_idx, workspace, out=outs)
    outs = list(outs)
    if num_expanded_tokens == 0:  # launched into 1-row maps: everything is dropped, the maps are empty
        outs[:3] = [torch.empty(0, dtype=i32, device=dev) for _ in range(3)]
        outs[3].fill_(-1)  # (the entry the kernel put at row 0)
    if checking and num_tokens_layout(outs) > num_expanded_tokens:
        raise ShapeError(
            f"get_fused_mapping: the layout needs {num_tokens_layout(outs)} rows but num_expanded_tokens is "
            f"{num_expanded_tokens}: positions past it were dropped (pass 0 to size it, or a larger buffer)"
        )
    return tuple(outs)


def num_tokens_layout(outs) -> int:
    """Rows the layout takes (expert_end[-1]); a device sync."""
    return int(outs[5][-1]) if outs[5].numel() else 0


get_fused_mapping = torch.library.custom_op(
    "tkjit::get_fused_mapping", mutates_args=(), schema=_FUSED_SCHEMA
)(get_fused_mapping_impl)


@get_fused_mapping.register_fake
def _(topk_idx, num_experts, num_expanded_tokens, alignment, config=None):
    fake_check("get_fused_mapping", _fused_static(topk_idx, num_experts, num_expanded_tokens, alignment), topk_idx)
    i32 = torch.int32
    pos = [topk_idx.new_empty((num_expanded_tokens,), dtype=i32) for _ in range(3)]
    return (*pos, topk_idx.new_empty(tuple(topk_idx.shape), dtype=i32),
            *[topk_idx.new_empty((num_experts,), dtype=i32) for _ in range(3)])


# -- expand_to_fused_with_sf -------------------------------------------------------------------------

_EXPAND_SF_SCHEMA = ("(Tensor x, Tensor x_sf, int num_per_channels, Tensor token_topk_to_pos, Tensor pos_to_expert, "
                     "bool use_tma_aligned_col_major_sf=False, str? config=None) -> (Tensor, Tensor)")


def _expand_sf_static(x, x_sf, num_per_channels, token_topk_to_pos) -> dict:
    return {"hidden": int(x.shape[1]), "num_topk": int(token_topk_to_pos.shape[1]),
            "num_per_channels": num_per_channels, "dtype": dtype_name(x.dtype), "sf_dtype": dtype_name(x_sf.dtype)}


def _expand_sf_need(x, x_sf, token_topk_to_pos, pos_to_expert) -> None:
    for t in (x, x_sf, token_topk_to_pos):
        need(t, (2,), "expand_to_fused_with_sf")
    need(pos_to_expert, (1,), "expand_to_fused_with_sf")


def _sf_storage_cols(p: int) -> int:
    return tma_aligned(p)


def expand_to_fused_with_sf_impl(x, x_sf, num_per_channels, token_topk_to_pos, pos_to_expert,
                                 use_tma_aligned_col_major_sf=False, config=None):
    """x (num_tokens, hidden) and its scales x_sf (num_tokens, hidden_sf) float32 / packed-UE8M0 int32, row-major
    -> (out (num_expanded_tokens, hidden), out_sf): both rows copied to each valid position, padding rows zero;
    bit-exact. out_sf is (num_expanded_tokens, hidden_sf), or with use_tma_aligned_col_major_sf its column-major
    storage (hidden_sf, align(num_expanded_tokens, 4)), padding columns zero."""
    _expand_sf_need(x, x_sf, token_topk_to_pos, pos_to_expert)
    name = "expand_to_fused_with_sf_colmajor" if use_tma_aligned_col_major_sf else "expand_to_fused_with_sf"
    (n, h), p = x.shape, pos_to_expert.shape[0]
    check_indices(name, "token_topk_to_pos", token_topk_to_pos, p)
    static = _expand_sf_static(x, x_sf, num_per_channels, token_topk_to_pos)
    shape = {"num_tokens": max(1, n), "num_expanded_tokens": max(1, p), **static}
    if n == 0:  # nothing launches: every row is padding or unmapped, zero (TileKernels' reference)
        fake_check(name, static, x, x_sf, token_topk_to_pos, pos_to_expert)  # (the kernel's checks)
        sw = x_sf.shape[1]
        sf_shape = (sw, _sf_storage_cols(p)) if use_tma_aligned_col_major_sf else (p, sw)
        return x.new_zeros((p, h)), x_sf.new_zeros(sf_shape)
    kern = kernel_of(name, shape, x, config)
    return kern(x, x_sf, token_topk_to_pos, pos_to_expert)


expand_to_fused_with_sf = torch.library.custom_op(
    "tkjit::expand_to_fused_with_sf", mutates_args=(), schema=_EXPAND_SF_SCHEMA
)(expand_to_fused_with_sf_impl)


@expand_to_fused_with_sf.register_fake
def _(x, x_sf, num_per_channels, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf=False,
      config=None):
    _expand_sf_need(x, x_sf, token_topk_to_pos, pos_to_expert)
    name = "expand_to_fused_with_sf_colmajor" if use_tma_aligned_col_major_sf else "expand_to_fused_with_sf"
    fake_check(name, _expand_sf_static(x, x_sf, num_per_channels, token_topk_to_pos),
                x, x_sf, token_topk_to_pos, pos_to_expert)
    p, sw = pos_to_expert.shape[0], x_sf.shape[1]
    sf_shape = (sw, _sf_storage_cols(p)) if use_tma_aligned_col_major_sf else (p, sw)
    return x.new_empty((p, x.shape[1])), x_sf.new_empty(sf_shape)


# -- top2_sum_gate -----------------------------------------------------------------------------------

_TOP2_SCHEMA = (
    "(Tensor logits, Tensor bias, int num_topk, int num_topk_groups, int num_groups, bool use_shared_as_routed, "
    "int num_shared_experts, float routed_scaling_factor, int ep_rank, int num_ep_ranks, int tp_rank, "
    "int num_tp_ranks, str scoring_func, Tensor? mask=None, Tensor? fix_routing_mask=None, "
    "Tensor? to_physical_map=None, Tensor? logical_count=None, Tensor(a!)? unmapped_topk_idx=None, "
    "str? config=None) -> (Tensor, Tensor)"
)


def _top2_fixed_routing(op: str, num_tokens, num_topk: int, fix_routing_mask, unmapped_topk_idx) -> None:
    """TensorError naming the argument unless fix_routing_mask (bool, (num_tokens,)) and unmapped_topk_idx (int64,
    (num_tokens, num_topk), last axis contiguous) are as TileKernels asserts; fix_routing_mask needs
    unmapped_topk_idx (the fixed tokens' indices are read from it)."""
    if fix_routing_mask is not None and unmapped_topk_idx is None:
        raise TensorError(f"{op}: fix_routing_mask needs unmapped_topk_idx (the fixed tokens' indices are read "
                          "from it)")
    if fix_routing_mask is not None:
        need(fix_routing_mask, (1,), f"{op}: fix_routing_mask")
        need_dtype(fix_routing_mask, torch.bool, f"{op}: fix_routing_mask")
        check(fix_routing_mask.shape[0] == num_tokens, lambda: f"{op}: fix_routing_mask has "
               f"{fix_routing_mask.shape[0]} entries, logits has {num_tokens} tokens")
    if unmapped_topk_idx is not None:
        need(unmapped_topk_idx, (2,), f"{op}: unmapped_topk_idx")
        need_dtype(unmapped_topk_idx, torch.int64, f"{op}: unmapped_topk_idx")
        for axis, want in enumerate((num_tokens, num_topk)):
            check(unmapped_topk_idx.shape[axis] == want, lambda: f"{op}: unmapped_topk_idx has shape "
                   f"{tuple(unmapped_topk_idx.shape)}, expected (num_tokens, num_topk) = ({num_tokens}, {num_topk})")
        # Any row stride (a view of a wider buffer), as TileKernels.
        check(unmapped_topk_idx.stride(1) == 1, lambda: f"{op}: unmapped_topk_idx must have a contiguous last "
               f"axis (stride(1) == 1), got strides {unmapped_topk_idx.stride()}")


def top2_sum_gate_setup(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed,
                        num_shared_experts, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask,
                        to_physical_map, logical_count, fix_routing_mask=None,
                        unmapped_topk_idx=None) -> tuple[dict, tuple[int, int, int, int]]:
    """(static shape, (ep_rank, per_gpu, tp_rank, num_tp_ranks)), or ShapeError/TensorError naming the
    argument: TileKernels' asserts (shared experts, scoring function, map shapes, fixed routing) and sizes that
    would divide by zero."""
    op = "top2_sum_gate"
    need(logits, (2,), op)
    need(bias, (1,), op)
    e = int(logits.shape[1])
    if scoring_func not in ("sigmoid", "sqrtsoftplus", "softmax"):
        raise ShapeError(f"{op}: scoring_func must be 'sigmoid', 'sqrtsoftplus' or 'softmax', got {scoring_func!r}")
    s = num_shared_experts if use_shared_as_routed else 0
    if use_shared_as_routed:
        if s not in (1, 2):
            raise ShapeError(f"{op}: num_shared_experts ({s}) must be 1 or 2 with use_shared_as_routed")
        if num_topk % s or e % (num_topk // s):
            raise ShapeError(f"{op}: num_topk ({num_topk}) must be a multiple of num_shared_experts ({s}) and "
                             f"num_experts ({e}) of num_topk // num_shared_experts")
    if (to_physical_map is None) != (logical_count is None):
        raise TensorError(f"{op}: to_physical_map and logical_count must be given together")
    if mask is not None and (mask.dtype != torch.bool or mask.numel() != logits.shape[0]):
        raise TensorError(f"{op}: mask must be a torch.bool tensor of num_tokens ({logits.shape[0]}) entries, got "
                          f"{mask.dtype} {tuple(mask.shape)}")
    _top2_fixed_routing(op, logits.shape[0], num_topk, fix_routing_mask, unmapped_topk_idx)
    d = 1
    if to_physical_map is not None:
        need(to_physical_map, (2,), op)
        need(logical_count, (1,), op)
        d = int(to_physical_map.shape[1])
        if d - 1 < s:
            raise ShapeError(f"{op}: to_physical_map has {d - 1} extra experts, fewer than num_shared_experts ({s})")
    elif s:
        raise ShapeError(f"{op}: num_shared_experts ({s}) needs to_physical_map (its extra experts hold them)")
    if isinstance(ep_rank, bool) or not isinstance(ep_rank, int) or not 0 <= ep_rank < 1 << 31:
        raise ShapeError(f"{op}: ep_rank must be an int >= 0, got {ep_rank!r}")
    per_gpu, tp_rank, num_tp_ranks = tp_scalars(op, e + d - 1, num_ep_ranks, tp_rank, num_tp_ranks)
    shape = {"num_experts": e, "num_topk": num_topk, "num_groups": num_groups, "num_topk_groups": num_topk_groups,
             "num_shared_experts": s, "scoring_func": scoring_func, "has_mask": mask is not None,
             "has_map": to_physical_map is not None, "num_duplicates": d,
             "has_fix": fix_routing_mask is not None, "has_unmapped": unmapped_topk_idx is not None}
    return shape, (ep_rank, per_gpu, tp_rank, num_tp_ranks)


def _top2_tensors(logits, bias, mask, to_physical_map, logical_count, fix_routing_mask=None,
                  unmapped_topk_idx=None):
    """The kernel's tensors, in the spec's order: the bool masks go in as int8 (same bytes; the C target has no
    bool buffers); unmapped_topk_idx as it is (updated in place, through a view too)."""
    out = [logits, bias]
    if mask is not None:
        out.append(mask.reshape(-1).contiguous().view(torch.int8))
    if to_physical_map is not None:
        out += [to_physical_map, logical_count]
    if fix_routing_mask is not None:
        out.append(fix_routing_mask.contiguous().view(torch.int8))
    if unmapped_topk_idx is not None:
        out.append(unmapped_topk_idx)
    return out


def top2_sum_gate_launch(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed,
                         num_shared_experts, routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks,
                         scoring_func, mask=None, fix_routing_mask=None, to_physical_map=None, logical_count=None,
                         unmapped_topk_idx=None, config=None) -> tuple[Any, list, tuple]:
    """(kernel object, its tensors, its scalars) for a top2_sum_gate call, after its checks; the kernel returns
    unmapped_topk_idx (when it takes it), topk_idx, topk_weights."""
    shape, (ep, per_gpu, tp, tps) = top2_sum_gate_setup(
        logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts, ep_rank,
        num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask, to_physical_map, logical_count, fix_routing_mask,
        unmapped_topk_idx)
    if logical_count is not None:
        check_indices("top2_sum_gate", "logical_count", logical_count, shape["num_duplicates"] + 1, lo=1)
    kern = kernel_of("top2_sum_gate", {"num_tokens": max(1, logits.shape[0]), **shape}, logits, config)
    tensors = _top2_tensors(logits, bias, mask, to_physical_map, logical_count, fix_routing_mask, unmapped_topk_idx)
    return kern, tensors, (float(routed_scaling_factor), ep, per_gpu, tp, tps)


def top2_sum_gate_impl(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                       routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
                       fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None,
                       config=None):
    """DeepSeek-V3 grouped routing: float32 logits (num_tokens, num_experts) and bias -> (topk_idx int64,
    topk_weights float32), both (num_tokens, num_topk + shared experts); TileKernels' `top2_sum_gate`.
    unmapped_topk_idx, when given, is updated in place (the logical indices; read for fix_routing_mask's tokens)."""
    kern, tensors, scalars = top2_sum_gate_launch(
        logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
        routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask, fix_routing_mask,
        to_physical_map, logical_count, unmapped_topk_idx, config)
    got = kern(*tensors, *scalars)
    return got[-2], got[-1]  # (after unmapped_topk_idx, which the kernel returns first when it takes it)


top2_sum_gate = torch.library.custom_op("tkjit::top2_sum_gate", mutates_args=("unmapped_topk_idx",),
                                        schema=_TOP2_SCHEMA)(top2_sum_gate_impl)


@top2_sum_gate.register_fake
def _(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
      routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
      fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None, config=None):
    shape, _ = top2_sum_gate_setup(
        logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts, ep_rank,
        num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask, to_physical_map, logical_count, fix_routing_mask,
        unmapped_topk_idx)
    fake_check("top2_sum_gate", shape, *_top2_tensors(logits, bias, mask, to_physical_map, logical_count,
                                                       fix_routing_mask, unmapped_topk_idx))
    p = num_topk + shape["num_shared_experts"]
    return (logits.new_empty((logits.shape[0], p), dtype=torch.int64),
            logits.new_empty((logits.shape[0], p), dtype=torch.float32))
