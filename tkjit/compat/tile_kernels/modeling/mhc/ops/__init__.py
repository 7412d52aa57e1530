"""TileKernels' `modeling.mhc.ops`: the mHC ops. tkjit serves `sinkhorn_normalize` (its sinkhorn_fwd /
sinkhorn_bwd kernels), `expand_to_mhc` (expand_to_mhc / expand_to_mhc_bwd), `mhc_pre_apply_mix`
(pre_apply_mix / pre_apply_mix_bwd[_acc]), `mhc_post`, `mhc_post_fwd`, `mhc_post_bwd` (its mhc_post_fwd /
mhc_post_bwd kernels), `mhc_head_compute_mix` (mhc_head_compute_mix / mhc_head_compute_mix_bwd),
`mhc_pre_split_mixes` (mhc_pre_split_mixes / mhc_pre_split_mixes_bwd), `mhc_pre_norm_fn` (mhc_pre_norm_fn /
mhc_pre_norm_fn_bwd), `mhc_multilayer_recompute` (mhc_multilayer_recompute) and `mhc_pre_big_fuse`
(mhc_pre_norm_fn's GEMM, then mhc_pre_big_fuse)."""

from __future__ import annotations

import torch

from tkjit import ops
from tkjit.autograd import plain
from tkjit.compat.tile_kernels._support import as_float, as_int, require_kernel, rows_aligned, tensor
from tkjit.errors import ShapeError, TensorError

FAMILY = "mhc"
__all__ = [
    "expand_to_mhc", "mhc_head_compute_mix", "mhc_multilayer_recompute", "mhc_pre_norm_fn", "mhc_post",
    "mhc_post_bwd", "mhc_post_fwd", "mhc_pre_apply_mix", "mhc_pre_big_fuse", "mhc_pre_split_mixes",
    "sinkhorn_normalize",
]


def sinkhorn_normalize(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation of each n x n matrix of x (..., n, n) float32, differentiable.

    y = softmax(x, -1) + eps; y /= colsum(y) + eps; then (repeat - 1) times: rowsum, colsum. Returns a
    new contiguous tensor of x's shape (TileKernels: `x.contiguous().view(-1, n, n)`, normalised,
    `.view_as(x)`); its gradient runs tkjit's sinkhorn_bwd kernel. Not bit-identical to TileKernels'
    kernel (another order of float operations): within the rtol 1e-5 both keep to the torch reference.
    tkjit's fastest configs use fast-math exp and reciprocal-multiplies, which move the last bits;
    TKJIT_EXACT_MATH=1 (set before the first call) serves the same configs with IEEE exp and divisions.
    """
    fn = "modeling.mhc.ops.sinkhorn_normalize"
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise TensorError(f"tile_kernels.{fn}: x must be a (..., n, n) tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype != torch.float32:
        raise TensorError(f"tile_kernels.{fn}: x must be torch.float32, got {x.dtype}")
    repeat, eps = as_int(fn, "repeat", repeat), as_float(fn, "eps", eps)
    require_kernel(fn, FAMILY, "sinkhorn_fwd", {"n": x.shape[-1], "repeat": repeat, "eps": eps},
                   {"n": "n (x.shape[-1])", "num_tokens": "num_tokens (x.numel() / n**2)"},
                   {"num_tokens": max(1, x.numel() // max(1, x.shape[-1] ** 2))})
    return ops.sinkhorn(x, repeat, eps)


def expand_to_mhc(hidden: torch.Tensor, mhc_mult: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden (..., hidden) bfloat16, contiguous -> (..., mhc_mult, hidden) bfloat16: each row copied to its
    mhc_mult residual streams, bit-exact; written into `out` (that shape, contiguous) when given.
    Differentiable: hidden's gradient is the streams' gradients summed in float32 in stream order from +0.0 and
    rounded once to bfloat16, bit-identical to TileKernels' backward kernel."""
    fn = "modeling.mhc.ops.expand_to_mhc"
    mhc_mult = as_int(fn, "mhc_mult", mhc_mult)
    ops.check_expand_to_mhc(f"tile_kernels.{fn}", hidden, mhc_mult, out)
    h = hidden.shape[-1]
    require_kernel(fn, FAMILY, "expand_to_mhc", {"mhc_mult": mhc_mult, "hidden": h},
                   {"hidden": "hidden (hidden.shape[-1])"}, {"num_tokens": max(1, hidden.numel() // max(1, h))})
    return ops.expand_to_mhc(hidden, mhc_mult, out)


def mhc_head_compute_mix(
    input_mix: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_pre_eps: float,
) -> torch.Tensor:
    """Differentiable mHC head mix: input_mix (n0, n1, mhc_mult) float32, mhc_scale (1,), mhc_base (mhc_mult,)
    float32 -> sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps, a new float32 tensor of input_mix's
    shape. Gradients for input_mix, mhc_scale and mhc_base (TileKernels' MHCHeadComputeMix); the parameters'
    are sums over the tokens in an order of tkjit's (per-block partials summed in float32, as TileKernels'),
    within float32 rounding of TileKernels'."""
    fn = "modeling.mhc.ops.mhc_head_compute_mix"
    tensor(fn, "input_mix", input_mix, (3,))
    eps = as_float(fn, "mhc_pre_eps", mhc_pre_eps)
    m = ops.check_head_compute_mix(f"tile_kernels.{fn}", input_mix, mhc_scale, mhc_base)
    require_kernel(fn, FAMILY, "mhc_head_compute_mix", {"mhc_mult": m, "mhc_pre_eps": eps},
                   {"mhc_mult": "mhc_mult (input_mix.shape[-1])", "mhc_pre_eps": "mhc_pre_eps"},
                   {"num_tokens": max(1, input_mix.shape[0] * input_mix.shape[1])})
    return ops.mhc_head_compute_mix(input_mix, mhc_scale, mhc_base, eps)


def mhc_multilayer_recompute(
    initial_residual: torch.Tensor,
    pre_mix_list: list[torch.Tensor],
    layer_output_list: list[torch.Tensor],
    post_mix_list: list[torch.Tensor],
    comb_mix_list: list[torch.Tensor],
    layer_input_list: list[torch.Tensor],
    residual_list: list[torch.Tensor],
) -> None:
    """Recompute num_layers mHC blocks' layer inputs and residuals in place, in one kernel (TileKernels'
    activation recomputation): from res = initial_residual (..., mhc_mult, hidden) bf16, per layer l
    layer_input_list[l] = mhc_pre_apply_mix(res, pre_mix_list[l]) and, for l < len(layer_output_list),
    res = residual_list[l] = mhc_post_fwd(layer_output_list[l], res, post_mix_list[l], comb_mix_list[l]);
    bit-identical to those ops (TileKernels checks its kernel against its ops with torch.equal). The lists'
    tensors are TileKernels' per-layer shapes: pre_mix / post_mix (..., mhc_mult, 1), comb_mix (..., mhc_mult,
    mhc_mult) float32, layer_output / layer_input (..., hidden), residual (..., mhc_mult, hidden) bf16, each
    holding initial_residual's tokens (only their element counts are checked, as TileKernels reads them through
    raw pointers).

    tkjit's kernels take tensors, not lists of pointers: the lists are stacked into one tensor per argument (a
    copy of the layer outputs and mixes, and of the results back into layer_input_list / residual_list: about
    twice the kernel's own traffic) unless a list's tensors already are consecutive contiguous slices of one
    buffer (e.g. `torch.empty(num_layers, *shape).unbind(0)`), which are read and written in place."""
    fn = "modeling.mhc.ops.mhc_multilayer_recompute"
    tensor(fn, "initial_residual", initial_residual, tuple(range(2, 9)), (torch.bfloat16,))
    lists = {"pre_mix_list": pre_mix_list, "layer_output_list": layer_output_list, "post_mix_list": post_mix_list,
             "comb_mix_list": comb_mix_list, "layer_input_list": layer_input_list, "residual_list": residual_list}
    for name, items in lists.items():
        if not isinstance(items, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in items):
            raise TensorError(f"tile_kernels.{fn}: {name} must be a list of torch.Tensor, got {type(items).__name__}")
    num_layers, num_post = len(pre_mix_list), len(layer_output_list)
    for name in ("layer_input_list",):
        if len(lists[name]) != num_layers:
            raise ShapeError(f"tile_kernels.{fn}: {name} has {len(lists[name])} tensors, pre_mix_list {num_layers}")
    for name in ("post_mix_list", "comb_mix_list", "residual_list"):
        if len(lists[name]) != num_post:
            raise ShapeError(f"tile_kernels.{fn}: {name} has {len(lists[name])} tensors, layer_output_list {num_post}")
    if num_layers < 1 or num_post not in (num_layers, num_layers - 1):
        raise ShapeError(f"tile_kernels.{fn}: post count ({num_post}) must be num_layers-1 or num_layers "
                         f"(num_layers={num_layers}, at least 1)")
    m, h = initial_residual.shape[-2:]
    n = initial_residual.numel() // max(1, m * h)
    per_token = {"pre_mix_list": (m, torch.float32), "layer_output_list": (h, torch.bfloat16),
                 "post_mix_list": (m, torch.float32), "comb_mix_list": (m * m, torch.float32),
                 "layer_input_list": (h, torch.bfloat16), "residual_list": (m * h, torch.bfloat16)}
    for name, items in lists.items():
        size, dtype = per_token[name]
        for i, t in enumerate(items):
            if t.dtype != dtype:
                raise TensorError(f"tile_kernels.{fn}: {name}[{i}] must be {dtype}, got {t.dtype}")
            if t.numel() != n * size:
                raise TensorError(f"tile_kernels.{fn}: {name}[{i}] must hold {n} tokens of {size} values "
                                  f"(initial_residual {tuple(initial_residual.shape)}), got shape {tuple(t.shape)}")
            if t.device != initial_residual.device:
                raise TensorError(f"tile_kernels.{fn}: {name}[{i}] is on {t.device}, initial_residual on "
                                  f"{initial_residual.device}")
    names = {"mhc_mult": "mhc_mult (initial_residual.shape[-2])", "hidden": "hidden (initial_residual.shape[-1])",
             "num_layers": "num_layers (len(pre_mix_list))", "num_post": "num_post (len(layer_output_list))"}
    if num_post:
        require_kernel(fn, FAMILY, "mhc_multilayer_recompute",
                       {"mhc_mult": m, "hidden": h, "num_layers": num_layers, "num_post": num_post}, names,
                       {"num_tokens": max(1, n)})
    else:  # one layer without a post: pre_apply_mix's kernel
        require_kernel(fn, FAMILY, "pre_apply_mix", {"mhc_mult": m, "hidden": h}, names, {"num_tokens": max(1, n)})
    shapes = {"pre_mix_list": (n, m), "layer_output_list": (n, h), "post_mix_list": (n, m),
              "comb_mix_list": (n, m, m), "layer_input_list": (n, h), "residual_list": (n, m, h)}
    dev = initial_residual.device
    with torch.no_grad():
        ins = [ops.stacked_layers(lists[k], shapes[k], per_token[k][1], dev) for k in
               ("pre_mix_list", "layer_output_list", "post_mix_list", "comb_mix_list")]
        outs = [ops.stacked_layers(lists[k], shapes[k], per_token[k][1], dev, read=False) for k in
                ("layer_input_list", "residual_list")]
        ops.mhc_multilayer_recompute(_flat(initial_residual, n, m, h), *ins, out=tuple(outs))
        for k, o in zip(("layer_input_list", "residual_list"), outs):
            if not ops.is_storage_of(lists[k], o):
                for t, v in zip(lists[k], o):
                    t.copy_(v.view(t.shape))



def mhc_pre_norm_fn(
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    fuse_grad_acc: bool = True,
    n_splits: int = 16,
) -> torch.Tensor:
    """Differentiable mHC pre norm_fn: residual (..., mhc_mult, hidden) bf16, mhc_fn (M, mhc_mult * hidden) float32
    (M = mhc_mult * (mhc_mult + 2); times mhc_norm_weight (mhc_mult * hidden,) float32 when given) -> (..., M)
    float32 = (x @ tf32(fn)^T) * rsqrt(sum(x**2) / (mhc_mult * hidden) + mhc_norm_eps), x a token's flattened
    residual. As TileKernels' kernel, fn is rounded to TF32 (half away from zero) and the GEMM then sums exact
    products in float32, so the results agree with TileKernels' to float32 rounding (another summation order) and
    with its float32 torch reference to TF32 rounding (about 3e-4 relative). n_splits (split-K) is accepted and,
    as in TileKernels' op, does not change the computation.

    Gradients for residual, mhc_fn and mhc_norm_weight (TileKernels' MHCPreNormFn / _MHCFnNormwMerge, the GEMM
    operand out_grad * rms rounded to TF32 as there): with fuse_grad_acc the residual's gradient is added in place
    into the one mhc_post's backward left on its storage (`residual.untyped_storage().grad_from_mhc_post`, then
    deleted) and residual gets None; where there is none (TileKernels then fails) residual gets a fresh
    gradient. With mhc_norm_weight, a `main_grad` buffer on mhc_fn or mhc_norm_weight takes its gradient in place
    (None returned for it). Under torch.compile (or FakeTensor inputs) it is tkjit's custom op, which returns a
    fresh residual gradient (no storage attribute there).
    """
    fn = "modeling.mhc.ops.mhc_pre_norm_fn"
    eps = as_float(fn, "mhc_norm_eps", mhc_norm_eps)
    n_splits = as_int(fn, "n_splits", n_splits)
    if n_splits < 1:
        raise TensorError(f"tile_kernels.{fn}: n_splits must be >= 1, got {n_splits}")
    if not isinstance(fuse_grad_acc, bool):
        raise TensorError(f"tile_kernels.{fn}: fuse_grad_acc must be a bool, got {fuse_grad_acc!r}")
    m3, k = ops.check_pre_norm_fn(f"tile_kernels.{fn}", residual, mhc_fn, mhc_norm_weight)
    require_kernel(fn, FAMILY, "mhc_pre_norm_fn", {"mhc_mult3": m3, "mhc_hidden": k, "norm_eps": eps},
                   {"mhc_mult3": "mhc_mult3 (mhc_fn.shape[0])", "mhc_hidden": "mhc_hidden (mhc_fn.shape[1])",
                    "norm_eps": "mhc_norm_eps"},
                   {"num_tokens": max(1, residual.numel() // max(1, k))})
    return ops.mhc_pre_norm_fn(residual, mhc_fn, mhc_norm_weight, eps, fuse_grad_acc)


def _post_args(fn: str, x, residual, post_layer_mix, comb_res_mix) -> tuple[int, int, int, int]:
    """TileKernels' asserts on mhc_post's inputs, as TensorError naming the argument; (n0, n1, mhc, hidden)."""
    tensor(fn, "residual", residual, (4,), (torch.bfloat16,))
    n0, n1, m, h = residual.shape
    want = {"x": ((n0, n1, h), torch.bfloat16), "post_layer_mix": ((n0, n1, m, 1), torch.float32),
            "comb_res_mix": ((n0, n1, m, m), torch.float32)}
    for name, t in (("x", x), ("post_layer_mix", post_layer_mix), ("comb_res_mix", comb_res_mix)):
        shape, dtype = want[name]
        tensor(fn, name, t, (len(shape),), (dtype,))
        if tuple(t.shape) != shape:
            raise TensorError(f"tile_kernels.{fn}: {name} must have shape {shape} (residual is "
                              f"{tuple(residual.shape)}), got {tuple(t.shape)}")
        if t.device != residual.device:
            raise TensorError(f"tile_kernels.{fn}: {name} is on {t.device}, residual on {residual.device}")
    require_kernel(fn, FAMILY, "mhc_post_fwd", {"mhc": m, "hidden": h},
                   {"mhc": "mhc (residual.shape[2])", "hidden": "hidden (residual.shape[3])"},
                   {"num_tokens": max(1, n0 * n1)})
    return n0, n1, m, h


def _flat(t: torch.Tensor, *shape: int) -> torch.Tensor:
    return rows_aligned(t.reshape(shape).contiguous())


class _MHCPost(torch.autograd.Function):
    """TileKernels' MHCPost: mhc_post_fwd, and mhc_post_bwd (fuse_grad_acc=True) as its backward."""

    @staticmethod
    def forward(ctx, x, residual, post_layer_mix, comb_res_mix, out):
        out = mhc_post_fwd(x, residual, post_layer_mix, comb_res_mix, out)
        ctx.save_for_backward(x, residual, post_layer_mix, comb_res_mix)
        return out

    @staticmethod
    def backward(ctx, d_o):
        return (*mhc_post_bwd(*ctx.saved_tensors, d_o.to(torch.bfloat16)), None)


def _check_out(fn: str, out: torch.Tensor, shape: tuple[int, ...]) -> None:
    """mhc_post's out=: bf16, residual's shape, contiguous (TileKernels' kernel writes it as such)."""
    tensor(fn, "out", out, (4,), (torch.bfloat16,))
    if tuple(out.shape) != shape or not out.is_contiguous():
        raise TensorError(f"tile_kernels.{fn}: out must be a contiguous {shape} tensor, got shape "
                          f"{tuple(out.shape)} strides {out.stride()}")


def mhc_post(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable mHC post mix: out (n0, n1, mhc, hidden) bf16 = post_layer_mix * x + comb_res_mix^T @
    residual per token, from x (n0, n1, hidden) and residual (n0, n1, mhc, hidden) bf16, post_layer_mix
    (n0, n1, mhc, 1) and comb_res_mix (n0, n1, mhc, mhc) float32 (written into out when given).

    Its backward is mhc_post_bwd with fuse_grad_acc=True, as TileKernels': grad_residual is also left on
    residual's storage (`grad_from_mhc_post`) for the mHC ops before it to accumulate into. Under
    torch.compile (or for FakeTensor inputs) it is tkjit's custom op instead (`tkjit.ops.mhc_post`), which
    returns the same gradients without that attribute; out= is then filled by a copy (out itself is returned,
    its gradient flowing to the inputs as in eager code). Not bit-identical to
    TileKernels' kernels in the float32 gradients (another summation order over hidden).
    """
    fn = "modeling.mhc.ops.mhc_post"
    _post_args(fn, x, residual, post_layer_mix, comb_res_mix)
    tensors = (x, residual, post_layer_mix, comb_res_mix)
    if all(plain(t) for t in tensors) and (out is None or plain(out)):
        return _MHCPost.apply(*tensors, out)
    y = ops.mhc_post(*tensors)
    if out is None:
        return y
    _check_out(fn, out, tuple(residual.shape))
    return out.copy_(y)  # out itself, its gradient y's (functionalized under torch.compile)


def mhc_post_bwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    d_o: torch.Tensor,
    fuse_grad_acc: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mhc_post's gradients given d_o = dL/d out (n0, n1, mhc, hidden) bf16: (d_x, d_residual) bf16 and
    (d_post_layer_mix, d_comb_res_mix) float32, each shaped as its input. fuse_grad_acc: d_residual is also
    set as `residual.untyped_storage().grad_from_mhc_post` (TileKernels' hand-off to the mHC ops that
    accumulate their residual gradients into it)."""
    fn = "modeling.mhc.ops.mhc_post_bwd"
    n0, n1, m, h = _post_args(fn, x, residual, post_layer_mix, comb_res_mix)
    tensor(fn, "d_o", d_o, (4,), (torch.bfloat16,))
    if tuple(d_o.shape) != (n0, n1, m, h):
        raise TensorError(f"tile_kernels.{fn}: d_o must have residual's shape {(n0, n1, m, h)}, got {tuple(d_o.shape)}")
    n = n0 * n1
    with torch.no_grad():
        d_x, d_residual, d_post, d_comb = ops.mhc_post_bwd(
            _flat(d_o, n, m, h), _flat(x, n, h), _flat(residual, n, m, h), _flat(post_layer_mix, n, m),
            _flat(comb_res_mix, n, m, m))
    if fuse_grad_acc:
        residual.untyped_storage().grad_from_mhc_post = d_residual
    return d_x.view_as(x), d_residual.view_as(residual), d_post.view_as(post_layer_mix), d_comb.view_as(comb_res_mix)


def mhc_post_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """mhc_post's forward alone (no autograd): out (n0, n1, mhc, hidden) bf16, a new tensor or `out`
    (bf16, residual's shape, contiguous). The float32 sums run in the order its compiled loop has (the
    post term fused with the first stream's rounded product, then one fused multiply-add per stream),
    rounded once to bf16."""
    fn = "modeling.mhc.ops.mhc_post_fwd"
    n0, n1, m, h = _post_args(fn, x, residual, post_layer_mix, comb_res_mix)
    if out is None:
        out = torch.empty((n0, n1, m, h), dtype=torch.bfloat16, device=residual.device)
    else:
        _check_out(fn, out, (n0, n1, m, h))
    n = n0 * n1
    with torch.no_grad():
        ops.mhc_post_fwd(_flat(x, n, h), _flat(residual, n, m, h), _flat(post_layer_mix, n, m),
                         _flat(comb_res_mix, n, m, m), out=out.view(n, m, h))
    return out


def mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., mhc_mult, hidden) bfloat16 (contiguous), mix (..., mhc_mult, 1) float32 -> (..., hidden) bfloat16,
    sum_m mix * x: float32 fused multiply-adds in stream order from +0.0, rounded once (bit-identical to
    TileKernels' kernel); written into `out` when given. Differentiable, with TileKernels' backward: x's
    gradient bf16(fma(mix, grad, base)) is added in place into mhc_post's residual gradient when x's storage
    carries one (`x.untyped_storage().grad_from_mhc_post`; x then gets None), else into zeros; mix's gradient
    <grad, x> is a float32 sum over hidden (its order, and so its last bits, are tkjit's own)."""
    fn = "modeling.mhc.ops.mhc_pre_apply_mix"
    ops.check_pre_apply_mix(f"tile_kernels.{fn}", x, mix, out)
    m, h = x.shape[-2:]
    require_kernel(fn, FAMILY, "pre_apply_mix", {"mhc_mult": m, "hidden": h},
                   {"mhc_mult": "mhc_mult (x.shape[-2])", "hidden": "hidden (x.shape[-1])"},
                   {"num_tokens": max(1, x.numel() // max(1, m * h))})
    return ops.mhc_pre_apply_mix(x, mix, out)


def mhc_pre_big_fuse(
    residual: torch.Tensor,
    fn: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    rms_eps: float,
    mhc_pre_eps: float,
    mhc_sinkhorn_eps: float,
    mhc_post_mult_value: float,
    sinkhorn_repeat: int,
    n_splits: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC's fused inference pre-processing: residual (..., mhc_mult, hidden) bf16, fn (mhc_mult * (mhc_mult + 2),
    mhc_mult * hidden) float32, mhc_scale (3,), mhc_base (mhc_mult * (mhc_mult + 2),) float32 -> (post_mix (...,
    mhc_mult, 1) float32, comb_mix (..., mhc_mult, mhc_mult) float32, layer_input (..., hidden) bf16): what
    mhc_pre_norm_fn (no norm weight; fn rounded to TF32), mhc_pre_split_mixes, sinkhorn_normalize (repeat
    sinkhorn_repeat, eps mhc_sinkhorn_eps) and mhc_pre_apply_mix compute, in two kernels (tkjit's mhc_pre_norm_fn
    GEMM, then mhc_pre_big_fuse), as TileKernels runs its GEMM and its big_fuse kernel. With the same Sinkhorn
    settings the outputs are bit-identical to tkjit's unfused ops; against TileKernels' they differ as those do
    (float32 rounding of the GEMM's summation order; Sinkhorn within rtol 1e-5). n_splits is accepted and, as in
    TileKernels' op, ignored. Inference only, as TileKernels' (no backward): its outputs do not require grad."""
    fn_name = "modeling.mhc.ops.mhc_pre_big_fuse"
    floats = {k: as_float(fn_name, k, v) for k, v in (("rms_eps", rms_eps), ("mhc_pre_eps", mhc_pre_eps),
                                                      ("mhc_sinkhorn_eps", mhc_sinkhorn_eps),
                                                      ("mhc_post_mult_value", mhc_post_mult_value))}
    repeat = as_int(fn_name, "sinkhorn_repeat", sinkhorn_repeat)
    n_splits = as_int(fn_name, "n_splits", n_splits)
    if n_splits < 1:
        raise TensorError(f"tile_kernels.{fn_name}: n_splits must be >= 1, got {n_splits}")
    m, h = ops.check_pre_big_fuse(f"tile_kernels.{fn_name}", residual, fn, mhc_scale, mhc_base)
    tokens = {"num_tokens": max(1, residual.numel() // max(1, m * h))}
    require_kernel(fn_name, FAMILY, "mhc_pre_norm_fn",
                   {"mhc_mult3": 2 * m + m * m, "mhc_hidden": m * h, "norm_eps": floats["rms_eps"]},
                   {"mhc_mult3": "mhc_mult3 (fn.shape[0])", "mhc_hidden": "mhc_hidden (fn.shape[1])",
                    "norm_eps": "rms_eps"}, tokens)
    require_kernel(fn_name, FAMILY, "mhc_pre_big_fuse", {"mhc_mult": m, "hidden": h, **floats,
                                                         "sinkhorn_repeat": repeat},
                   {"mhc_mult": "mhc_mult (residual.shape[-2])", "hidden": "hidden (residual.shape[-1])",
                    **{k: k for k in floats}, "sinkhorn_repeat": "sinkhorn_repeat"}, tokens)
    return ops.mhc_pre_big_fuse(residual, fn, mhc_scale, mhc_base, floats["rms_eps"], floats["mhc_pre_eps"],
                                floats["mhc_sinkhorn_eps"], floats["mhc_post_mult_value"], repeat)


def mhc_pre_split_mixes(
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_mult: int,
    mhc_post_mult_value: float,
    mhc_pre_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable mHC pre split: input_mixes (n0, n1, 2m + m*m) float32, mhc_scale (3,), mhc_base
    (2m + m*m,) float32, m = mhc_mult -> pre_layer_mix (n0, n1, m, 1) = sigmoid(z[..., :m]) + mhc_pre_eps,
    post_layer_mix (n0, n1, m, 1) = sigmoid(z[..., m:2m]) * mhc_post_mult_value, comb_res_mix (n0, n1, m, m)
    = z[..., 2m:], z = input_mixes * mhc_scale[k] + mhc_base (k = 0, 1, 2 by column range), float32.
    Gradients for input_mixes, mhc_scale and mhc_base (TileKernels' MHCPreSplitMixes); tkjit's backward
    recomputes the post sigmoid from input_mixes (TileKernels divides the saved output by the multiplier),
    and sums the parameters' gradients in an order of its own: within float32 rounding of TileKernels'."""
    fn = "modeling.mhc.ops.mhc_pre_split_mixes"
    mhc_mult = as_int(fn, "mhc_mult", mhc_mult)
    mult = as_float(fn, "mhc_post_mult_value", mhc_post_mult_value)
    eps = as_float(fn, "mhc_pre_eps", mhc_pre_eps)
    tensor(fn, "input_mixes", input_mixes, (3,))
    ops.check_pre_split_mixes(f"tile_kernels.{fn}", input_mixes, mhc_scale, mhc_base, mhc_mult)
    require_kernel(fn, FAMILY, "mhc_pre_split_mixes",
                   {"mhc_mult": mhc_mult, "mhc_post_mult_value": mult, "mhc_pre_eps": eps},
                   {"mhc_mult": "mhc_mult", "mhc_post_mult_value": "mhc_post_mult_value", "mhc_pre_eps": "mhc_pre_eps"},
                   {"num_tokens": max(1, input_mixes.shape[0] * input_mixes.shape[1])})
    return ops.mhc_pre_split_mixes(input_mixes, mhc_scale, mhc_base, mhc_mult, mult, eps)
