"""torch.ops.tkjit ops of the Engram family: engram_hash, fused_weight, engram_gate_fwd / _bwd and
grad_w_reduce (with the gate's registered autograd)."""

import torch

from tkjit.torch_ops.checks import check_indices, fake_check, need
from tkjit.torch_ops.serve import kernel_of

# -- engram_hash / fused_weight ----------------------------------------------------------------------

_ENGRAM_HASH_INPUTS = (("ngram_token_ids", 2), ("multipliers", 2), ("vocab_sizes", 3), ("offsets", 2))


def _engram_hash_static(ngram_token_ids, multipliers, vocab_sizes, offsets) -> dict:
    """The static shape (N, L, E) read off ngram_token_ids and vocab_sizes; the other tensors are checked
    against it by the kernel (or fake_check)."""
    for (name, ndim), t in zip(_ENGRAM_HASH_INPUTS, (ngram_token_ids, multipliers, vocab_sizes, offsets)):
        need(t, (ndim,), f"engram_hash: {name}")
    return {"max_ngram_size": int(ngram_token_ids.shape[1]), "num_ngram_layers": int(vocab_sizes.shape[0]),
            "num_embed_table_per_ngram": int(vocab_sizes.shape[2])}


def engram_hash_impl(ngram_token_ids, multipliers, vocab_sizes, offsets, config=None):
    """ngram_token_ids (num_tokens, N) int32, multipliers (L, N) int64, vocab_sizes (L, N - 1, E) int32,
    offsets (L, (N - 1) * E) int32 -> int32 (L, num_tokens, (N - 1) * E) embedding indices. Table sizes
    < 1 are refused with TKJIT_CHECK_INDICES=1 (one device sync)."""
    static = _engram_hash_static(ngram_token_ids, multipliers, vocab_sizes, offsets)
    check_indices("engram_hash", "vocab_sizes", vocab_sizes, 1 << 31, lo=1)
    shape = {"num_tokens": max(1, ngram_token_ids.shape[0]), **static}
    kern = kernel_of("engram_hash", shape, ngram_token_ids, config)
    return kern(ngram_token_ids, multipliers, vocab_sizes, offsets)


engram_hash = torch.library.custom_op(
    "tkjit::engram_hash", mutates_args=(),
    schema="(Tensor ngram_token_ids, Tensor multipliers, Tensor vocab_sizes, Tensor offsets, str? config=None) "
           "-> Tensor",
)(engram_hash_impl)


@engram_hash.register_fake
def _(ngram_token_ids, multipliers, vocab_sizes, offsets, config=None):
    static = _engram_hash_static(ngram_token_ids, multipliers, vocab_sizes, offsets)
    fake_check("engram_hash", static, ngram_token_ids, multipliers, vocab_sizes, offsets)
    cols = (static["max_ngram_size"] - 1) * static["num_embed_table_per_ngram"]
    return ngram_token_ids.new_empty((static["num_ngram_layers"], ngram_token_ids.shape[0], cols), dtype=torch.int32)


def _fused_weight_static(weight_hidden, weight_embed) -> dict:
    need(weight_hidden, (2,), "fused_weight: weight_hidden")
    need(weight_embed, (2,), "fused_weight: weight_embed")
    return {"hc_mult": int(weight_hidden.shape[0]), "hidden_size": int(weight_hidden.shape[1])}


def fused_weight_impl(weight_hidden, weight_embed, config=None):
    """weight_hidden, weight_embed (hc_mult, hidden_size) bfloat16 -> their float32 product, same shape."""
    shape = _fused_weight_static(weight_hidden, weight_embed)
    return kernel_of("fused_weight", shape, weight_hidden, config)(weight_hidden, weight_embed)


fused_weight = torch.library.custom_op(
    "tkjit::fused_weight", mutates_args=(),
    schema="(Tensor weight_hidden, Tensor weight_embed, str? config=None) -> Tensor",
)(fused_weight_impl)


@fused_weight.register_fake
def _(weight_hidden, weight_embed, config=None):
    fake_check("fused_weight", _fused_weight_static(weight_hidden, weight_embed), weight_hidden, weight_embed)
    return weight_hidden.new_empty(tuple(weight_hidden.shape), dtype=torch.float32)


# -- engram_gate ---------------------------------------------------------------------------------------
# torch.ops.tkjit.engram_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value, config=None)
#     -> (out, dot, gate_score, rstd_x, rstd_k)
# on the flattened tokens: hidden_states, k and out (num_tokens, hc_mult, hidden_size), v (num_tokens,
# hidden_size) bfloat16 (k and v may be row-strided views), weight_fused (hc_mult, hidden_size) and the
# saved values (num_tokens, hc_mult) float32.

def _engram_gate_static(name, hidden_states, eps, clamp_value) -> dict:
    need(hidden_states, (3,), f"{name}: hidden_states")
    return {"hc_mult": int(hidden_states.shape[1]), "hidden_size": int(hidden_states.shape[2]),
            "eps": float(eps), "clamp_value": float(clamp_value)}


def engram_gate_fwd_impl(hidden_states, k, v, weight_fused, eps, clamp_value, config=None):
    """TileKernels' engram_gate_fwd: out = x + gate * v (bf16) and dot, gate_score, rstd_x, rstd_k."""
    static = _engram_gate_static("engram_gate_fwd", hidden_states, eps, clamp_value)
    kern = kernel_of("engram_gate_fwd", {"num_tokens": max(1, hidden_states.shape[0]), **static}, hidden_states, config)
    return kern(hidden_states, k, v, weight_fused)


engram_gate_fwd = torch.library.custom_op(
    "tkjit::engram_gate_fwd", mutates_args=(),
    schema="(Tensor hidden_states, Tensor k, Tensor v, Tensor weight_fused, float eps, float clamp_value, "
           "str? config=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)(engram_gate_fwd_impl)


def _fake_engram_gate(name, hidden_states, k, v, weight_fused, eps, clamp_value, *extra):
    static = _engram_gate_static(name, hidden_states, eps, clamp_value)
    fake_check(name, static, *extra, hidden_states, k, v, weight_fused)


@engram_gate_fwd.register_fake
def _(hidden_states, k, v, weight_fused, eps, clamp_value, config=None):
    _fake_engram_gate("engram_gate_fwd", hidden_states, k, v, weight_fused, eps, clamp_value)
    t, m = hidden_states.shape[:2]
    saved = [weight_fused.new_empty((t, m)) for _ in range(4)]
    return (hidden_states.new_empty(hidden_states.shape), *saved)


# -- engram_gate_bwd / grad_w_reduce -------------------------------------------------------------------
# torch.ops.tkjit.engram_gate_bwd(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k,
#                                 clamp_value, num_partials=132, config=None)
#     -> (grad_x, grad_k, grad_v, grad_w_partial)
# torch.ops.tkjit.grad_w_reduce(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden,
#                               grad_weight_embed, config=None) -> ()     # adds into the last two in place
# grad_x, grad_k (num_tokens, hc_mult, hidden_size) and grad_v (num_tokens, hidden_size) bf16, grad_w_partial
# (num_partials, hc_mult, hidden_size) float32: weight_fused's gradient summed over each persistent block's
# tokens (TileKernels' num_sms rows). engram_gate_fwd is differentiable (registered here) in hidden_states,
# k, v and weight_fused; its saved outputs (dot, gate_score, rstd_x, rstd_k) are not differentiable, and
# weight_fused's gradient is the partials summed in float32.

ENGRAM_PARTIALS = 132  # H200's SM count: the backward's default persistent blocks


def _engram_bwd_static(name, hidden_states, clamp_value, num_partials) -> dict:
    need(hidden_states, (3,), f"{name}: hidden_states")
    return {"hc_mult": int(hidden_states.shape[1]), "hidden_size": int(hidden_states.shape[2]),
            "clamp_value": float(clamp_value), "num_partials": int(num_partials)}


def engram_gate_bwd_impl(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value,
                         num_partials=ENGRAM_PARTIALS, config=None):
    """TileKernels' engram_gate_bwd: (grad_x, grad_k, grad_v) bf16 and grad_w_partial (num_partials, hc_mult,
    hidden_size) float32, from grad_out = dL/d out and the forward's inputs and saved values."""
    static = _engram_bwd_static("engram_gate_bwd", hidden_states, clamp_value, num_partials)
    kern = kernel_of("engram_gate_bwd", {"num_tokens": max(1, hidden_states.shape[0]), **static}, hidden_states, config)
    return kern(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k)


engram_gate_bwd = torch.library.custom_op(
    "tkjit::engram_gate_bwd", mutates_args=(),
    schema="(Tensor grad_out, Tensor hidden_states, Tensor k, Tensor v, Tensor weight_fused, Tensor dot, "
           "Tensor gate_score, Tensor rstd_x, Tensor rstd_k, float clamp_value, int num_partials=132, "
           "str? config=None) -> (Tensor, Tensor, Tensor, Tensor)",
)(engram_gate_bwd_impl)


@engram_gate_bwd.register_fake
def _(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value,
      num_partials=ENGRAM_PARTIALS, config=None):
    name = "engram_gate_bwd"
    static = _engram_bwd_static(name, hidden_states, clamp_value, num_partials)
    fake_check(name, static, grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k)
    t, m, h = hidden_states.shape
    return (hidden_states.new_empty((t, m, h)), hidden_states.new_empty((t, m, h)), hidden_states.new_empty((t, h)),
            weight_fused.new_empty((static["num_partials"], m, h)))


def _grad_w_static(name, grad_w_partial) -> dict:
    need(grad_w_partial, (3,), f"{name}: grad_w_partial")
    p, m, h = (int(n) for n in grad_w_partial.shape)
    return {"hc_mult": m, "hidden_size": h, "num_partials": p}


def grad_w_reduce_impl(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed,
                       config=None):
    """TileKernels' grad_w_reduce: g = the partials summed over axis 0 (float32, in order), then in place
    grad_weight_hidden += g * weight_embed and grad_weight_embed += g * weight_hidden."""
    static = _grad_w_static("grad_w_reduce", grad_w_partial)
    kern = kernel_of("grad_w_reduce", static, grad_w_partial, config)
    kern(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)


grad_w_reduce = torch.library.custom_op(
    "tkjit::grad_w_reduce", mutates_args=("grad_weight_hidden", "grad_weight_embed"),
    schema="(Tensor grad_w_partial, Tensor weight_hidden, Tensor weight_embed, Tensor(a!) grad_weight_hidden, "
           "Tensor(b!) grad_weight_embed, str? config=None) -> ()",
)(grad_w_reduce_impl)


@grad_w_reduce.register_fake
def _(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed, config=None):
    name = "grad_w_reduce"
    static = _grad_w_static(name, grad_w_partial)
    fake_check(name, static, grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)


ENGRAM_GATE_DIFFERENTIABLE_ONCE = (
    "tkjit: engram_gate is differentiable once: engram_gate_bwd has no gradient (double backward, e.g. "
    "create_graph=True followed by a backward through the gradients, is not supported)"
)


def _engram_gate_setup_context(ctx, inputs, output):
    hidden_states, k, v, weight_fused, _, clamp_value, _ = inputs
    _, dot, gate_score, rstd_x, rstd_k = output
    ctx.mark_non_differentiable(dot, gate_score, rstd_x, rstd_k)
    ctx.save_for_backward(hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k)
    ctx.clamp_value = float(clamp_value)


def _engram_gate_backward(ctx, grad_out, *_):
    saved = ctx.saved_tensors
    grad_out = grad_out.to(torch.bfloat16).contiguous()
    grad_x, grad_k, grad_v, partial = torch.ops.tkjit.engram_gate_bwd.default(grad_out, *saved, ctx.clamp_value)
    return grad_x, grad_k, grad_v, partial.sum(0), None, None, None


def _engram_gate_no_double_backward(ctx, *grads):
    raise RuntimeError(ENGRAM_GATE_DIFFERENTIABLE_ONCE)


engram_gate_fwd.register_autograd(_engram_gate_backward, setup_context=_engram_gate_setup_context)
engram_gate_bwd.register_autograd(_engram_gate_no_double_backward, setup_context=lambda ctx, inputs, output: None)
