"""torch.ops.tkjit ops of the mHC family: Sinkhorn, expand_to_mhc, pre_apply_mix, mhc_post, the mixes,
mhc_pre_norm_fn, mhc_multilayer_recompute and mhc_pre_big_fuse (with their registered autograd)."""

import torch

from tkjit.errors import ShapeError, TensorError
from tkjit.spec import pow2_bucket
from tkjit.torch_ops.checks import check, fake_check, need, need_contiguous, need_dtype
from tkjit.torch_ops.serve import kernel_for, kernel_of

# -- sinkhorn ----------------------------------------------------------------------------------------

def _sinkhorn_shape(name: str, x, repeat, eps) -> dict:
    need(x, (3,), name)
    return {"num_tokens": max(1, x.shape[0]), "n": x.shape[1], "repeat": repeat, "eps": eps}


def sinkhorn_fwd_impl(x, repeat=10, eps=1e-6, config=None, bwd_config=None):
    """(num_tokens, n, n) float32 -> Sinkhorn-normalised; its gradient runs sinkhorn_bwd (config bwd_config)."""
    return kernel_for("sinkhorn_fwd", x, (repeat, eps), config,
                       lambda: _sinkhorn_shape("sinkhorn_fwd", x, repeat, eps))(x)


sinkhorn_fwd = torch.library.custom_op(
    "tkjit::sinkhorn_fwd",
    mutates_args=(),
    schema="(Tensor x, int repeat=10, float eps=1e-06, str? config=None, str? bwd_config=None) -> Tensor",
)(sinkhorn_fwd_impl)


@sinkhorn_fwd.register_fake
def _(x, repeat=10, eps=1e-6, config=None, bwd_config=None):
    need(x, (3,), "sinkhorn_fwd")
    fake_check("sinkhorn_fwd", {"n": int(x.shape[1]), "repeat": repeat, "eps": eps}, x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def sinkhorn_bwd_impl(grad_out, x, repeat=10, eps=1e-6, config=None):
    """dL/dx of sinkhorn_fwd(x) given dL/dy = grad_out, both (num_tokens, n, n) float32."""
    return kernel_for("sinkhorn_bwd", x, (repeat, eps), config,
                       lambda: _sinkhorn_shape("sinkhorn_bwd", x, repeat, eps))(grad_out, x)


sinkhorn_bwd = torch.library.custom_op(
    "tkjit::sinkhorn_bwd",
    mutates_args=(),
    schema="(Tensor grad_out, Tensor x, int repeat=10, float eps=1e-06, str? config=None) -> Tensor",
)(sinkhorn_bwd_impl)


@sinkhorn_bwd.register_fake
def _(grad_out, x, repeat=10, eps=1e-6, config=None):
    need(x, (3,), "sinkhorn_bwd")
    fake_check("sinkhorn_bwd", {"n": int(x.shape[1]), "repeat": repeat, "eps": eps}, grad_out, x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _sinkhorn_setup_context(ctx, inputs, output):
    x, repeat, eps, _, bwd_config = inputs
    ctx.save_for_backward(x)
    ctx.args = (repeat, eps, bwd_config)


def _sinkhorn_backward(ctx, grad_y):
    (x,) = ctx.saved_tensors
    if grad_y.dtype != x.dtype:
        grad_y = grad_y.to(x.dtype)
    return torch.ops.tkjit.sinkhorn_bwd.default(grad_y.contiguous(), x, *ctx.args), None, None, None, None


DIFFERENTIABLE_ONCE = (
    "tkjit: sinkhorn is differentiable once: sinkhorn_bwd has no gradient (double backward, e.g. a "
    "gradient penalty through create_graph=True, is not supported)"
)


def _no_double_backward(ctx, grad):
    raise RuntimeError(DIFFERENTIABLE_ONCE)


sinkhorn_fwd.register_autograd(_sinkhorn_backward, setup_context=_sinkhorn_setup_context)
sinkhorn_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# -- expand_to_mhc / pre_apply_mix (mHC residual streams) --------------------------------------------

def _streams_shape(x, mhc_mult, hidden) -> dict:
    return {"num_tokens": max(1, int(x.shape[0])), "mhc_mult": mhc_mult, "hidden": hidden}


def expand_to_mhc_impl(x, mhc_mult, config=None, bwd_config=None, out=None):
    """(num_tokens, hidden) bf16 -> (num_tokens, mhc_mult, hidden) bf16, each row copied to every stream;
    its gradient runs expand_to_mhc_bwd (config bwd_config). out: written in place (eager callers only)."""
    need(x, (2,), "expand_to_mhc")
    kern = kernel_of("expand_to_mhc", _streams_shape(x, mhc_mult, int(x.shape[1])), x, config)
    return kern(x, out=out) if out is not None else kern(x)


expand_to_mhc = torch.library.custom_op(
    "tkjit::expand_to_mhc", mutates_args=(),
    schema="(Tensor x, int mhc_mult, str? config=None, str? bwd_config=None) -> Tensor",
)(expand_to_mhc_impl)


@expand_to_mhc.register_fake
def _(x, mhc_mult, config=None, bwd_config=None, out=None):
    need(x, (2,), "expand_to_mhc")
    fake_check("expand_to_mhc", {"mhc_mult": mhc_mult, "hidden": int(x.shape[1])}, x)
    return x.new_empty((x.shape[0], mhc_mult, x.shape[1]))


def expand_to_mhc_bwd_impl(out_grad, config=None):
    """(num_tokens, mhc_mult, hidden) bf16 -> (num_tokens, hidden) bf16: the streams summed in float32, in order."""
    need(out_grad, (3,), "expand_to_mhc_bwd")
    shape = _streams_shape(out_grad, int(out_grad.shape[1]), int(out_grad.shape[2]))
    return kernel_of("expand_to_mhc_bwd", shape, out_grad, config)(out_grad)


expand_to_mhc_bwd = torch.library.custom_op(
    "tkjit::expand_to_mhc_bwd", mutates_args=(), schema="(Tensor out_grad, str? config=None) -> Tensor",
)(expand_to_mhc_bwd_impl)


@expand_to_mhc_bwd.register_fake
def _(out_grad, config=None):
    need(out_grad, (3,), "expand_to_mhc_bwd")
    fake_check("expand_to_mhc_bwd", {"mhc_mult": int(out_grad.shape[1]), "hidden": int(out_grad.shape[2])}, out_grad)
    return out_grad.new_empty((out_grad.shape[0], out_grad.shape[2]))


def _mix_static(name, x, mix) -> dict:
    need(x, (3,), name)
    need(mix, (2,), f"{name}: mix")
    return {"mhc_mult": int(x.shape[1]), "hidden": int(x.shape[2])}


def pre_apply_mix_impl(x, mix, config=None, bwd_config=None, out=None):
    """x (num_tokens, mhc_mult, hidden) bf16, mix (num_tokens, mhc_mult) float32 -> (num_tokens, hidden) bf16:
    sum_m mix * x as fused multiply-adds in stream order, rounded once; its gradient runs pre_apply_mix_bwd."""
    static = _mix_static("pre_apply_mix", x, mix)
    kern = kernel_of("pre_apply_mix", {"num_tokens": max(1, int(x.shape[0])), **static}, x, config)
    return kern(x, mix, out=out) if out is not None else kern(x, mix)


pre_apply_mix = torch.library.custom_op(
    "tkjit::pre_apply_mix", mutates_args=(),
    schema="(Tensor x, Tensor mix, str? config=None, str? bwd_config=None) -> Tensor",
)(pre_apply_mix_impl)


@pre_apply_mix.register_fake
def _(x, mix, config=None, bwd_config=None, out=None):
    fake_check("pre_apply_mix", _mix_static("pre_apply_mix", x, mix), x, mix)
    return x.new_empty((x.shape[0], x.shape[2]))


def pre_apply_mix_bwd_impl(grad_out, x, mix, config=None):
    """(x_grad, mix_grad) of pre_apply_mix: x_grad = bf16(fma(mix, grad_out, +0.0)) (num_tokens, mhc_mult,
    hidden), mix_grad = <grad_out, x> float32 (num_tokens, mhc_mult)."""
    static = _mix_static("pre_apply_mix_bwd", x, mix)
    kern = kernel_of("pre_apply_mix_bwd", {"num_tokens": max(1, int(x.shape[0])), **static}, x, config)
    return kern(grad_out, x, mix)


pre_apply_mix_bwd = torch.library.custom_op(
    "tkjit::pre_apply_mix_bwd", mutates_args=(),
    schema="(Tensor grad_out, Tensor x, Tensor mix, str? config=None) -> (Tensor, Tensor)",
)(pre_apply_mix_bwd_impl)


def _fake_mix_bwd(name, grad_out, x, mix):
    fake_check(name, _mix_static(name, x, mix), grad_out, x, mix)


@pre_apply_mix_bwd.register_fake
def _(grad_out, x, mix, config=None):
    _fake_mix_bwd("pre_apply_mix_bwd", grad_out, x, mix)
    return x.new_empty(x.shape), mix.new_empty(mix.shape)


def pre_apply_mix_bwd_acc_impl(grad_out, x, mix, x_grad, config=None):
    """pre_apply_mix_bwd adding into x_grad in place (x_grad = bf16(fma(mix, grad_out, x_grad)), TileKernels'
    accumulation into the residual gradient); returns mix_grad."""
    static = _mix_static("pre_apply_mix_bwd_acc", x, mix)
    kern = kernel_of("pre_apply_mix_bwd_acc", {"num_tokens": max(1, int(x.shape[0])), **static}, x, config)
    _, mix_grad = kern(grad_out, x, mix, x_grad)
    return mix_grad


pre_apply_mix_bwd_acc = torch.library.custom_op(
    "tkjit::pre_apply_mix_bwd_acc", mutates_args=("x_grad",),
    schema="(Tensor grad_out, Tensor x, Tensor mix, Tensor(a!) x_grad, str? config=None) -> Tensor",
)(pre_apply_mix_bwd_acc_impl)


@pre_apply_mix_bwd_acc.register_fake
def _(grad_out, x, mix, x_grad, config=None):
    _fake_mix_bwd("pre_apply_mix_bwd_acc", grad_out, x, mix)
    fake_check("pre_apply_mix_bwd_acc", _mix_static("pre_apply_mix_bwd_acc", x, mix), grad_out, x, mix, x_grad)
    return mix.new_empty(mix.shape)


def mhc_differentiable_once(op: str) -> str:
    return (f"tkjit: {op} is differentiable once: its backward kernel has no gradient (double backward, e.g. "
            "through create_graph=True, is not supported)")


def _expand_to_mhc_setup_context(ctx, inputs, output):
    ctx.bwd_config = inputs[3]


def _expand_to_mhc_backward(ctx, grad):
    grad = grad.to(torch.bfloat16).contiguous()
    return torch.ops.tkjit.expand_to_mhc_bwd.default(grad, ctx.bwd_config), None, None, None


def _pre_apply_mix_setup_context(ctx, inputs, output):
    x, mix, _, bwd_config = inputs
    ctx.save_for_backward(x, mix)
    ctx.bwd_config = bwd_config


def _pre_apply_mix_backward(ctx, grad):
    x, mix = ctx.saved_tensors
    x_grad, mix_grad = torch.ops.tkjit.pre_apply_mix_bwd.default(grad.to(torch.bfloat16).contiguous(), x, mix,
                                                                 ctx.bwd_config)
    return x_grad, mix_grad, None, None


def _no_double_backward_of(op):
    def backward(ctx, *grads):
        raise RuntimeError(mhc_differentiable_once(op))

    return backward


expand_to_mhc.register_autograd(_expand_to_mhc_backward, setup_context=_expand_to_mhc_setup_context)
pre_apply_mix.register_autograd(_pre_apply_mix_backward, setup_context=_pre_apply_mix_setup_context)
expand_to_mhc_bwd.register_autograd(_no_double_backward_of("expand_to_mhc"),
                                    setup_context=lambda ctx, inputs, output: None)
pre_apply_mix_bwd.register_autograd(_no_double_backward_of("mhc_pre_apply_mix"),
                                    setup_context=lambda ctx, inputs, output: None)


# -- mhc_post ----------------------------------------------------------------------------------------
# torch.ops.tkjit.mhc_post_fwd(x, residual, post_layer_mix, comb_res_mix, config=None,
#                              bwd_config=None)  # differentiable
# torch.ops.tkjit.mhc_post_bwd(grad_out, x, residual, post_layer_mix, comb_res_mix, config=None)
#     -> (grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix)
# on the flattened tokens: x (num_tokens, hidden), residual and out (num_tokens, mhc, hidden) bfloat16,
# post_layer_mix (num_tokens, mhc) and comb_res_mix (num_tokens, mhc, mhc) float32.

def _mhc_post_static(name, x, residual) -> dict:
    need(x, (2,), f"{name}: x")
    need(residual, (3,), f"{name}: residual")
    return {"mhc": int(residual.shape[1]), "hidden": int(residual.shape[2])}


def mhc_post_fwd_into(x, residual, post_layer_mix, comb_res_mix, config=None, out=None):
    """mhc_post_fwd's kernel call, into `out` (num_tokens, mhc, hidden) bfloat16 when given."""
    shape = {**_mhc_post_static("mhc_post_fwd", x, residual), "num_tokens": max(1, x.shape[0])}
    k = kernel_of("mhc_post_fwd", shape, x, config)
    return k(x, residual, post_layer_mix, comb_res_mix, out=out)


def mhc_post_fwd_impl(x, residual, post_layer_mix, comb_res_mix, config=None, bwd_config=None):
    """out = post_layer_mix * x + comb_res_mix^T @ residual per token (TileKernels' mhc_post_fwd), bf16;
    its gradient runs mhc_post_bwd (config bwd_config)."""
    return mhc_post_fwd_into(x, residual, post_layer_mix, comb_res_mix, config)


mhc_post_fwd = torch.library.custom_op(
    "tkjit::mhc_post_fwd", mutates_args=(),
    schema="(Tensor x, Tensor residual, Tensor post_layer_mix, Tensor comb_res_mix, str? config=None, "
           "str? bwd_config=None) -> Tensor",
)(mhc_post_fwd_impl)


def _fake_mhc_post(name, x, residual, post_layer_mix, comb_res_mix, *extra):
    static = _mhc_post_static(name, x, residual)
    fake_check(name, static, *extra, x, residual, post_layer_mix, comb_res_mix)


@mhc_post_fwd.register_fake
def _(x, residual, post_layer_mix, comb_res_mix, config=None, bwd_config=None):
    _fake_mhc_post("mhc_post_fwd", x, residual, post_layer_mix, comb_res_mix)
    return residual.new_empty(residual.shape)


def mhc_post_bwd_impl(grad_out, x, residual, post_layer_mix, comb_res_mix, config=None):
    """(grad_x, grad_residual) bf16 and (grad_post_layer_mix, grad_comb_res_mix) float32 of mhc_post_fwd
    given grad_out = dL/d out (num_tokens, mhc, hidden) bf16."""
    shape = {**_mhc_post_static("mhc_post_bwd", x, residual), "num_tokens": max(1, x.shape[0])}
    k = kernel_of("mhc_post_bwd", shape, x, config)
    return k(grad_out, x, residual, post_layer_mix, comb_res_mix)


mhc_post_bwd = torch.library.custom_op(
    "tkjit::mhc_post_bwd", mutates_args=(),
    schema="(Tensor grad_out, Tensor x, Tensor residual, Tensor post_layer_mix, Tensor comb_res_mix, "
           "str? config=None) -> (Tensor, Tensor, Tensor, Tensor)",
)(mhc_post_bwd_impl)


@mhc_post_bwd.register_fake
def _(grad_out, x, residual, post_layer_mix, comb_res_mix, config=None):
    _fake_mhc_post("mhc_post_bwd", x, residual, post_layer_mix, comb_res_mix, grad_out)
    return (x.new_empty(x.shape), residual.new_empty(residual.shape), post_layer_mix.new_empty(post_layer_mix.shape),
            comb_res_mix.new_empty(comb_res_mix.shape))


def _mhc_post_setup_context(ctx, inputs, output):
    x, residual, post_layer_mix, comb_res_mix, _, bwd_config = inputs
    ctx.save_for_backward(x, residual, post_layer_mix, comb_res_mix)
    ctx.bwd_config = bwd_config


def _mhc_post_backward(ctx, grad_out):
    saved = ctx.saved_tensors
    if grad_out.dtype != torch.bfloat16:
        grad_out = grad_out.to(torch.bfloat16)
    grads = torch.ops.tkjit.mhc_post_bwd.default(grad_out.contiguous(), *saved, ctx.bwd_config)
    return (*grads, None, None)


MHC_POST_DIFFERENTIABLE_ONCE = (
    "tkjit: mhc_post is differentiable once: mhc_post_bwd has no gradient (double backward, e.g. "
    "create_graph=True followed by a backward through the gradients, is not supported)"
)


def _mhc_post_no_double_backward(ctx, *grads):
    raise RuntimeError(MHC_POST_DIFFERENTIABLE_ONCE)


mhc_post_fwd.register_autograd(_mhc_post_backward, setup_context=_mhc_post_setup_context)
mhc_post_bwd.register_autograd(_mhc_post_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# -- mhc_head_compute_mix / mhc_pre_split_mixes ------------------------------------------------------
# torch.ops.tkjit.mhc_head_compute_mix(input_mix, mhc_scale, mhc_base, mhc_pre_eps, config=None,
#                                      bwd_config=None)                      # differentiable
# torch.ops.tkjit.mhc_head_compute_mix_bwd(output_mix_grad, input_mix, mhc_scale, mhc_base, config=None)
#     -> (input_mix_grad, mhc_scale_grad, mhc_base_grad)
# torch.ops.tkjit.mhc_pre_split_mixes(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value,
#                                     mhc_pre_eps, config=None, bwd_config=None)  # differentiable
#     -> (pre_layer_mix, post_layer_mix, comb_res_mix)
# torch.ops.tkjit.mhc_pre_split_mixes_bwd(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad,
#                                         input_mixes, mhc_scale, mhc_base, mhc_post_mult_value, config=None)
#     -> (input_mixes_grad, mhc_scale_grad, mhc_base_grad)
# on the flattened tokens, float32: input_mix (num_tokens, mhc_mult), input_mixes (num_tokens, 2m + m*m),
# the three outputs (num_tokens, m), (num_tokens, m), (num_tokens, m*m). The backward kernels return
# per-block partial sums of the parameters' gradients; the ops sum them (float32, as TileKernels does).

def _head_static(name, input_mix) -> dict:
    need(input_mix, (2,), f"{name}: input_mix")
    return {"mhc_mult": int(input_mix.shape[1])}


def mhc_head_compute_mix_impl(input_mix, mhc_scale, mhc_base, mhc_pre_eps, config=None, bwd_config=None):
    """sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps, float32 (num_tokens, mhc_mult); its gradient
    runs mhc_head_compute_mix_bwd (config bwd_config)."""
    shape = {**_head_static("mhc_head_compute_mix", input_mix), "num_tokens": max(1, int(input_mix.shape[0])),
             "mhc_pre_eps": float(mhc_pre_eps)}
    return kernel_of("mhc_head_compute_mix", shape, input_mix, config)(
        input_mix, mhc_scale, mhc_base)


mhc_head_compute_mix = torch.library.custom_op(
    "tkjit::mhc_head_compute_mix", mutates_args=(),
    schema="(Tensor input_mix, Tensor mhc_scale, Tensor mhc_base, float mhc_pre_eps, str? config=None, "
           "str? bwd_config=None) -> Tensor",
)(mhc_head_compute_mix_impl)


@mhc_head_compute_mix.register_fake
def _(input_mix, mhc_scale, mhc_base, mhc_pre_eps, config=None, bwd_config=None):
    static = {**_head_static("mhc_head_compute_mix", input_mix), "mhc_pre_eps": float(mhc_pre_eps)}
    fake_check("mhc_head_compute_mix", static, input_mix, mhc_scale, mhc_base)
    return input_mix.new_empty(input_mix.shape)


def mhc_head_compute_mix_bwd_impl(output_mix_grad, input_mix, mhc_scale, mhc_base, config=None):
    """(input_mix_grad, mhc_scale_grad (1,), mhc_base_grad (mhc_mult,)) of mhc_head_compute_mix, float32."""
    shape = {**_head_static("mhc_head_compute_mix_bwd", input_mix), "num_tokens": max(1, int(input_mix.shape[0]))}
    k = kernel_of("mhc_head_compute_mix_bwd", shape, input_mix, config)
    grad, scale_part, base_part = k(output_mix_grad, input_mix, mhc_scale, mhc_base)
    return grad, scale_part.sum(0), base_part.sum(0)


mhc_head_compute_mix_bwd = torch.library.custom_op(
    "tkjit::mhc_head_compute_mix_bwd", mutates_args=(),
    schema="(Tensor output_mix_grad, Tensor input_mix, Tensor mhc_scale, Tensor mhc_base, str? config=None) "
           "-> (Tensor, Tensor, Tensor)",
)(mhc_head_compute_mix_bwd_impl)


@mhc_head_compute_mix_bwd.register_fake
def _(output_mix_grad, input_mix, mhc_scale, mhc_base, config=None):
    static = _head_static("mhc_head_compute_mix_bwd", input_mix)
    fake_check("mhc_head_compute_mix_bwd", static, output_mix_grad, input_mix, mhc_scale, mhc_base)
    return (input_mix.new_empty(input_mix.shape), mhc_scale.new_empty(mhc_scale.shape),
            mhc_base.new_empty(mhc_base.shape))


def _split_static(name, input_mixes, mhc_mult) -> dict:
    need(input_mixes, (2,), f"{name}: input_mixes")
    m = int(mhc_mult)
    if input_mixes.shape[1] != 2 * m + m * m:
        raise TensorError(f"{name}: input_mixes must have 2 * mhc_mult + mhc_mult**2 = {2 * m + m * m} columns "
                          f"(mhc_mult={m}), got shape {tuple(input_mixes.shape)}")
    return {"mhc_mult": m}


def mhc_pre_split_mixes_impl(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps,
                             config=None, bwd_config=None):
    """(pre_layer_mix, post_layer_mix, comb_res_mix) float32 of input_mixes (num_tokens, 2m + m*m); its
    gradient runs mhc_pre_split_mixes_bwd (config bwd_config)."""
    shape = {**_split_static("mhc_pre_split_mixes", input_mixes, mhc_mult),
             "num_tokens": max(1, int(input_mixes.shape[0])), "mhc_post_mult_value": float(mhc_post_mult_value),
             "mhc_pre_eps": float(mhc_pre_eps)}
    return kernel_of("mhc_pre_split_mixes", shape, input_mixes, config)(
        input_mixes, mhc_scale, mhc_base)


mhc_pre_split_mixes = torch.library.custom_op(
    "tkjit::mhc_pre_split_mixes", mutates_args=(),
    schema="(Tensor input_mixes, Tensor mhc_scale, Tensor mhc_base, int mhc_mult, float mhc_post_mult_value, "
           "float mhc_pre_eps, str? config=None, str? bwd_config=None) -> (Tensor, Tensor, Tensor)",
)(mhc_pre_split_mixes_impl)


@mhc_pre_split_mixes.register_fake
def _(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps, config=None, bwd_config=None):
    static = {**_split_static("mhc_pre_split_mixes", input_mixes, mhc_mult),
              "mhc_post_mult_value": float(mhc_post_mult_value), "mhc_pre_eps": float(mhc_pre_eps)}
    fake_check("mhc_pre_split_mixes", static, input_mixes, mhc_scale, mhc_base)
    n, m = input_mixes.shape[0], int(mhc_mult)
    return input_mixes.new_empty((n, m)), input_mixes.new_empty((n, m)), input_mixes.new_empty((n, m * m))


def mhc_pre_split_mixes_bwd_impl(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale,
                                 mhc_base, mhc_post_mult_value, config=None):
    """(input_mixes_grad, mhc_scale_grad (3,), mhc_base_grad (2m + m*m,)) of mhc_pre_split_mixes, float32."""
    need(pre_layer_mix_grad, (2,), "mhc_pre_split_mixes_bwd: pre_layer_mix_grad")
    static = _split_static("mhc_pre_split_mixes_bwd", input_mixes, pre_layer_mix_grad.shape[1])
    shape = {"num_tokens": max(1, int(input_mixes.shape[0])), **static,
             "mhc_post_mult_value": float(mhc_post_mult_value)}
    k = kernel_of("mhc_pre_split_mixes_bwd", shape, input_mixes, config)
    grad, scale_part, base_part = k(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes,
                                    mhc_scale, mhc_base)
    return grad, scale_part.sum(0), base_part.sum(0)


mhc_pre_split_mixes_bwd = torch.library.custom_op(
    "tkjit::mhc_pre_split_mixes_bwd", mutates_args=(),
    schema="(Tensor pre_layer_mix_grad, Tensor post_layer_mix_grad, Tensor comb_res_mix_grad, Tensor input_mixes, "
           "Tensor mhc_scale, Tensor mhc_base, float mhc_post_mult_value, str? config=None) "
           "-> (Tensor, Tensor, Tensor)",
)(mhc_pre_split_mixes_bwd_impl)


@mhc_pre_split_mixes_bwd.register_fake
def _(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale, mhc_base,
      mhc_post_mult_value, config=None):
    name = "mhc_pre_split_mixes_bwd"
    need(pre_layer_mix_grad, (2,), f"{name}: pre_layer_mix_grad")
    static = {**_split_static(name, input_mixes, int(pre_layer_mix_grad.shape[1])),
              "mhc_post_mult_value": float(mhc_post_mult_value)}
    fake_check(name, static, pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale,
                mhc_base)
    return input_mixes.new_empty(input_mixes.shape), mhc_scale.new_empty(mhc_scale.shape), \
        mhc_base.new_empty(mhc_base.shape)


def _head_compute_mix_setup_context(ctx, inputs, output):
    input_mix, mhc_scale, mhc_base, _, _, bwd_config = inputs
    ctx.save_for_backward(input_mix, mhc_scale, mhc_base)
    ctx.bwd_config = bwd_config


def _head_compute_mix_backward(ctx, grad):
    grads = torch.ops.tkjit.mhc_head_compute_mix_bwd.default(grad.float().contiguous(), *ctx.saved_tensors,
                                                             ctx.bwd_config)
    return (*grads, None, None, None)


def _pre_split_mixes_setup_context(ctx, inputs, output):
    input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, _, _, bwd_config = inputs
    ctx.save_for_backward(input_mixes, mhc_scale, mhc_base)
    ctx.args = (int(mhc_mult), float(mhc_post_mult_value), bwd_config)


def split_mix_grads(grads, input_mixes, mhc_mult):
    """The three output gradients as the backward kernel takes them: float32, contiguous, zeros for None."""
    n, m = input_mixes.shape[0], mhc_mult
    shapes = ((n, m), (n, m), (n, m * m))
    return tuple(input_mixes.new_zeros(s) if g is None else g.float().reshape(s).contiguous()
                 for g, s in zip(grads, shapes))


def _pre_split_mixes_backward(ctx, pre_grad, post_grad, comb_grad):
    input_mixes, mhc_scale, mhc_base = ctx.saved_tensors
    m, mult, bwd_config = ctx.args
    gs = split_mix_grads((pre_grad, post_grad, comb_grad), input_mixes, m)
    grads = torch.ops.tkjit.mhc_pre_split_mixes_bwd.default(*gs, input_mixes, mhc_scale, mhc_base, mult, bwd_config)
    return (*grads, None, None, None, None, None)


mhc_head_compute_mix.register_autograd(_head_compute_mix_backward, setup_context=_head_compute_mix_setup_context)
mhc_pre_split_mixes.register_autograd(_pre_split_mixes_backward, setup_context=_pre_split_mixes_setup_context)
mhc_head_compute_mix_bwd.register_autograd(_no_double_backward_of("mhc_head_compute_mix"),
                                           setup_context=lambda ctx, inputs, output: None)
mhc_pre_split_mixes_bwd.register_autograd(_no_double_backward_of("mhc_pre_split_mixes"),
                                          setup_context=lambda ctx, inputs, output: None)


# -- mhc_pre_norm_fn ---------------------------------------------------------------------------------
# torch.ops.tkjit.mhc_pre_norm_fn(x, fn, norm_eps, config=None, bwd_config=None)      # differentiable in x, fn
#     -> (out, out_mul, sqrsum)
# torch.ops.tkjit.mhc_pre_norm_fn_bwd(out_grad, out_mul, sqrsum, x, fn, norm_eps, config=None) -> (x_grad, fn_grad)
# on the flattened tokens: x (num_tokens, K) bf16, fn (M, K) float32 -> out, out_mul (num_tokens, M), sqrsum
# (num_tokens,) float32 (out_mul and sqrsum are what the backward reads; they get no gradient). fn is rounded to
# TF32 first, as TileKernels' op does before its TF32 GEMM; the backward rounds its GEMM operand
# mul_grad = out_grad * rms the same way. The norm's backward (M + 1 values a token) runs in torch here; the
# backward kernel does the GEMMs and writes per-range partials of fn's gradient, which the op sums in float32.

PRE_NORM_FN_PARTIALS = 16
PRE_NORM_FN_RANGE_TOKENS = 256


def pre_norm_fn_partials(num_tokens: int) -> int:
    """mhc_pre_norm_fn_bwd's token ranges for num_tokens: 16 (PRE_NORM_FN_PARTIALS) from 4096 tokens, halved below
    that until a range of the count's power-of-two bucket holds >= 256 tokens (the bucket: the tuned DB's key, so
    one bucket's winner serves every count in it). Each range's block loads fn's tile and writes a partial sum of
    fn's gradient; at 1024 tokens 16 ranges of 64 tokens spent more on that than on x, and 4 ranges took 140 us
    at hidden 7168 against 222 us (TileKernels 147; an H100, benchmarks/h200/2026-12-07_s26_h100_run1_sweeps.txt)."""
    p, bucket = PRE_NORM_FN_PARTIALS, pow2_bucket(max(1, num_tokens))
    while p > 1 and bucket < PRE_NORM_FN_RANGE_TOKENS * p:
        p //= 2
    return p


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32 (10 mantissa bits), half away from zero: TileKernels' `round_to_tf32` (+0x1000 on
    the bits) followed by the tensor core's truncation of the low 13 bits."""
    return ((t.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def _norm_fn_static(name, x, fn) -> dict:
    need(x, (2,), f"{name}: x")
    need(fn, (2,), f"{name}: fn")
    need_dtype(fn, torch.float32, f"{name}: input fn")  # (tf32_round reads its bits as float32's)
    if fn.shape[1] != x.shape[1]:
        raise TensorError(f"{name}: fn must have x's {x.shape[1]} columns, got shape {tuple(fn.shape)}")
    return {"mhc_mult3": int(fn.shape[0]), "mhc_hidden": int(x.shape[1])}


# The forward's K split (mhc_pre_norm_fn_split) at token counts whose 32-token tiles leave most SMs idle: the op
# takes it up to PRE_NORM_FN_SPLIT_TOKENS tokens. 0 (never) until the two paths are timed whole on a GPU
# (benchmarks/h200/scripts/norm_fn_split.py); the split kernel has not run on one yet.
PRE_NORM_FN_SPLIT_TOKENS = 0
PRE_NORM_FN_SPLIT_BLOCKS = 264  # two blocks for each of 132 SMs


def pre_norm_fn_splits(num_tokens: int, mhc_mult3: int, mhc_hidden: int) -> int:
    """The forward's K ranges for a token count (1: the unsplit kernel): the most of 8, 4, 2 whose blocks (32-token
    tiles of the count's power-of-two bucket, times the ranges) stay within PRE_NORM_FN_SPLIT_BLOCKS and whose
    ranges are whole 64-column steps; the split kernel's tensor-core sums take mhc_mult3 <= 32."""
    if not 0 < num_tokens <= PRE_NORM_FN_SPLIT_TOKENS or mhc_mult3 > 32:
        return 1
    tiles = -(-pow2_bucket(num_tokens) // 32)
    return next((s for s in (8, 4, 2) if mhc_hidden % (64 * s) == 0 and tiles * s <= PRE_NORM_FN_SPLIT_BLOCKS), 1)


def pre_norm_fn_split(x: torch.Tensor, fn: torch.Tensor, norm_eps: float, k_splits: int,
                      static: dict | None = None):
    """mhc_pre_norm_fn's (out, out_mul, sqrsum) through mhc_pre_norm_fn_split over k_splits K ranges (num_tokens >
    0): the ranges' partial sums added in float32, then out as the forward kernel computes it. static: the checked
    static shape, where the caller has it."""
    static = static or _norm_fn_static("mhc_pre_norm_fn", x, fn)
    m, k_len = static["mhc_mult3"], static["mhc_hidden"]
    k = kernel_of("mhc_pre_norm_fn_split", {**static, "num_tokens": int(x.shape[0]), "k_splits": k_splits}, x, None)
    sums = k(x, tf32_round(fn.contiguous())).sum(0)
    out_mul, sqrsum = sums[:, :m].contiguous(), sums[:, m].contiguous()
    return out_mul * torch.rsqrt(sqrsum / k_len + float(norm_eps)).unsqueeze(-1), out_mul, sqrsum


def mhc_pre_norm_fn_impl(x, fn, norm_eps, config=None, bwd_config=None):
    """(out, out_mul, sqrsum) float32 of x (num_tokens, K) bf16 and fn (M, K) float32 (rounded to TF32 here)."""
    static = _norm_fn_static("mhc_pre_norm_fn", x, fn)
    n, m, k_len = int(x.shape[0]), static["mhc_mult3"], static["mhc_hidden"]
    shape = {"num_tokens": max(1, n), **static, "norm_eps": float(norm_eps)}
    splits = pre_norm_fn_splits(n, m, k_len) if config is None else 1  # (a config names the forward's)
    if splits > 1:
        return pre_norm_fn_split(x, fn, norm_eps, splits, static)
    k = kernel_of("mhc_pre_norm_fn", shape, x, config)
    if n == 0:
        return x.new_empty((n, m), dtype=torch.float32), x.new_empty((n, m), dtype=torch.float32), \
            x.new_empty((n,), dtype=torch.float32)
    return k(x, tf32_round(fn.contiguous()))


mhc_pre_norm_fn = torch.library.custom_op(
    "tkjit::mhc_pre_norm_fn", mutates_args=(),
    schema="(Tensor x, Tensor fn, float norm_eps, str? config=None, str? bwd_config=None) -> (Tensor, Tensor, Tensor)",
)(mhc_pre_norm_fn_impl)


@mhc_pre_norm_fn.register_fake
def _(x, fn, norm_eps, config=None, bwd_config=None):
    static = {**_norm_fn_static("mhc_pre_norm_fn", x, fn), "norm_eps": float(norm_eps)}
    fake_check("mhc_pre_norm_fn", static, x, fn)
    n, m = x.shape[0], fn.shape[0]
    return x.new_empty((n, m), dtype=torch.float32), x.new_empty((n, m), dtype=torch.float32), \
        x.new_empty((n,), dtype=torch.float32)


def pre_norm_fn_grads(out_grad, out_mul, sqrsum, k: int, norm_eps: float):
    """TileKernels' norm backward, in torch: (mul_grad = tf32(out_grad * rms), sqrsum_grad = <out_grad, out_mul> *
    rms / (sqrsum + eps * K) / -2), rms = rsqrt(sqrsum / K + eps), float32."""
    rms = torch.rsqrt(sqrsum / k + norm_eps)
    mul_grad = tf32_round((out_grad * rms.unsqueeze(-1)).contiguous())
    sqrsum_grad = (out_grad * out_mul).sum(-1) * rms / (sqrsum + norm_eps * k) / -2
    return mul_grad, sqrsum_grad.contiguous()


def _norm_fn_bwd_static(name, out_grad, out_mul, sqrsum, x, fn) -> dict:
    """mhc_pre_norm_fn_bwd's static shape, or TensorError naming the argument: out_grad and out_mul (num_tokens, M),
    sqrsum (num_tokens,), out_mul and sqrsum float32 as the forward returns them. The norm's backward reads them
    in torch, not in the kernel: its broadcasting would take other shapes and compute the wrong gradient."""
    static = _norm_fn_static(name, x, fn)
    n, m = x.shape[0], fn.shape[0]
    for what, t, shape in (("out_grad", out_grad, (n, m)), ("out_mul", out_mul, (n, m)), ("sqrsum", sqrsum, (n,))):
        need(t, (len(shape),), f"{name}: {what}")
        if what != "out_grad":  # (out_grad is taken as float32 whatever it is)
            need_dtype(t, torch.float32, f"{name}: {what}")
        for got, want in zip(t.shape, shape):
            check(got == want, lambda what=what, t=t, shape=shape:
                   f"{name}: {what} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return static


def mhc_pre_norm_fn_bwd_impl(out_grad, out_mul, sqrsum, x, fn, norm_eps, config=None, x_grad=None):
    """(x_grad bf16, fn_grad float32) of mhc_pre_norm_fn given out's gradient (num_tokens, M) float32; x_grad,
    when given (bf16, x's shape, contiguous), is added into in place (TileKernels' fuse_grad_acc)."""
    static = _norm_fn_bwd_static("mhc_pre_norm_fn_bwd", out_grad, out_mul, sqrsum, x, fn)
    n = int(x.shape[0])
    if x_grad is None:
        x_grad = torch.zeros_like(x)
    if n == 0:
        return x_grad, torch.zeros_like(fn)
    shape = {"num_tokens": n, **static, "num_partials": pre_norm_fn_partials(n)}
    k = kernel_of("mhc_pre_norm_fn_bwd", shape, x, config)
    mul_grad, sqrsum_grad = pre_norm_fn_grads(out_grad.float(), out_mul, sqrsum, static["mhc_hidden"], float(norm_eps))
    x_grad, partial = k(mul_grad, sqrsum_grad, x, tf32_round(fn.contiguous()), x_grad)
    return x_grad, partial.sum(0)


def _pre_norm_fn_bwd_op(out_grad, out_mul, sqrsum, x, fn, norm_eps, config=None):
    return mhc_pre_norm_fn_bwd_impl(out_grad, out_mul, sqrsum, x, fn, norm_eps, config)


mhc_pre_norm_fn_bwd = torch.library.custom_op(
    "tkjit::mhc_pre_norm_fn_bwd", mutates_args=(),
    schema="(Tensor out_grad, Tensor out_mul, Tensor sqrsum, Tensor x, Tensor fn, float norm_eps, str? config=None) "
           "-> (Tensor, Tensor)",
)(_pre_norm_fn_bwd_op)


@mhc_pre_norm_fn_bwd.register_fake
def _(out_grad, out_mul, sqrsum, x, fn, norm_eps, config=None):
    name = "mhc_pre_norm_fn_bwd"
    # (any valid range count: the outputs' shapes do not depend on it, and a symbolic token count has none)
    static = {**_norm_fn_bwd_static(name, out_grad, out_mul, sqrsum, x, fn), "num_partials": PRE_NORM_FN_PARTIALS}
    fake_check(name, static, out_mul, sqrsum, x, fn)  # (out_mul and sqrsum as the kernel's mul_grad, sqrsum_grad)
    return torch.empty_like(x), torch.empty_like(fn)


def _pre_norm_fn_setup_context(ctx, inputs, output):
    x, fn, norm_eps, _, bwd_config = inputs
    _, out_mul, sqrsum = output
    ctx.mark_non_differentiable(out_mul, sqrsum)
    ctx.save_for_backward(x, fn, out_mul, sqrsum)
    ctx.args = (float(norm_eps), bwd_config)


def _pre_norm_fn_backward(ctx, out_grad, *_):
    x, fn, out_mul, sqrsum = ctx.saved_tensors
    norm_eps, bwd_config = ctx.args
    if out_grad is None:
        out_grad = out_mul.new_zeros(out_mul.shape)
    x_grad, fn_grad = torch.ops.tkjit.mhc_pre_norm_fn_bwd.default(out_grad.float().contiguous(), out_mul, sqrsum, x,
                                                                 fn, norm_eps, bwd_config)
    return x_grad, fn_grad, None, None, None


mhc_pre_norm_fn.register_autograd(_pre_norm_fn_backward, setup_context=_pre_norm_fn_setup_context)
mhc_pre_norm_fn_bwd.register_autograd(_no_double_backward_of("mhc_pre_norm_fn"),
                                      setup_context=lambda ctx, inputs, output: None)


# -- mhc_multilayer_recompute ------------------------------------------------------------------------
# torch.ops.tkjit.mhc_multilayer_recompute(initial_residual, pre_mix, layer_output, post_mix, comb_mix,
#                                          config=None) -> (layer_input, residual)
# the per-layer tensors stacked on a leading layer axis, the tokens flattened: initial_residual (num_tokens,
# mhc_mult, hidden) and layer_output (num_post, num_tokens, hidden) bfloat16, pre_mix (num_layers, num_tokens,
# mhc_mult), post_mix (num_post, num_tokens, mhc_mult), comb_mix (num_post, num_tokens, mhc_mult, mhc_mult)
# float32 -> layer_input (num_layers, num_tokens, hidden), residual (num_post, num_tokens, mhc_mult, hidden)
# bfloat16. num_post is num_layers or num_layers - 1; with none (one layer) the op is pre_apply_mix.

def _recompute_static(name, initial_residual, pre_mix, layer_output, post_mix, comb_mix) -> dict:
    for what, t, ndim in (("initial_residual", initial_residual, 3), ("pre_mix", pre_mix, 3),
                          ("layer_output", layer_output, 3), ("post_mix", post_mix, 3), ("comb_mix", comb_mix, 4)):
        need(t, (ndim,), f"{name}: {what}")
    num_layers, num_post = int(pre_mix.shape[0]), int(layer_output.shape[0])
    if num_layers < 1 or num_post not in (num_layers, num_layers - 1):
        raise ShapeError(f"{name}: num_post (layer_output.shape[0] = {num_post}) must be num_layers or num_layers - 1 "
                         f"(pre_mix.shape[0] = {num_layers}, at least 1)")
    for what, t in (("post_mix", post_mix), ("comb_mix", comb_mix)):
        if int(t.shape[0]) != num_post:
            raise ShapeError(f"{name}: {what} has {int(t.shape[0])} layers, layer_output {num_post}")
    return {"mhc_mult": int(initial_residual.shape[1]), "hidden": int(initial_residual.shape[2]),
            "num_layers": num_layers, "num_post": num_post}


def mhc_multilayer_recompute_impl(initial_residual, pre_mix, layer_output, post_mix, comb_mix, config=None, out=None):
    """(layer_input, residual) of num_layers mHC blocks recomputed in one kernel, bit-identical to
    pre_apply_mix then mhc_post_fwd per layer. out: (layer_input, residual) written in place (eager callers)."""
    static = _recompute_static("mhc_multilayer_recompute", initial_residual, pre_mix, layer_output, post_mix, comb_mix)
    n, m, h = (int(s) for s in initial_residual.shape)
    if static["num_post"] == 0:  # one layer, no post: its input is pre_apply_mix's
        li = out[0] if out is not None else initial_residual.new_empty((1, n, h))
        pre_apply_mix_impl(initial_residual, pre_mix[0], out=li[0])
        return li, out[1] if out is not None else initial_residual.new_empty((0, n, m, h))
    kern = kernel_of("mhc_multilayer_recompute", {"num_tokens": max(1, n), **static}, initial_residual, config)
    tensors = (initial_residual, pre_mix, layer_output, post_mix, comb_mix)
    return kern(*tensors, out=out) if out is not None else kern(*tensors)


mhc_multilayer_recompute = torch.library.custom_op(
    "tkjit::mhc_multilayer_recompute", mutates_args=(),
    schema="(Tensor initial_residual, Tensor pre_mix, Tensor layer_output, Tensor post_mix, Tensor comb_mix, "
           "str? config=None) -> (Tensor, Tensor)",
)(mhc_multilayer_recompute_impl)


@mhc_multilayer_recompute.register_fake
def _(initial_residual, pre_mix, layer_output, post_mix, comb_mix, config=None):
    name = "mhc_multilayer_recompute"
    static = _recompute_static(name, initial_residual, pre_mix, layer_output, post_mix, comb_mix)
    if static["num_post"]:
        fake_check(name, static, initial_residual, pre_mix, layer_output, post_mix, comb_mix)
    else:
        fake_check("pre_apply_mix", {"mhc_mult": static["mhc_mult"], "hidden": static["hidden"]}, initial_residual,
                    pre_mix[0])
    n, m, h = initial_residual.shape
    return (initial_residual.new_empty((static["num_layers"], n, h)),
            initial_residual.new_empty((static["num_post"], n, m, h)))


# -- mhc_pre_big_fuse --------------------------------------------------------------------------------
# torch.ops.tkjit.mhc_pre_big_fuse(residual, fn, mhc_scale, mhc_base, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps,
#                                  mhc_post_mult_value, sinkhorn_repeat, config=None, gemm_config=None)
#     -> (post_mix, comb_mix, layer_input)
# on the flattened tokens: residual (num_tokens, m, hidden) bf16, fn (M, m * hidden) float32 (M = 2m + m*m),
# mhc_scale (3,), mhc_base (M,) float32 -> post_mix (num_tokens, m), comb_mix (num_tokens, m, m) float32,
# layer_input (num_tokens, hidden) bf16. Two kernels, as TileKernels runs it: mhc_pre_norm_fn's GEMM (fn rounded
# to TF32; its out_mul and sqrsum; config gemm_config), then mhc_pre_big_fuse. Inference only, as TileKernels'
# (no backward): its outputs do not require grad.

def _big_fuse_static(name, residual, fn, mhc_scale, mhc_base) -> dict:
    need(residual, (3,), f"{name}: residual")
    need_contiguous(residual, f"{name}: residual")  # (the GEMM reads it as a (num_tokens, mhc_mult * hidden) view)
    need(fn, (2,), f"{name}: fn")
    need_dtype(fn, torch.float32, f"{name}: input fn")  # (tf32_round reads its bits as float32's)
    m, h = int(residual.shape[1]), int(residual.shape[2])
    w = 2 * m + m * m
    if tuple(fn.shape) != (w, m * h):
        raise TensorError(f"{name}: fn must have shape (mhc_mult * (mhc_mult + 2), mhc_mult * hidden) = {(w, m * h)} "
                          f"for residual {tuple(residual.shape)}, got {tuple(fn.shape)}")
    for what, t, shape in (("mhc_scale", mhc_scale, (3,)), ("mhc_base", mhc_base, (w,))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise TensorError(f"{name}: {what} must have shape {shape}, got {tuple(getattr(t, 'shape', ()))}")
    return {"mhc_mult": m, "hidden": h}


def _big_fuse_shape(static, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value, sinkhorn_repeat) -> dict:
    return {**static, "rms_eps": float(rms_eps), "mhc_pre_eps": float(mhc_pre_eps),
            "mhc_sinkhorn_eps": float(mhc_sinkhorn_eps), "mhc_post_mult_value": float(mhc_post_mult_value),
            "sinkhorn_repeat": int(sinkhorn_repeat)}


def _big_fuse_empty(residual, m, h):
    return (residual.new_empty((residual.shape[0], m), dtype=torch.float32),
            residual.new_empty((residual.shape[0], m, m), dtype=torch.float32),
            residual.new_empty((residual.shape[0], h), dtype=torch.bfloat16))


def mhc_pre_big_fuse_impl(residual, fn, mhc_scale, mhc_base, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps,
                          mhc_post_mult_value, sinkhorn_repeat, config=None, gemm_config=None):
    """(post_mix, comb_mix, layer_input) of residual (num_tokens, m, hidden) bf16: the GEMM (mhc_pre_norm_fn's
    kernel, fn rounded to TF32), then the fused norm, split mixes, Sinkhorn and pre mix (mhc_pre_big_fuse)."""
    name = "mhc_pre_big_fuse"
    static = _big_fuse_static(name, residual, fn, mhc_scale, mhc_base)
    m, h = static["mhc_mult"], static["hidden"]
    n = int(residual.shape[0])
    shape = {"num_tokens": max(1, n), **_big_fuse_shape(static, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps,
                                                        mhc_post_mult_value, sinkhorn_repeat)}
    gemm_shape = {"num_tokens": max(1, n), "mhc_mult3": 2 * m + m * m, "mhc_hidden": m * h,
                  "norm_eps": float(rms_eps)}
    gemm = kernel_of("mhc_pre_norm_fn", gemm_shape, residual, gemm_config)
    fuse = kernel_of(name, shape, residual, config)
    if n == 0:
        return _big_fuse_empty(residual, m, h)
    _, out_mul, sqrsum = gemm(residual.view(n, m * h), tf32_round(fn.contiguous()))
    return fuse(out_mul, sqrsum, mhc_scale, mhc_base, residual)


mhc_pre_big_fuse = torch.library.custom_op(
    "tkjit::mhc_pre_big_fuse", mutates_args=(),
    schema="(Tensor residual, Tensor fn, Tensor mhc_scale, Tensor mhc_base, float rms_eps, float mhc_pre_eps, "
           "float mhc_sinkhorn_eps, float mhc_post_mult_value, int sinkhorn_repeat, str? config=None, "
           "str? gemm_config=None) -> (Tensor, Tensor, Tensor)",
)(mhc_pre_big_fuse_impl)


@mhc_pre_big_fuse.register_fake
def _(residual, fn, mhc_scale, mhc_base, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value,
      sinkhorn_repeat, config=None, gemm_config=None):
    name = "mhc_pre_big_fuse"
    static = _big_fuse_static(name, residual, fn, mhc_scale, mhc_base)
    m, h = static["mhc_mult"], static["hidden"]
    fake_check("mhc_pre_norm_fn", {"mhc_mult3": 2 * m + m * m, "mhc_hidden": m * h, "norm_eps": float(rms_eps)},
                residual.view(residual.shape[0], m * h), fn)
    # (the GEMM's out_mul and sqrsum, the fused kernel's first inputs, stand in as empties of their shapes)
    fake_check(name, _big_fuse_shape(static, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value,
                                      sinkhorn_repeat), fn.new_empty((residual.shape[0], 2 * m + m * m)),
                fn.new_empty((residual.shape[0],)), mhc_scale, mhc_base, residual)
    return _big_fuse_empty(residual, m, h)


def _big_fuse_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


def _big_fuse_backward(ctx, *grads):
    raise NotImplementedError("mhc_pre_big_fuse is inference-only (TileKernels' big_fuse has no backward): "
                              "use mhc_pre_norm_fn, mhc_pre_split_mixes, sinkhorn and mhc_pre_apply_mix for gradients")


mhc_pre_big_fuse.register_autograd(_big_fuse_backward, setup_context=_big_fuse_setup_context)
