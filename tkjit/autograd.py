"""Differentiable kernel pairs.

    y = tkjit.autograd.sinkhorn(x)      # x: (..., n, n) float32, CUDA (or CPU via the C target)
    y.backward(g)                       # grad via the sinkhorn_bwd kernel

Under torch.compile (and for FakeTensor or subclass inputs) the pair is the custom op
`torch.ops.tkjit.sinkhorn_fwd` with its autograd formula registered (tkjit/torch_ops/mhc.py). In plain
eager code it is `SinkhornFunction`, the same formula as a torch.autograd.Function calling the ops'
implementations directly: the custom op's Python autograd wrapper and two dispatcher round trips
cost more host time per step than both kernels take at small sizes. Either way the backward kernel
recomputes the forward from x, so only x is saved, and it is differentiable once (double backward
raises).
"""

from __future__ import annotations

import torch

from tkjit import torch_ops
from tkjit.errors import TensorError
from tkjit.torch_ops import encode_config

_sinkhorn_fwd = torch.ops.tkjit.sinkhorn_fwd.default


def _matrices(x: torch.Tensor) -> torch.Tensor:
    """(..., n, n) as the kernels' contiguous (num_tokens, n, n): x itself where it already is."""
    n = x.shape[-1]
    return x if x.dim() == 3 and x.is_contiguous() else x.contiguous().view(-1, n, n)


class SinkhornFunction(torch.autograd.Function):
    """Eager sinkhorn_fwd / sinkhorn_bwd on (num_tokens, n, n) float32 (see the module doc)."""

    @staticmethod
    def forward(ctx, x, repeat, eps, fwd_config, bwd_config):
        # Any (..., n, n): flattened here, where autograd records nothing, rather than by views around
        # apply (each a node of its own that the backward pass walks: host time comparable to a kernel's).
        flat = _matrices(x)
        ctx.save_for_backward(flat)
        ctx.args = (repeat, eps, bwd_config)
        y = torch_ops.sinkhorn_fwd_impl(flat, repeat, eps, fwd_config)
        return y if flat is x else y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        if grad_y.dtype != x.dtype:
            grad_y = grad_y.to(x.dtype)
        shape = grad_y.shape
        if grad_y.dim() != 3 or not grad_y.is_contiguous():
            grad_y = grad_y.contiguous().view(x.shape)
        grad_enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # (the kernel call records nothing; cheaper than a no_grad block)
        try:
            grad_x = torch_ops.sinkhorn_bwd_impl(grad_y, x, *ctx.args)
        finally:
            torch.set_grad_enabled(grad_enabled)
        if grad_x.shape != shape:
            grad_x = grad_x.view(shape)
        if grad_enabled:  # create_graph=True: the gradient's own backward must say why it fails
            grad_x = _OnceDifferentiable.apply(grad_x, x)
        return grad_x, None, None, None, None


class _OnceDifferentiable(torch.autograd.Function):
    """Identity on a gradient, whose backward (a double backward) raises a clear error."""

    @staticmethod
    def forward(ctx, grad_x, x):
        return grad_x.view_as(grad_x)

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError(torch_ops.DIFFERENTIABLE_ONCE)


def plain(x: torch.Tensor) -> bool:
    """A plain tensor outside torch.compile: the eager Function serves it."""
    return type(x) is torch.Tensor and not x.is_meta and not torch.compiler.is_compiling()


# The Functions below take tensors with any leading dims and flatten them to the kernels' (num_tokens, ...)
# rows inside forward (and their gradients back inside backward), where autograd records nothing: a reshape
# around `apply` would be an autograd node of its own, and each node the backward pass walks costs host time
# comparable to a small kernel's.

def rows(t: torch.Tensor, trailing: int) -> torch.Tensor:
    """t (..., *its last `trailing` dims) as (-1, *those dims): a view where t's layout allows."""
    return t.reshape(-1, *t.shape[t.dim() - trailing:])


def shaped(grad: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """A kernel's (contiguous) gradient back in its input's shape."""
    return grad if grad is None or grad.shape == shape else grad.view(shape)


def sinkhorn(
    x: torch.Tensor, repeat: int = 10, eps: float = 1e-6, *, fwd_config=None, bwd_config=None
) -> torch.Tensor:
    """Differentiable Sinkhorn normalisation of (..., n, n) float32 matrices (TileKernels semantics)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise TensorError(f"sinkhorn: x must be a (..., n, n) tensor, got {getattr(x, 'shape', x)}")
    if x.dtype != torch.float32:
        raise TensorError(f"sinkhorn: x must be float32, got {x.dtype}")
    args = (int(repeat), float(eps), encode_config(fwd_config), encode_config(bwd_config))
    if plain(x):  # any (..., n, n): the Function flattens it without autograd nodes of its own
        if x.requires_grad and torch.is_grad_enabled():
            return SinkhornFunction.apply(x, *args)
        # Nothing to differentiate (inference, no_grad): the forward kernel alone, without the Function's
        # apply and context (several µs of host time a call, more than the kernel at small sizes).
        flat = _matrices(x)
        y = torch_ops.sinkhorn_fwd_impl(flat, *args[:3])
        return y if flat is x else y.view(x.shape)
    return _sinkhorn_fwd(_matrices(x), *args).view(x.shape)


# -- expand_to_mhc / pre_apply_mix ---------------------------------------------------------------------
# The eager pairs, as SinkhornFunction: the ops' implementations called directly (torch.compile and
# FakeTensors take the custom ops, whose autograd tkjit/torch_ops/ registers). They take TileKernels'
# (..., mhc_mult, hidden) tensors and flatten them to the kernels' rows themselves (see `rows` above).


class _MhcOnce(torch.autograd.Function):
    """Identity on a gradient, made to depend on what it depends on (the upstream gradient, the saved
    inputs), whose own backward (a double backward) raises naming the op."""

    @staticmethod
    def forward(ctx, op, grad, *deps):
        ctx.op = op
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(torch_ops.mhc_differentiable_once(ctx.op))


def _once(op: str, grad, *deps):
    # create_graph=True: the gradient's own backward must say why it fails, not silently give zeros
    if grad is None or not torch.is_grad_enabled():
        return grad
    return _MhcOnce.apply(op, grad, *deps)


class ExpandToMhcFunction(torch.autograd.Function):
    """Eager expand_to_mhc / expand_to_mhc_bwd: x (..., hidden) bf16 -> (..., mhc_mult, hidden), into `out`
    when given (as TileKernels' ExpandToMHCFn)."""

    @staticmethod
    def forward(ctx, x, mhc_mult, out, config, bwd_config):
        ctx.bwd_config, ctx.shape = bwd_config, x.shape
        h = x.shape[-1]
        o = out.view(-1, mhc_mult, h) if out is not None else None
        return torch_ops.expand_to_mhc_impl(x.view(-1, h), mhc_mult, config, out=o).view(*x.shape[:-1], mhc_mult, h)

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():
            grad_x = torch_ops.expand_to_mhc_bwd_impl(rows(grad.to(torch.bfloat16), 2).contiguous(), ctx.bwd_config)
        return _once("expand_to_mhc", shaped(grad_x, ctx.shape), grad), None, None, None, None


class PreApplyMixFunction(torch.autograd.Function):
    """Eager pre_apply_mix and its backward: x (num_tokens, mhc_mult, hidden) bf16, mix (num_tokens, mhc_mult)
    float32 -> (num_tokens, hidden) bf16, into `out` when given. The backward follows TileKernels'
    MHCPreApplyMix: when mhc_post's backward left the residual gradient on x's storage
    (`x.untyped_storage().grad_from_mhc_post`), x's gradient is added into it in place and x gets None;
    otherwise x gets a fresh gradient."""

    @staticmethod
    def forward(ctx, x, mix, out, config, bwd_config):
        m, h = x.shape[-2:]
        xf, mf = x.view(-1, m, h), mix.reshape(-1, m)
        ctx.save_for_backward(xf, mf)
        ctx.bwd_config, ctx.shapes = bwd_config, (x.shape, mix.shape)
        y = torch_ops.pre_apply_mix_impl(xf, mf, config, out=out.view(-1, h) if out is not None else None)
        return y.view(*x.shape[:-2], h)

    @staticmethod
    def backward(ctx, grad):
        x, mix = ctx.saved_tensors
        upstream, grad = grad, rows(grad.to(torch.bfloat16), 1).contiguous()
        acc = residual_grad(x)
        with torch.no_grad():
            if acc is not None:
                mix_grad = torch_ops.pre_apply_mix_bwd_acc_impl(grad, x, mix, acc, ctx.bwd_config)
                x_grad = None
            else:
                x_grad, mix_grad = torch_ops.pre_apply_mix_bwd_impl(grad, x, mix, ctx.bwd_config)
        deps = (upstream, x, mix)
        x_shape, mix_shape = ctx.shapes
        return (_once("mhc_pre_apply_mix", shaped(x_grad, x_shape), *deps),
                _once("mhc_pre_apply_mix", shaped(mix_grad, mix_shape), *deps), None, None, None)


def residual_grad(x: torch.Tensor, op: str = "mhc_pre_apply_mix", arg: str = "x",
                  owner: str = "x's") -> torch.Tensor | None:
    """The residual gradient TileKernels' mhc_post backward leaves on x's storage (`grad_from_mhc_post`),
    viewed as x (the flattened residual streams, bf16), or None when there is none. op, arg, owner: how the
    error names the op, the argument whose storage carries it and whose elements it must match."""
    acc = getattr(x.untyped_storage(), "grad_from_mhc_post", None)
    if acc is None:
        return None
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.bfloat16 or acc.numel() != x.numel() \
            or not acc.is_contiguous() or acc.device != x.device:
        raise TensorError(
            f"{op}: {arg}.untyped_storage().grad_from_mhc_post must be a contiguous bfloat16 tensor of "
            f"{owner} {x.numel()} elements on {x.device}, got {getattr(acc, 'dtype', type(acc).__name__)} "
            f"{tuple(getattr(acc, 'shape', ()))}"
        )
    return acc.view(x.shape)


# -- mhc_post ----------------------------------------------------------------------------------------
# y = tkjit.autograd.mhc_post(x, residual, post_layer_mix, comb_res_mix); y.backward(g): the
# mhc_post_fwd / mhc_post_bwd kernels, as sinkhorn above (custom op under torch.compile, this Function
# in eager code). The backward needs the forward's four inputs (saved), not its output.

_mhc_post_fwd = torch.ops.tkjit.mhc_post_fwd.default


class MhcPostFunction(torch.autograd.Function):
    """Eager mhc_post_fwd / mhc_post_bwd: x (..., hidden), residual (..., mhc, hidden), post_layer_mix (..., mhc)
    or (..., mhc, 1), comb_res_mix (..., mhc, mhc), flattened to the kernels' tokens inside (see torch_ops'
    mhc_post block)."""

    @staticmethod
    def forward(ctx, x, residual, post_layer_mix, comb_res_mix, fwd_config, bwd_config):
        m, h = residual.shape[-2:]
        flat = (x.reshape(-1, h), rows(residual, 2), post_layer_mix.reshape(-1, m), rows(comb_res_mix, 2))
        ctx.save_for_backward(*flat)
        ctx.bwd_config = bwd_config
        ctx.shapes = tuple(t.shape for t in (x, residual, post_layer_mix, comb_res_mix))
        return torch_ops.mhc_post_fwd_impl(*flat, fwd_config).view(residual.shape)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        if grad_out.dtype != torch.bfloat16:
            grad_out = grad_out.to(torch.bfloat16)
        with torch.no_grad():
            grads = torch_ops.mhc_post_bwd_impl(rows(grad_out, 2).contiguous(), *saved, ctx.bwd_config)
        grads = tuple(shaped(g, shape) for g, shape in zip(grads, ctx.shapes))
        if torch.is_grad_enabled():  # create_graph=True: the gradients' own backward must say why it fails
            grads = _MhcPostOnce.apply(*grads, *saved)
        return (*grads, None, None)


class _MhcPostOnce(torch.autograd.Function):
    """Identity on mhc_post's gradients, whose backward (a double backward) raises a clear error."""

    @staticmethod
    def forward(ctx, grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix, *inputs):
        # inputs: the forward's, so that the views are in the graph when they require grad
        return tuple(g.view_as(g) for g in (grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix))

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(torch_ops.MHC_POST_DIFFERENTIABLE_ONCE)


def mhc_post_flat(
    x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor,
    fwd_config=None, bwd_config=None,
) -> torch.Tensor:
    """Differentiable mhc_post_fwd on the kernels' flattened (num_tokens, ...) tensors."""
    args = (x, residual, post_layer_mix, comb_res_mix, encode_config(fwd_config), encode_config(bwd_config))
    return MhcPostFunction.apply(*args) if all(plain(t) for t in args[:4]) else _mhc_post_fwd(*args)


def mhc_post(
    x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor, *,
    fwd_config=None, bwd_config=None,
) -> torch.Tensor:
    """Differentiable mHC post mix (TileKernels' mhc_post): x (..., hidden) and residual (..., mhc, hidden)
    bfloat16, post_layer_mix (..., mhc, 1) or (..., mhc) and comb_res_mix (..., mhc, mhc) float32 ->
    out (..., mhc, hidden) bfloat16 = post_layer_mix * x + comb_res_mix^T @ residual."""
    x, residual, post_layer_mix, comb_res_mix = mhc_post_args("mhc_post", x, residual, post_layer_mix, comb_res_mix)
    tensors = (x, residual, post_layer_mix, comb_res_mix)
    if all(plain(t) for t in tensors):  # the Function flattens the leading dims itself: no view nodes around it
        return MhcPostFunction.apply(*tensors, encode_config(fwd_config), encode_config(bwd_config))
    m, h = residual.shape[-2:]
    out = mhc_post_flat(x.reshape(-1, h), residual.reshape(-1, m, h), post_layer_mix.reshape(-1, m),
                        comb_res_mix.reshape(-1, m, m), fwd_config, bwd_config)
    return out.view(residual.shape)


def mhc_post_args(op: str, x, residual, post_layer_mix, comb_res_mix):
    """The four tensors, contiguous, or TensorError naming the one whose shape or dtype is off."""
    if not isinstance(residual, torch.Tensor) or residual.dim() < 2:
        got = getattr(residual, "shape", type(residual).__name__)
        raise TensorError(f"{op}: residual must be a (..., mhc, hidden) tensor, got {got}")
    lead, (m, h) = tuple(residual.shape[:-2]), residual.shape[-2:]
    want = {"x": (lead + (h,),), "residual": (lead + (m, h),),
            "post_layer_mix": (lead + (m, 1), lead + (m,)), "comb_res_mix": (lead + (m, m),)}
    dtypes = {"x": torch.bfloat16, "residual": torch.bfloat16, "post_layer_mix": torch.float32,
              "comb_res_mix": torch.float32}
    tensors = {"x": x, "residual": residual, "post_layer_mix": post_layer_mix, "comb_res_mix": comb_res_mix}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) not in want[name]:
            shapes = " or ".join(str(s) for s in want[name])
            raise TensorError(f"{op}: {name} must have shape {shapes} (residual is {tuple(residual.shape)}), "
                              f"got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype != dtypes[name]:
            raise TensorError(f"{op}: {name} must be {dtypes[name]}, got {t.dtype}")
    return tuple(t.contiguous() for t in tensors.values())


# -- mhc_head_compute_mix / mhc_pre_split_mixes ------------------------------------------------------
# The eager pairs, as MhcPostFunction: the ops' implementations called directly (torch.compile and
# FakeTensors take the custom ops, whose autograd tkjit/torch_ops/ registers), on float32 rows they
# flatten themselves. The backward kernels recompute the sigmoids from the inputs, so only the inputs are saved.


class MhcHeadComputeMixFunction(torch.autograd.Function):
    """Eager mhc_head_compute_mix / mhc_head_compute_mix_bwd on input_mix (..., mhc_mult) float32 (flattened to
    the kernel's rows inside)."""

    @staticmethod
    def forward(ctx, input_mix, mhc_scale, mhc_base, mhc_pre_eps, config, bwd_config):
        flat = rows(input_mix, 1).contiguous()
        ctx.save_for_backward(flat, mhc_scale, mhc_base)
        ctx.bwd_config, ctx.shape = bwd_config, input_mix.shape
        return torch_ops.mhc_head_compute_mix_impl(flat, mhc_scale, mhc_base, mhc_pre_eps, config).view(ctx.shape)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        with torch.no_grad():
            g, gs, gb = torch_ops.mhc_head_compute_mix_bwd_impl(rows(grad.float(), 1).contiguous(), *saved,
                                                                ctx.bwd_config)
        deps = (grad, *saved)
        return (*(_once("mhc_head_compute_mix", g, *deps) for g in (shaped(g, ctx.shape), gs, gb)), None, None, None)


class MhcPreSplitMixesFunction(torch.autograd.Function):
    """Eager mhc_pre_split_mixes / mhc_pre_split_mixes_bwd on input_mixes (..., 2m + m*m) float32 (flattened to
    the kernel's rows inside) -> pre (..., m, 1), post (..., m, 1), comb (..., m, m)."""

    @staticmethod
    def forward(ctx, input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps, config,
                bwd_config):
        flat = rows(input_mixes, 1).contiguous()
        ctx.save_for_backward(flat, mhc_scale, mhc_base)
        ctx.args = (mhc_mult, mhc_post_mult_value, bwd_config)
        ctx.shape = input_mixes.shape
        pre, post, comb = torch_ops.mhc_pre_split_mixes_impl(flat, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value,
                                                             mhc_pre_eps, config)
        lead, m = input_mixes.shape[:-1], mhc_mult
        return pre.view(*lead, m, 1), post.view(*lead, m, 1), comb.view(*lead, m, m)

    @staticmethod
    def backward(ctx, pre_grad, post_grad, comb_grad):
        saved = ctx.saved_tensors
        m, mult, bwd_config = ctx.args
        gs = torch_ops.split_mix_grads((pre_grad, post_grad, comb_grad), saved[0], m)
        with torch.no_grad():
            g, gs, gb = torch_ops.mhc_pre_split_mixes_bwd_impl(*gs, *saved, mult, bwd_config)
        deps = tuple(g for g in (pre_grad, post_grad, comb_grad) if g is not None) + saved
        return (*(_once("mhc_pre_split_mixes", g, *deps) for g in (shaped(g, ctx.shape), gs, gb)),
                None, None, None, None, None)


def mhc_head_compute_mix(input_mix, mhc_scale, mhc_base, mhc_pre_eps: float, fwd_config=None,
                         bwd_config=None) -> torch.Tensor:
    """Differentiable mhc_head_compute_mix on input_mix (..., mhc_mult) float32 (mhc_scale, mhc_base contiguous)."""
    args = (float(mhc_pre_eps), encode_config(fwd_config), encode_config(bwd_config))
    if plain(input_mix) and plain(mhc_scale) and plain(mhc_base):
        return MhcHeadComputeMixFunction.apply(input_mix, mhc_scale, mhc_base, *args)
    flat = rows(input_mix, 1).contiguous()
    return torch.ops.tkjit.mhc_head_compute_mix.default(flat, mhc_scale, mhc_base, *args).view(input_mix.shape)


def mhc_pre_split_mixes(input_mixes, mhc_scale, mhc_base, mhc_mult: int, mhc_post_mult_value: float,
                        mhc_pre_eps: float, fwd_config=None, bwd_config=None) -> tuple[torch.Tensor, ...]:
    """Differentiable mhc_pre_split_mixes on input_mixes (..., 2m + m*m) float32 (mhc_scale, mhc_base contiguous):
    (pre (..., m, 1), post (..., m, 1), comb (..., m, m))."""
    args = (int(mhc_mult), float(mhc_post_mult_value), float(mhc_pre_eps), encode_config(fwd_config),
            encode_config(bwd_config))
    if plain(input_mixes) and plain(mhc_scale) and plain(mhc_base):
        return MhcPreSplitMixesFunction.apply(input_mixes, mhc_scale, mhc_base, *args)
    flat = rows(input_mixes, 1).contiguous()
    pre, post, comb = torch.ops.tkjit.mhc_pre_split_mixes.default(flat, mhc_scale, mhc_base, *args)
    lead, m = input_mixes.shape[:-1], mhc_mult
    return pre.view(*lead, m, 1), post.view(*lead, m, 1), comb.view(*lead, m, m)


# -- engram_gate ---------------------------------------------------------------------------------------
# out = tkjit.autograd.engram_gate(hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps):
# TileKernels' EngramGateFn. Forward: fused_weight then engram_gate_fwd (saving dot, gate_score, rstd_x,
# rstd_k); backward: engram_gate_bwd then grad_w_reduce into the weights' float32 gradients (a weight's
# `main_grad` buffer when it has one: accumulated in place, and None returned for that weight, as
# TileKernels does). Plain eager tensors call the ops' implementations; torch.compile, FakeTensors and
# subclasses go through torch.ops.tkjit (traced; grad_w_reduce is a mutating op).


def _engram_call(eager: bool, name: str, *args):
    impl = getattr(torch_ops, f"{name}_impl") if eager else getattr(torch.ops.tkjit, name).default
    return impl(*args)


class EngramGateFunction(torch.autograd.Function):
    """Engram gate: hidden_states, k (..., hc_mult, hidden_size), v (..., hidden_size), flattened to the kernels'
    tokens inside, weight_hidden, weight_embed (hc_mult, hidden_size) bfloat16."""

    @staticmethod
    def forward(ctx, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps, num_partials):
        eager = all(plain(t) for t in (hidden_states, k, v, weight_hidden, weight_embed))
        ctx.shapes = (hidden_states.shape, k.shape, v.shape)
        hidden_states, k, v = rows(hidden_states, 2), rows(k, 2), rows(v, 1)
        weight_fused = _engram_call(eager, "fused_weight", weight_hidden, weight_embed, None)
        out, *saved = _engram_call(eager, "engram_gate_fwd", hidden_states, k, v, weight_fused, float(eps),
                                   float(clamp_value), None)
        ctx.save_for_backward(hidden_states, k, v, weight_hidden, weight_embed, weight_fused, *saved)
        ctx.args = (float(clamp_value), int(num_partials), eager)
        return out.view(ctx.shapes[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, k, v, weight_hidden, weight_embed, weight_fused, *saved = ctx.saved_tensors
        clamp_value, num_partials, eager = ctx.args
        eager = eager and plain(grad_out)
        grad_out = rows(grad_out.to(torch.bfloat16), 2).contiguous()
        with torch.no_grad():
            grad_x, grad_k, grad_v, partial = _engram_call(eager, "engram_gate_bwd", grad_out, x, k, v, weight_fused,
                                                           *saved, clamp_value, num_partials, None)
            main_wh = getattr(weight_hidden, "main_grad", None)
            main_we = getattr(weight_embed, "main_grad", None)
            grad_wh = main_wh if main_wh is not None else torch.zeros_like(weight_hidden, dtype=torch.float32)
            grad_we = main_we if main_we is not None else torch.zeros_like(weight_embed, dtype=torch.float32)
            _engram_call(eager, "grad_w_reduce", partial, weight_hidden, weight_embed, grad_wh, grad_we, None)
        deps = (grad_out, x, k, v, weight_hidden, weight_embed)
        once = [_once("engram_gate", shaped(g, shape), *deps) for g, shape in zip((grad_x, grad_k, grad_v), ctx.shapes)]
        return (*once, None if main_wh is not None else _once("engram_gate", grad_wh, *deps),
                None if main_we is not None else _once("engram_gate", grad_we, *deps), None, None, None)


def engram_gate(hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight_hidden: torch.Tensor,
                weight_embed: torch.Tensor, clamp_value: float, eps: float, *,
                num_partials: int = torch_ops.ENGRAM_PARTIALS) -> torch.Tensor:
    """Differentiable fused Engram gate (TileKernels' EngramGateFn): hidden_states, k (..., hc_mult,
    hidden_size), v (..., hidden_size), weight_hidden, weight_embed (hc_mult, hidden_size), all bfloat16
    -> out (..., hc_mult, hidden_size) bfloat16 = x + sigmoid(signed sqrt(RMSNorm dot)) * v."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        raise TensorError(f"engram_gate: hidden_states must be a (..., hc_mult, hidden_size) tensor, got "
                          f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    m, h = hidden_states.shape[-2:]
    lead = tuple(hidden_states.shape[:-2])
    want = {"k": lead + (m, h), "v": lead + (h,), "weight_hidden": (m, h), "weight_embed": (m, h)}
    for name, t in (("k", k), ("v", v), ("weight_hidden", weight_hidden), ("weight_embed", weight_embed)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want[name]:
            raise TensorError(f"engram_gate: {name} must have shape {want[name]} (hidden_states is "
                              f"{tuple(hidden_states.shape)}), got {getattr(t, 'shape', type(t).__name__)}")
    # (the Function flattens the leading dims itself: no view nodes around it)
    return EngramGateFunction.apply(hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps, num_partials)


# -- mhc_pre_norm_fn -----------------------------------------------------------------------------------
# The eager pair, as MhcPostFunction (torch.compile and FakeTensors take torch.ops.tkjit.mhc_pre_norm_fn, whose
# autograd tkjit/torch_ops/ registers, with a fresh residual gradient). TileKernels' MHCPreNormFn: with
# fuse_grad_acc the residual's gradient is added in place into the one mhc_post's backward left on the
# residual's storage (`grad_from_mhc_post`, then deleted) and the residual gets None. Where TileKernels would
# fail (fuse_grad_acc and no such gradient), tkjit returns a fresh gradient instead. _FnNormwMerge is
# TileKernels' _MHCFnNormwMerge: fn * norm_weight, whose gradients go into a `main_grad` buffer in place when
# the parameter has one (None returned for it).


class MhcPreNormFnFunction(torch.autograd.Function):
    """Eager mhc_pre_norm_fn / mhc_pre_norm_fn_bwd on the residual (..., mhc_mult, hidden) bf16 (the kernels' x
    (num_tokens, K), K = mhc_mult * hidden, inside), fn (M, K) float32 -> (..., M)."""

    @staticmethod
    def forward(ctx, residual, fn, norm_eps, fuse_grad_acc, config, bwd_config):
        # (a contiguous residual's own storage: fuse_grad_acc reads mhc_post's gradient off it)
        x = residual.reshape(-1, residual.shape[-2] * residual.shape[-1]).contiguous()
        out, out_mul, sqrsum = torch_ops.mhc_pre_norm_fn_impl(x, fn, norm_eps, config)
        ctx.save_for_backward(x, fn, out_mul, sqrsum)
        ctx.args = (float(norm_eps), bool(fuse_grad_acc), bwd_config)
        ctx.shape = residual.shape
        return out.view(*residual.shape[:-2], out.shape[-1])

    @staticmethod
    def backward(ctx, out_grad):
        x, fn, out_mul, sqrsum = ctx.saved_tensors
        norm_eps, fuse, bwd_config = ctx.args
        storage = x.untyped_storage()
        acc = residual_grad(x, "mhc_pre_norm_fn", "residual", "the residual's") if fuse else None
        with torch.no_grad():
            x_grad, fn_grad = torch_ops.mhc_pre_norm_fn_bwd_impl(rows(out_grad.float(), 1).contiguous(), out_mul,
                                                                sqrsum, x, fn, norm_eps, bwd_config, x_grad=acc)
        if acc is not None:
            del storage.grad_from_mhc_post
            x_grad = None
        deps = (out_grad, x, fn)
        return (_once("mhc_pre_norm_fn", shaped(x_grad, ctx.shape), *deps), _once("mhc_pre_norm_fn", fn_grad, *deps),
                None, None, None, None)


class FnNormwMergeFunction(torch.autograd.Function):
    """fn (M, K) * norm_weight (K,) float32; gradients into `main_grad` buffers in place where present."""

    @staticmethod
    def forward(ctx, fn, norm_weight):
        ctx.main = (getattr(fn, "main_grad", None), getattr(norm_weight, "main_grad", None))
        ctx.save_for_backward(fn, norm_weight)
        return fn * norm_weight

    @staticmethod
    def backward(ctx, grad):
        fn, norm_weight = ctx.saved_tensors
        fn_main, w_main = ctx.main
        with torch.no_grad():
            fn_grad = grad * norm_weight
            w_grad = (grad * fn).sum(0)
            if fn_main is not None:
                fn_main.add_(fn_grad)
                fn_grad = None
            if w_main is not None:
                w_main.add_(w_grad)
                w_grad = None
        return fn_grad, w_grad


def mhc_pre_norm_fn(residual: torch.Tensor, fn: torch.Tensor, norm_eps: float, fuse_grad_acc: bool = True,
                    fwd_config=None, bwd_config=None) -> torch.Tensor:
    """Differentiable mhc_pre_norm_fn on the residual (..., mhc_mult, hidden) bf16 and fn (M, mhc_mult * hidden)
    float32 -> (..., M)."""
    args = (float(norm_eps), encode_config(fwd_config), encode_config(bwd_config))
    if plain(residual) and plain(fn):  # (the Function flattens the leading dims itself: one autograd node)
        return MhcPreNormFnFunction.apply(residual, fn, args[0], bool(fuse_grad_acc), *args[1:])
    x = residual.reshape(-1, fn.shape[-1]).contiguous()
    return torch.ops.tkjit.mhc_pre_norm_fn.default(x, fn, *args)[0].view(*residual.shape[:-2], fn.shape[0])


def fn_normw_merge(fn: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """fn * norm_weight (TileKernels' _MHCFnNormwMerge: `main_grad` buffers take the gradients in place)."""
    if plain(fn) and plain(norm_weight):
        return FnNormwMergeFunction.apply(fn, norm_weight)
    return fn * norm_weight
