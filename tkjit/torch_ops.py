"""The kernels as torch custom ops, `torch.ops.tkjit.*`, registered when `tkjit.ops` is imported.

    torch.ops.tkjit.sinkhorn_fwd(x, repeat=10, eps=1e-6, config=None, bwd_config=None)  # differentiable
    torch.ops.tkjit.sinkhorn_bwd(grad_out, x, repeat=10, eps=1e-6, config=None)
    torch.ops.tkjit.topk_gate(scores, k, config=None)
    torch.ops.tkjit.per_token_cast(x, group=128, round_scale=False, config=None)           # (q, scales)
    torch.ops.tkjit.per_token_cast_colmajor(x, group=128, round_scale=False, config=None)  # (q, padded storage)
    torch.ops.tkjit.transpose(x, config=None)                                               # 2-D or 3-D

Each op's real implementation is `tkjit.get(...)(...)`: the shape is read off the tensors, the kernel
comes from the memo, the disk cache or a compile. Its fake implementation computes the outputs'
shapes, dtypes and strides from the inputs, so torch.compile traces the ops without a graph break
(and FakeTensor inputs never reach a launcher). `config` is a kernel config as the text of a dict,
e.g. "{'layout': 'thread', ...}" (`encode_config` writes it); None takes the tuned or default one.

Each op's implementation is also a plain function (`<op>_impl`): `tkjit.ops` calls it directly
in eager code that needs neither tracing nor autograd, which skips the dispatcher's ~20 us of
host time per call.

Custom ops may not return views, so the column-major scales come back as their padded storage
(num_groups, align(num_tokens, 4)); `tkjit.ops.per_token_cast(..., col_major_scales=True)` returns
the (num_tokens, num_groups) view of it.
"""

import ast
import functools
from collections.abc import Mapping

import torch

from tkjit.api import get
from tkjit.arch import arch_of
from tkjit.envs import CHECK_INDICES, flag
from tkjit.errors import ConfigError, TensorError
from tkjit.kernel import dtype_name, torch_dtype

TMA_ALIGN = 4  # per_token_cast_colmajor pads the token axis of its scales to a multiple of this


def encode_config(config: Mapping | str | None) -> str | None:
    """A config as the ops take it: the text of a dict (torch.compile traces this without a break)."""
    if config is None or isinstance(config, str):
        return config
    return repr(dict(config))


@functools.lru_cache(maxsize=256)
def _config(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = ast.literal_eval(text)
        return dict(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ConfigError(f"config {text!r} is not the text of a dict (e.g. \"{{'threads': 128}}\")") from None


def _need(x, ndim, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() not in ndim:
        want = " or ".join(f"{n}-D" for n in ndim)
        raise TensorError(f"{what}: expected a {want} tensor, got {getattr(x, 'shape', type(x).__name__)}")


def check_indices(op: str, name: str, t: torch.Tensor, hi: int, lo: int = -1) -> None:
    """With TKJIT_CHECK_INDICES=1: TensorError unless every entry of the index tensor t is in [lo, hi).

    Off by default (it costs a device sync); the kernels never access memory out of bounds either way.
    """
    if not _check_indices_on() or t.numel() == 0 or t.is_meta:
        return
    bad = ((t < lo) | (t >= hi)).nonzero()
    if bad.numel():
        where = tuple(int(i) for i in bad[0])
        raise TensorError(
            f"{op}: {name}{list(where)} = {int(t[where])} is out of range [{lo}, {hi})"
        )


def _check_indices_on() -> bool:
    return flag(CHECK_INDICES)


def _fake_check(name: str, shape: dict, *tensors: torch.Tensor) -> None:
    """What the real call would refuse before launching, at trace time: bad shape params, dtypes, sizes.

    shape holds the static params (plain ints, read off the tensors with int(): compiled in, so a
    traced graph specialises on them); the runtime sizes may be symbolic and are checked as 1.
    """
    from tkjit.registry import get_spec

    spec = get_spec(name)
    full = spec.canonical_shape({**shape, **{p.name: 1 for p in spec.runtime_params}})
    runtime = {p.name for p in spec.runtime_params}
    for t, arg in zip(tensors, spec.inputs):
        dtype, dims = arg.resolve(full)
        if t.dtype != torch_dtype(dtype):
            raise TensorError(f"{name}: input {arg.name} has dtype {t.dtype}, expected {torch_dtype(dtype)}")
        for axis, (d, size) in enumerate(zip(arg.dims, dims)):
            if not (isinstance(d, str) and d in runtime) and t.shape[axis] != size:
                raise TensorError(
                    f"{name}: input {arg.name} has shape {tuple(t.shape)}, axis {axis} must be {size}"
                )


# -- sinkhorn ----------------------------------------------------------------------------------------

def sinkhorn_fwd_impl(x, repeat=10, eps=1e-6, config=None, bwd_config=None):
    """(num_tokens, n, n) float32 -> Sinkhorn-normalised; its gradient runs sinkhorn_bwd (config bwd_config)."""
    _need(x, (3,), "sinkhorn_fwd")
    shape = {"num_tokens": max(1, x.shape[0]), "n": x.shape[1], "repeat": repeat, "eps": eps}
    return get("sinkhorn_fwd", shape, arch=arch_of(x), config=_config(config))(x)


sinkhorn_fwd = torch.library.custom_op(
    "tkjit::sinkhorn_fwd",
    mutates_args=(),
    schema="(Tensor x, int repeat=10, float eps=1e-06, str? config=None, str? bwd_config=None) -> Tensor",
)(sinkhorn_fwd_impl)


@sinkhorn_fwd.register_fake
def _(x, repeat=10, eps=1e-6, config=None, bwd_config=None):
    _need(x, (3,), "sinkhorn_fwd")
    _fake_check("sinkhorn_fwd", {"n": int(x.shape[1]), "repeat": repeat, "eps": eps}, x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def sinkhorn_bwd_impl(grad_out, x, repeat=10, eps=1e-6, config=None):
    """dL/dx of sinkhorn_fwd(x) given dL/dy = grad_out, both (num_tokens, n, n) float32."""
    _need(x, (3,), "sinkhorn_bwd")
    shape = {"num_tokens": max(1, x.shape[0]), "n": x.shape[1], "repeat": repeat, "eps": eps}
    return get("sinkhorn_bwd", shape, arch=arch_of(x), config=_config(config))(grad_out, x)


sinkhorn_bwd = torch.library.custom_op(
    "tkjit::sinkhorn_bwd",
    mutates_args=(),
    schema="(Tensor grad_out, Tensor x, int repeat=10, float eps=1e-06, str? config=None) -> Tensor",
)(sinkhorn_bwd_impl)


@sinkhorn_bwd.register_fake
def _(grad_out, x, repeat=10, eps=1e-6, config=None):
    _need(x, (3,), "sinkhorn_bwd")
    _need(grad_out, (3,), "sinkhorn_bwd")
    _fake_check("sinkhorn_bwd", {"n": int(x.shape[1]), "repeat": repeat, "eps": eps}, grad_out, x)
    torch._check(grad_out.shape[0] == x.shape[0], lambda: "sinkhorn_bwd: grad_out and x differ in num_tokens")
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


# -- topk_gate -------------------------------------------------------------------------------------

def topk_gate_impl(scores, k, config=None):
    """(num_tokens, num_experts) float32 -> int64 (num_tokens, k) expert indices, best first."""
    _need(scores, (2,), "topk_gate")
    shape = {"num_tokens": max(1, scores.shape[0]), "num_experts": scores.shape[1], "k": k}
    return get("topk_gate", shape, arch=arch_of(scores), config=_config(config))(scores)


topk_gate = torch.library.custom_op(
    "tkjit::topk_gate", mutates_args=(), schema="(Tensor scores, int k, str? config=None) -> Tensor"
)(topk_gate_impl)


@topk_gate.register_fake
def _(scores, k, config=None):
    _need(scores, (2,), "topk_gate")
    _fake_check("topk_gate", {"num_experts": int(scores.shape[1]), "k": k}, scores)
    return scores.new_empty((scores.shape[0], k), dtype=torch.int64)


# -- per_token_cast --------------------------------------------------------------------------------

_CAST_SCHEMA = "(Tensor x, int group=128, bool round_scale=False, str? config=None) -> (Tensor, Tensor)"


def _cast(name, x, group, round_scale, config):
    _need(x, (2,), name)
    shape = {"num_tokens": max(1, x.shape[0]), "hidden": x.shape[1], "group": group,
             "in_dtype": dtype_name(x.dtype), "round_scale": round_scale}
    return get(name, shape, arch=arch_of(x), config=_config(config))(x)


def _fake_cast(name, x, group, round_scale):
    _need(x, (2,), name)
    hidden = int(x.shape[1])
    _fake_check(name, {"hidden": hidden, "group": group, "in_dtype": dtype_name(x.dtype),
                       "round_scale": round_scale}, x)
    # ceil(hidden / group) scales per token: the last group is partial when group does not divide hidden
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), -(-hidden // group)


def per_token_cast_impl(x, group=128, round_scale=False, config=None):
    """(num_tokens, hidden) bf16/f32 -> (fp8 e4m3 values, float32 scales (num_tokens, ceil(hidden / group)))."""
    return _cast("per_token_cast", x, group, round_scale, config)


per_token_cast = torch.library.custom_op(
    "tkjit::per_token_cast", mutates_args=(), schema=_CAST_SCHEMA
)(per_token_cast_impl)


@per_token_cast.register_fake
def _(x, group=128, round_scale=False, config=None):
    q, groups = _fake_cast("per_token_cast", x, group, round_scale)
    return q, x.new_empty((x.shape[0], groups), dtype=torch.float32)


def per_token_cast_colmajor_impl(x, group=128, round_scale=False, config=None):
    """per_token_cast with the scales' TMA-aligned column-major storage (ceil(hidden / group),
    align(num_tokens, 4))."""
    return _cast("per_token_cast_colmajor", x, group, round_scale, config)


per_token_cast_colmajor = torch.library.custom_op(
    "tkjit::per_token_cast_colmajor", mutates_args=(), schema=_CAST_SCHEMA
)(per_token_cast_colmajor_impl)


@per_token_cast_colmajor.register_fake
def _(x, group=128, round_scale=False, config=None):
    q, groups = _fake_cast("per_token_cast_colmajor", x, group, round_scale)
    return q, x.new_empty((groups, (x.shape[0] + TMA_ALIGN - 1) // TMA_ALIGN * TMA_ALIGN), dtype=torch.float32)


# -- transpose -------------------------------------------------------------------------------------

def transpose_impl(x, config=None):
    """(rows, cols) -> (cols, rows), or (batch, rows, cols) -> (batch, cols, rows), bit-exact."""
    _need(x, (2, 3), "transpose")
    shape = {"rows": max(1, x.shape[-2]), "cols": x.shape[-1], "dtype": dtype_name(x.dtype)}
    if x.dim() == 3:
        shape["batch"] = max(1, x.shape[0])
        return get("batched_transpose", shape, arch=arch_of(x), config=_config(config))(x)
    return get("transpose", shape, arch=arch_of(x), config=_config(config))(x)


transpose = torch.library.custom_op(
    "tkjit::transpose", mutates_args=(), schema="(Tensor x, str? config=None) -> Tensor"
)(transpose_impl)


@transpose.register_fake
def _(x, config=None):
    _need(x, (2, 3), "transpose")
    name = "batched_transpose" if x.dim() == 3 else "transpose"
    _fake_check(name, {"cols": int(x.shape[-1]), "dtype": dtype_name(x.dtype)}, x)
    return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2]))
