"""TileKernels' `engram` kernels. tkjit serves all of them: `engram_hash`, `fused_weight`,
`engram_gate_fwd`, `engram_gate_bwd` and `grad_w_reduce`."""

from __future__ import annotations

import torch

from tkjit import ops
from tkjit.compat.tile_kernels import config
from tkjit.compat.tile_kernels._support import as_float, missing, off_alignment, require_kernel, rows_aligned, tensor
from tkjit.errors import ShapeError, TensorError

FAMILY = "engram"
__all__ = ["fused_weight", "engram_gate_fwd", "engram_gate_bwd", "grad_w_reduce", "engram_hash"]


def fused_weight(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    """weight_hidden * weight_embed in float32: both (hc_mult, hidden_size) bfloat16, hidden_size a
    multiple of 256 (TileKernels asserts it) -> a new contiguous (hc_mult, hidden_size) float32 tensor,
    bit-identical to torch's `weight_hidden.float() * weight_embed.float()` (IEEE, subnormals kept)."""
    fn = "engram.fused_weight"
    tensor(fn, "weight_hidden", weight_hidden, (2,), (torch.bfloat16,))
    tensor(fn, "weight_embed", weight_embed, (2,), (torch.bfloat16,))
    if weight_embed.shape != weight_hidden.shape:
        raise TensorError(f"tile_kernels.{fn}: weight_embed has shape {tuple(weight_embed.shape)}, weight_hidden "
                          f"{tuple(weight_hidden.shape)}: they must be equal")
    hc_mult, hidden_size = weight_hidden.shape
    if hidden_size % 256:
        raise ShapeError(f"tile_kernels.{fn}: hidden_size (weight_hidden.shape[1] = {hidden_size}) must be a "
                         "multiple of 256")
    if weight_hidden.numel() == 0:  # nothing to launch
        return torch.empty((hc_mult, hidden_size), dtype=torch.float32, device=weight_hidden.device)
    require_kernel(fn, FAMILY, "fused_weight", {"hc_mult": hc_mult, "hidden_size": hidden_size},
                   {"hc_mult": "hc_mult (weight_hidden.shape[0])",
                    "hidden_size": "hidden_size (weight_hidden.shape[1])"})
    return ops.fused_weight(rows_aligned(weight_hidden.contiguous()), rows_aligned(weight_embed.contiguous()))


def engram_gate_fwd(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The Engram gate's forward: out = x + sigmoid(copysign(sqrt(max(|s|, clamp_value)), s)) * v with
    s = sum(x * weight_fused * k) * rstd_x * rstd_k / sqrt(hidden_size) per token and head.

    hidden_states, k (num_tokens, hc_mult, hidden_size) and v (num_tokens, hidden_size) bfloat16 (k and v
    may be strided views with a contiguous last axis), weight_fused (hc_mult, hidden_size) float32,
    hidden_size a multiple of 256 and >= 512 (TileKernels' block sizes) -> (out, dot, gate_score, rstd_x,
    rstd_k): out a new (num_tokens, hc_mult, hidden_size) bfloat16 tensor, the others (num_tokens,
    hc_mult) float32 (dot unscaled), or None when save_for_backward is False. The float32 sums are
    tkjit's order, so they agree with TileKernels' to float32 rounding, not bit for bit.
    """
    fn = "engram.engram_gate_fwd"
    x, k, v, w = _gate_tensors(fn, hidden_states, k, v, weight_fused)
    eps, clamp_value = as_float(fn, "eps", eps), as_float(fn, "clamp_value", clamp_value)
    num_tokens, hc_mult, hidden_size = x.shape
    if num_tokens == 0:  # nothing to launch
        saved = [torch.empty((0, hc_mult), dtype=torch.float32, device=x.device) for _ in range(4)]
        out = torch.empty_like(x)
    else:
        require_kernel(fn, FAMILY, "engram_gate_fwd",
                       {"hc_mult": hc_mult, "hidden_size": hidden_size, "eps": eps, "clamp_value": clamp_value},
                       _GATE_NAMES, {"num_tokens": num_tokens})
        out, *saved = ops.engram_gate_fwd(x, k, v, w, eps, clamp_value)
    if not save_for_backward:
        return out, None, None, None, None
    return (out, *saved)


def engram_gate_bwd(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    dot: torch.Tensor,
    gate_score: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Engram gate's backward from grad_out = dL/d out (num_tokens, hc_mult, hidden_size) bfloat16, the
    forward's inputs (as engram_gate_fwd takes them) and its saved dot, gate_score, rstd_x, rstd_k
    ((num_tokens, hc_mult) float32) -> (grad_hidden_states, grad_k (num_tokens, hc_mult, hidden_size),
    grad_v (num_tokens, hidden_size) bfloat16, grad_w_partial (get_num_sms(), hc_mult, hidden_size) float32:
    weight_fused's gradient summed over each persistent block's tokens, for `grad_w_reduce`). As
    TileKernels: hc_mult 4, hidden_size a multiple of 512 and at least 1024. Float32 sums in tkjit's
    order: within float32 rounding of TileKernels' kernel (bf16 outputs within an ulp), not bit for bit.
    """
    fn = "engram.engram_gate_bwd"
    x, k, v, w = _gate_tensors(fn, hidden_states, k, v, weight_fused)
    clamp_value = as_float(fn, "clamp_value", clamp_value)
    num_tokens, hc_mult, hidden_size = x.shape
    tensor(fn, "grad_out", grad_out, (3,), (torch.bfloat16,))
    if tuple(grad_out.shape) != tuple(x.shape):
        raise TensorError(f"tile_kernels.{fn}: grad_out has shape {tuple(grad_out.shape)}, expected "
                          f"{tuple(x.shape)} (hidden_states')")
    saved = []
    for name, t in (("dot", dot), ("gate_score", gate_score), ("rstd_x", rstd_x), ("rstd_k", rstd_k)):
        tensor(fn, name, t, (2,), (torch.float32,))
        if tuple(t.shape) != (num_tokens, hc_mult):
            raise TensorError(f"tile_kernels.{fn}: {name} has shape {tuple(t.shape)}, expected "
                              f"{(num_tokens, hc_mult)} (num_tokens, hc_mult)")
        saved.append(t.contiguous())
    if hc_mult != 4:
        raise ShapeError(f"tile_kernels.{fn}: hc_mult (hidden_states.shape[1] = {hc_mult}) must be 4 (TileKernels' "
                         "backward kernel takes two warps per head of 4)")
    if hidden_size % 512 or hidden_size < 1024:
        raise ShapeError(f"tile_kernels.{fn}: hidden_size (hidden_states.shape[2] = {hidden_size}) must be a "
                         "multiple of 512 and at least 1024")
    num_partials = config.get_num_sms()
    require_kernel(fn, FAMILY, "engram_gate_bwd",
                   {"hc_mult": hc_mult, "hidden_size": hidden_size, "clamp_value": clamp_value,
                    "num_partials": num_partials},
                   {**_GATE_NAMES, "num_partials": "num_partials (get_num_sms())"}, {"num_tokens": max(1, num_tokens)})
    return ops.engram_gate_bwd(rows_aligned(grad_out.contiguous()), x, k, v, w, *saved, clamp_value,
                               num_partials=num_partials)


def grad_w_reduce(
    grad_w_partial: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    grad_weight_hidden: torch.Tensor,
    grad_weight_embed: torch.Tensor,
) -> None:
    """Finishes the weights' gradients in place: g = grad_w_partial (num_persistent_blocks, hc_mult,
    hidden_size) float32 summed over its rows (float32, in row order, as TileKernels), then
    grad_weight_hidden += g * weight_embed and grad_weight_embed += g * weight_hidden (weights (hc_mult,
    hidden_size) bfloat16, gradients float32, updated in place). As TileKernels: hidden_size a multiple of
    512, num_persistent_blocks a multiple of 4."""
    fn = "engram.grad_w_reduce"
    tensor(fn, "grad_w_partial", grad_w_partial, (3,), (torch.float32,))
    num_partials, hc_mult, hidden_size = grad_w_partial.shape
    want = (hc_mult, hidden_size)
    args = {"weight_hidden": (weight_hidden, torch.bfloat16), "weight_embed": (weight_embed, torch.bfloat16),
            "grad_weight_hidden": (grad_weight_hidden, torch.float32),
            "grad_weight_embed": (grad_weight_embed, torch.float32)}
    for name, (t, dtype) in args.items():
        tensor(fn, name, t, (2,), (dtype,))
        if tuple(t.shape) != want:
            raise TensorError(f"tile_kernels.{fn}: {name} has shape {tuple(t.shape)}, expected {want} (grad_w_partial "
                              f"is {tuple(grad_w_partial.shape)})")
        if t.device != grad_w_partial.device:
            raise TensorError(f"tile_kernels.{fn}: {name} is on {t.device}, grad_w_partial on {grad_w_partial.device}")
    if hidden_size % 512:
        raise ShapeError(f"tile_kernels.{fn}: hidden_size (grad_w_partial.shape[2] = {hidden_size}) must be a "
                         "multiple of 512")
    if num_partials % 4 or num_partials == 0:
        raise ShapeError(f"tile_kernels.{fn}: num_persistent_blocks (grad_w_partial.shape[0] = {num_partials}) must "
                         "be a positive multiple of 4")
    if hc_mult == 0:
        return
    require_kernel(fn, FAMILY, "grad_w_reduce",
                   {"hc_mult": hc_mult, "hidden_size": hidden_size, "num_partials": num_partials},
                   {"hc_mult": "hc_mult (grad_w_partial.shape[1])",
                    "hidden_size": "hidden_size (grad_w_partial.shape[2])",
                    "num_partials": "num_persistent_blocks (grad_w_partial.shape[0])"})
    # The gradients are updated in place: a buffer the kernel cannot write in place (not contiguous, or not
    # on a 16-byte boundary) is accumulated in a contiguous copy and copied back.
    outs = [g if g.is_contiguous() and not off_alignment(g, 16) else g.contiguous().clone()
            for g in (grad_weight_hidden, grad_weight_embed)]
    ops.grad_w_reduce(rows_aligned(grad_w_partial.contiguous()), rows_aligned(weight_hidden.contiguous()),
                      rows_aligned(weight_embed.contiguous()), *outs)
    for g, o in zip((grad_weight_hidden, grad_weight_embed), outs):
        if o is not g:
            g.copy_(o)


_GATE_NAMES = {"hc_mult": "hc_mult (hidden_states.shape[1])", "hidden_size": "hidden_size (hidden_states.shape[2])",
               "num_tokens": "num_tokens (hidden_states.shape[0])"}


def _strided_ok(x: torch.Tensor) -> torch.Tensor:
    """x when tkjit's kernels read it in place (rows that do not overlap, starting aligned), else a copy:
    TileKernels reads any leading strides (a broadcast k too); the values are the same either way."""
    cols = x.shape[-1]
    if any(n > 1 and s < cols for s, n in zip(x.stride()[:-1], x.shape[:-1])):
        return x.contiguous()
    return rows_aligned(x)


def _gate_tensors(fn: str, hidden_states, k, v, weight_fused):
    """The gate kernels' tensors checked as TileKernels asserts them (TensorError / ShapeError naming the
    argument), then made readable in place: hidden_states, k, v, weight_fused."""
    tensor(fn, "hidden_states", hidden_states, (3,), (torch.bfloat16,))
    tensor(fn, "k", k, (3,), (torch.bfloat16,))
    tensor(fn, "v", v, (2,), (torch.bfloat16,))
    tensor(fn, "weight_fused", weight_fused, (2,), (torch.float32,))
    num_tokens, hc_mult, hidden_size = hidden_states.shape
    want = {"k": (num_tokens, hc_mult, hidden_size), "v": (num_tokens, hidden_size),
            "weight_fused": (hc_mult, hidden_size)}
    for name, t in (("k", k), ("v", v), ("weight_fused", weight_fused)):
        shape = want[name]
        if tuple(t.shape) != shape:
            raise TensorError(f"tile_kernels.{fn}: {name} has shape {tuple(t.shape)}, expected {shape} "
                              f"(hidden_states is {tuple(hidden_states.shape)})")
    for name, t in (("k", k), ("v", v)):
        if t.numel() and t.stride(-1) != 1:
            raise TensorError(f"tile_kernels.{fn}: {name} must have a contiguous last axis (stride 1), got "
                              f"strides {t.stride()}")
    if hidden_size % 256 or hidden_size < 512:
        raise ShapeError(f"tile_kernels.{fn}: hidden_size (hidden_states.shape[2] = {hidden_size}) must be a "
                         "multiple of 256 and at least 512")
    return (rows_aligned(hidden_states.contiguous()), _strided_ok(k), _strided_ok(v),
            rows_aligned(weight_fused.contiguous()))


def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Engram's n-gram hash embedding indices, bit-identical to TileKernels (and its torch reference).

    ngram_token_ids (num_tokens, N) int32, multipliers (L, N) int64, vocab_sizes (L, N - 1, E) int32,
    offsets (L, (N - 1) * E) int32 -> a new contiguous (L, num_tokens, (N - 1) * E) int32 tensor: for
    n = 1 .. N - 1 the xor of the wrapping int64 products ngram_token_ids[:, k] * multipliers[l, k],
    k <= n, floor-mod each of the E table sizes of the (n + 1)-gram, plus the table's offset (wrapping
    in int32). Table sizes must be positive (TileKernels divides by them; tkjit's kernel divides by 1
    for a size of 0 or -1 instead of faulting, and with TKJIT_CHECK_INDICES=1 refuses sizes < 1).
    """
    fn = "engram.engram_hash"
    tensor(fn, "ngram_token_ids", ngram_token_ids, (2,), (torch.int32,))
    tensor(fn, "multipliers", multipliers, (2,), (torch.int64,))
    tensor(fn, "vocab_sizes", vocab_sizes, (3,), (torch.int32,))
    tensor(fn, "offsets", offsets, (2,), (torch.int32,))
    num_tokens, n = ngram_token_ids.shape
    layers, _, e = vocab_sizes.shape
    if n < 2:
        raise ShapeError(f"tile_kernels.{fn}: max_ngram_size (ngram_token_ids.shape[1] = {n}) must be >= 2")
    if layers < 1 or e < 1:
        raise ShapeError(f"tile_kernels.{fn}: vocab_sizes has shape {tuple(vocab_sizes.shape)}: num_ngram_layers "
                         "and num_embed_table_per_ngram (axes 0 and 2) must be >= 1")
    cols = (n - 1) * e
    for name, t, want in (("multipliers", multipliers, (layers, n)), ("vocab_sizes", vocab_sizes, (layers, n - 1, e)),
                          ("offsets", offsets, (layers, cols))):
        if tuple(t.shape) != want:
            raise TensorError(f"tile_kernels.{fn}: {name} has shape {tuple(t.shape)}, expected {want} "
                              f"(num_ngram_layers={layers}, max_ngram_size={n}, num_embed_table_per_ngram={e})")
    if num_tokens == 0:  # as TileKernels: nothing to launch
        return torch.empty((layers, 0, cols), dtype=torch.int32, device=ngram_token_ids.device)
    names = {"max_ngram_size": "max_ngram_size (ngram_token_ids.shape[1])",
             "num_ngram_layers": "num_ngram_layers (vocab_sizes.shape[0])",
             "num_embed_table_per_ngram": "num_embed_table_per_ngram (vocab_sizes.shape[2])",
             "num_tokens": "num_tokens (ngram_token_ids.shape[0])"}
    require_kernel(fn, FAMILY, "engram_hash", {"max_ngram_size": n, "num_ngram_layers": layers,
                                               "num_embed_table_per_ngram": e}, names, {"num_tokens": num_tokens})
    if layers * num_tokens * cols >= 1 << 31:
        raise missing(fn, FAMILY, f"num_tokens={num_tokens} (an output of {layers * num_tokens * cols} elements: "
                                  "tkjit's kernel indexes at most 2**31 - 1)")
    return ops.engram_hash(ngram_token_ids.contiguous(), multipliers.contiguous(),
                           rows_aligned(vocab_sizes.contiguous()), rows_aligned(offsets.contiguous()))


