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
dispatcher, a call that needs no gradient skips custom_op's Python layers (`_lean_dispatch`).

Custom ops may not return views, so the column-major scales come back as their padded storage
(num_groups, align(num_tokens, 4)); `tkjit.ops.per_token_cast(..., col_major_scales=True)` returns
the (num_tokens, num_groups) view of it.
"""

import ast
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tkjit.api import call_memo, get
from tkjit.arch import arch_of
from tkjit.envs import CHECK_INDICES, flag
from tkjit.errors import ConfigError, ShapeError, TensorError, TkjitError
from tkjit.kernel import dtype_name, torch_dtype
from tkjit.scales import tma_aligned
from tkjit.spec import Align, CeilDiv, pow2_bucket


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


_served = call_memo(256)  # (op, x's shape, dtype and device, the scalars and their types, config) -> kernel object


def _kernel_for(name: str, x, scalars: tuple, config: str | None, shape_of: Callable[[], dict]):
    """The kernel object `get` serves a call of op `name` on x (the tensor that sizes it) with these scalars,
    remembered per call signature: a repeat call skips building the shape and get's lookup (about 1.5 us of
    the 2.3 an op added over its kernel object on the CPU host). shape_of() checks x and builds the shape."""
    try:
        key = (name, x.shape, x.dtype, x.device, scalars, tuple(map(type, scalars)), config)
        hit = _served.get(key)
    except (AttributeError, TypeError):  # not a tensor, or an unhashable value: shape_of's checks name it
        key = hit = None
    if hit is not None:
        return hit
    kern = get(name, shape_of(), arch=arch_of(x), config=_config(config))
    if key is not None:
        _served.remember(key, kern)
    return kern


def _need(x, ndim, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() not in ndim:
        want = " or ".join(f"{n}-D" for n in ndim)
        raise TensorError(f"{what}: expected a {want} tensor, got {getattr(x, 'shape', type(x).__name__)}")


def _need_dtype(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """TensorError unless t has `dtype`: for a tensor the op computes on in torch before a kernel would check it."""
    if t.dtype != dtype:
        raise TensorError(f"{what} has dtype {t.dtype}, expected {dtype}")


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


def _check(cond, message, error: type[TkjitError] = TensorError) -> None:
    """`error(message())` unless cond. For conditions on sizes that may be symbolic (torch.compile with dynamic
    shapes), torch._check's way: a guard or runtime assert, where `if not cond` would specialise the graph on
    the size. message: a callable, so the text is only built on failure."""
    if type(cond) is bool:  # eager calls and static sizes: no symbolic machinery (µs a call)
        if not cond:
            raise error(message())
        return
    torch._check_with(error, cond, message)


def _need_contiguous(t: torch.Tensor, what: str) -> None:
    """TensorError unless t is contiguous: for a tensor the op views in another shape before the kernel sees
    it (the kernel's own check would come after a torch error from the view)."""
    if not t.is_contiguous():
        raise TensorError(f"{what} must be contiguous (call .contiguous()); got strides {t.stride()} for shape "
                          f"{tuple(t.shape)}")


def _check_block_rows(name: str, sf: torch.Tensor, num_tokens, block: int) -> None:
    """The kernel's check of per-block scales' rows, ceil(num_tokens / block) (a CeilDiv dim, which _fake_check
    leaves to its caller), where the sizes may be symbolic (a fake call)."""
    got, want = sf.shape[0], (num_tokens + block - 1) // block
    _check(got == want, lambda: f"{name}: input sf axis 0 is {got}, expected ceil(num_tokens / {block}) ({want})")


def _fake_check(name: str, shape: dict, *tensors: torch.Tensor) -> None:
    """What the real call would refuse before launching, at trace time: bad shape params, dtypes, sizes,
    with the kernel's own messages (tkjit.kernel's checks). Also the real call's checks where it launches
    nothing (empty inputs), so that those are refused as the kernel would refuse them.

    shape holds the static params (plain ints, read off the tensors with int(): compiled in, so a
    traced graph specialises on them) and may hold runtime sizes given as int arguments; the runtime
    sizes read off the tensors may be symbolic: each must agree with the first tensor having it (a guard
    or runtime assert, not a specialisation). tensors: the inputs the variant takes, in the spec's order
    (optional ones it does not take left out), or a leading part of them.
    """
    from tkjit.registry import get_spec

    spec = get_spec(name)
    full = spec.canonical_shape({**{p.name: 1 for p in spec.runtime_params}, **shape})
    runtime = {p.name for p in spec.runtime_params}
    sizes: dict = {}  # each runtime size, as the first tensor having it says (the kernel's rule)
    for t, arg in zip(tensors, [a for a in spec.inputs if a.present(full)]):
        dtype, dims = arg.resolve(full)
        if not isinstance(t, torch.Tensor):
            raise TensorError(f"{name}: input {arg.name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch_dtype(dtype):
            raise TensorError(f"{name}: input {arg.name} has dtype {t.dtype}, expected {torch_dtype(dtype)}")
        if t.dim() != len(dims):
            raise TensorError(f"{name}: input {arg.name} has {t.dim()} dims {tuple(t.shape)}, expected {len(dims)} "
                              f"({_dims_text(arg, dims, full, runtime)})")
        for axis, (d, size) in enumerate(zip(arg.dims, dims)):
            got = t.shape[axis]
            if isinstance(d, str) and d in runtime:
                want = sizes.setdefault(d, got)
                _check(got == want, lambda arg=arg, axis=axis, d=d, got=got, want=want:
                       f"{name}: input {arg.name} axis {axis} ({d}) is {got}, other tensors say {want}")
            elif isinstance(d, (Align, CeilDiv)) and d.name in runtime:
                continue  # a function of a runtime size: the caller checks it (e.g. per-block scales' rows)
            elif got != size:
                raise TensorError(f"{name}: input {arg.name} has shape {tuple(t.shape)}, expected "
                                  f"({_dims_text(arg, dims, full, runtime)}) (axis {axis} must be {size}, compiled in)")


def _dims_text(arg, dims: tuple, full: dict, runtime: set) -> str:
    """An input's dims as the kernel's messages write them: sizes of runtime params by name, the rest by value."""
    def one(d, size) -> str:
        if isinstance(d, str) and d in runtime:
            return d
        if isinstance(d, CeilDiv) and d.name in runtime:
            return str(d.resolved(full))
        if isinstance(d, Align) and d.name in runtime:
            return f"align({d.name}, {d.multiple})"
        return str(size)

    return ", ".join(one(d, size) for d, size in zip(arg.dims, dims))


def _op_pair(first_impl, second_impl, schema: str, fake) -> tuple:
    """The ops tkjit::<name> of one op's two forms (a cast's row- and column-major scales, per_channel_cast's
    plain and transposed values), from their implementations `<name>_impl`: one schema, one fake.

    fake(name, second, *args): the fake outputs of form `name` (second: the second form), args the call's
    arguments in the schema's order, defaults filled in and `config` left out."""
    ops = []
    for impl, second in ((first_impl, False), (second_impl, True)):
        name = impl.__name__.removesuffix("_impl")
        op = torch.library.custom_op(f"tkjit::{name}", mutates_args=(), schema=schema)(impl)
        op.register_fake(_fake_of(impl, name, second, fake))
        ops.append(op)
    return tuple(ops)


def _fake_of(impl, name: str, second: bool, fake):
    sig = inspect.signature(impl)

    def fake_impl(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return fake(name, second, *(v for k, v in bound.arguments.items() if k != "config"))

    return fake_impl


def _with_scales(values_and_grid):
    """A cast's fake for _op_pair from values_and_grid(name, *args) -> (fake values, scale rows, scale columns):
    float32 scales (rows, cols), or for the column-major form their TMA-aligned storage (cols, align(rows, 4))."""

    def fake(name, col_major, *args):
        q, rows, cols = values_and_grid(name, *args)
        return q, q.new_empty((cols, tma_aligned(rows)) if col_major else (rows, cols), dtype=torch.float32)

    return fake


# -- sinkhorn ----------------------------------------------------------------------------------------

def _sinkhorn_shape(name: str, x, repeat, eps) -> dict:
    _need(x, (3,), name)
    return {"num_tokens": max(1, x.shape[0]), "n": x.shape[1], "repeat": repeat, "eps": eps}


def sinkhorn_fwd_impl(x, repeat=10, eps=1e-6, config=None, bwd_config=None):
    """(num_tokens, n, n) float32 -> Sinkhorn-normalised; its gradient runs sinkhorn_bwd (config bwd_config)."""
    return _kernel_for("sinkhorn_fwd", x, (repeat, eps), config,
                       lambda: _sinkhorn_shape("sinkhorn_fwd", x, repeat, eps))(x)


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
    return _kernel_for("sinkhorn_bwd", x, (repeat, eps), config,
                       lambda: _sinkhorn_shape("sinkhorn_bwd", x, repeat, eps))(grad_out, x)


sinkhorn_bwd = torch.library.custom_op(
    "tkjit::sinkhorn_bwd",
    mutates_args=(),
    schema="(Tensor grad_out, Tensor x, int repeat=10, float eps=1e-06, str? config=None) -> Tensor",
)(sinkhorn_bwd_impl)


@sinkhorn_bwd.register_fake
def _(grad_out, x, repeat=10, eps=1e-6, config=None):
    _need(x, (3,), "sinkhorn_bwd")
    _fake_check("sinkhorn_bwd", {"n": int(x.shape[1]), "repeat": repeat, "eps": eps}, grad_out, x)
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
    def shape_of():
        _need(scores, (2,), "topk_gate")
        return {"num_tokens": max(1, scores.shape[0]), "num_experts": scores.shape[1], "k": k}

    return _kernel_for("topk_gate", scores, (k,), config, shape_of)(scores)


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
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.shape[0], -(-hidden // group)


def per_token_cast_impl(x, group=128, round_scale=False, config=None):
    """(num_tokens, hidden) bf16/f32 -> (fp8 e4m3 values, float32 scales (num_tokens, ceil(hidden / group)))."""
    return _cast("per_token_cast", x, group, round_scale, config)


def per_token_cast_colmajor_impl(x, group=128, round_scale=False, config=None):
    """per_token_cast with the scales' TMA-aligned column-major storage (ceil(hidden / group),
    align(num_tokens, 4))."""
    return _cast("per_token_cast_colmajor", x, group, round_scale, config)


per_token_cast, per_token_cast_colmajor = _op_pair(
    per_token_cast_impl, per_token_cast_colmajor_impl, _CAST_SCHEMA, _with_scales(_fake_cast)
)


# -- transpose -------------------------------------------------------------------------------------

def transpose_impl(x, config=None):
    """(rows, cols) -> (cols, rows), or (batch, rows, cols) -> (batch, cols, rows), bit-exact."""
    def shape_of():
        _need(x, (2, 3), "transpose")
        shape = {"rows": max(1, x.shape[-2]), "cols": x.shape[-1], "dtype": dtype_name(x.dtype)}
        if x.dim() == 3:
            shape["batch"] = max(1, x.shape[0])
        return shape

    name = "batched_transpose" if getattr(x, "ndim", None) == 3 else "transpose"
    return _kernel_for(name, x, (), config, shape_of)(x)


transpose = torch.library.custom_op(
    "tkjit::transpose", mutates_args=(), schema="(Tensor x, str? config=None) -> Tensor"
)(transpose_impl)


@transpose.register_fake
def _(x, config=None):
    _need(x, (2, 3), "transpose")
    name = "batched_transpose" if x.dim() == 3 else "transpose"
    _fake_check(name, {"cols": int(x.shape[-1]), "dtype": dtype_name(x.dtype)}, x)
    return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2]))


# -- normalize_weight -------------------------------------------------------------------------------

def normalize_weight_impl(topk_weights, config=None):
    """(num_tokens, num_topk) float32 -> (denominator (num_tokens,), normalized (num_tokens, num_topk))."""
    _need(topk_weights, (2,), "normalize_weight")
    shape = {"num_tokens": max(1, topk_weights.shape[0]), "num_topk": topk_weights.shape[1]}
    return get("normalize_weight", shape, arch=arch_of(topk_weights), config=_config(config))(topk_weights)


normalize_weight = torch.library.custom_op(
    "tkjit::normalize_weight", mutates_args=(),
    schema="(Tensor topk_weights, str? config=None) -> (Tensor, Tensor)",
)(normalize_weight_impl)


@normalize_weight.register_fake
def _(topk_weights, config=None):
    _need(topk_weights, (2,), "normalize_weight")
    _fake_check("normalize_weight", {"num_topk": int(topk_weights.shape[1])}, topk_weights)
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
    _need(indices, (2,), "mask_indices_by_tp")
    _need_index_dtype(indices, "mask_indices_by_tp")
    scalars = tp_scalars("mask_indices_by_tp", n, num_ep_ranks, tp_rank, num_tp_ranks)
    check_indices("mask_indices_by_tp", "indices", indices, n)
    shape = {"num_tokens": max(1, indices.shape[0]), "num_topk": indices.shape[1], "dtype": dtype_name(indices.dtype)}
    return get("mask_indices_by_tp", shape, arch=arch_of(indices), config=_config(config))(indices, *scalars)


mask_indices_by_tp = torch.library.custom_op(
    "tkjit::mask_indices_by_tp", mutates_args=(),
    schema="(Tensor indices, int n, int num_ep_ranks, int tp_rank, int num_tp_ranks, str? config=None) -> Tensor",
)(mask_indices_by_tp_impl)


@mask_indices_by_tp.register_fake
def _(indices, n, num_ep_ranks, tp_rank, num_tp_ranks, config=None):
    _need(indices, (2,), "mask_indices_by_tp")
    _need_index_dtype(indices, "mask_indices_by_tp")
    tp_scalars("mask_indices_by_tp", n, num_ep_ranks, tp_rank, num_tp_ranks)
    _fake_check("mask_indices_by_tp", {"num_topk": int(indices.shape[1]), "dtype": dtype_name(indices.dtype)}, indices)
    return torch.empty_like(indices, memory_format=torch.contiguous_format)


# -- inplace_unique_group_indices -------------------------------------------------------------------

def inplace_unique_group_indices_impl(group_indices, num_groups, config=None):
    """In place on (num_tokens, num_topk) int64: repeats of an id in [0, num_groups) after its first
    occurrence in the row become -1. Returns None."""
    _need(group_indices, (2,), "inplace_unique_group_indices")
    check_indices("inplace_unique_group_indices", "group_indices", group_indices, num_groups)
    shape = {"num_tokens": max(1, group_indices.shape[0]), "num_topk": group_indices.shape[1], "num_groups": num_groups}
    get("inplace_unique_group_indices", shape, arch=arch_of(group_indices), config=_config(config))(group_indices)


inplace_unique_group_indices = torch.library.custom_op(
    "tkjit::inplace_unique_group_indices", mutates_args=("group_indices",),
    schema="(Tensor(a!) group_indices, int num_groups, str? config=None) -> ()",
)(inplace_unique_group_indices_impl)


@inplace_unique_group_indices.register_fake
def _(group_indices, num_groups, config=None):
    _need(group_indices, (2,), "inplace_unique_group_indices")
    _fake_check("inplace_unique_group_indices",
                {"num_topk": int(group_indices.shape[1]), "num_groups": num_groups}, group_indices)


# -- group_count -------------------------------------------------------------------------------------

def group_count_impl(group_idx, num_groups, config=None):
    """int64 (num_tokens, num_topk) ids -> int32 (num_groups,) counts; entries < 0 (or >= num_groups) skipped."""
    _need(group_idx, (2,), "group_count")
    check_indices("group_count", "group_idx", group_idx, num_groups)
    shape = {"num_tokens": max(1, group_idx.shape[0]), "num_topk": group_idx.shape[1], "num_groups": num_groups}
    return get("group_count", shape, arch=arch_of(group_idx), config=_config(config))(group_idx)


group_count = torch.library.custom_op(
    "tkjit::group_count", mutates_args=(), schema="(Tensor group_idx, int num_groups, str? config=None) -> Tensor"
)(group_count_impl)


@group_count.register_fake
def _(group_idx, num_groups, config=None):
    _need(group_idx, (2,), "group_count")
    _fake_check("group_count", {"num_topk": int(group_idx.shape[1]), "num_groups": num_groups}, group_idx)
    return group_idx.new_empty((num_groups,), dtype=torch.int32)


# -- aux_fi ------------------------------------------------------------------------------------------

def aux_fi_impl(topk_idx, num_experts, num_aux_topk, config=None):
    """int64 (num_tokens, num_topk) expert ids -> float32 (num_experts,)
    count * num_experts / (num_tokens * num_aux_topk); entries < 0 (or >= num_experts) skipped."""
    _need(topk_idx, (2,), "aux_fi")
    check_indices("aux_fi", "topk_idx", topk_idx, num_experts)
    shape = {"num_tokens": max(1, topk_idx.shape[0]), "num_topk": topk_idx.shape[1], "num_experts": num_experts}
    fi, _counts = get("aux_fi", shape, arch=arch_of(topk_idx), config=_config(config))(topk_idx, num_aux_topk)
    return fi


aux_fi = torch.library.custom_op(
    "tkjit::aux_fi", mutates_args=(),
    schema="(Tensor topk_idx, int num_experts, int num_aux_topk, str? config=None) -> Tensor",
)(aux_fi_impl)


@aux_fi.register_fake
def _(topk_idx, num_experts, num_aux_topk, config=None):
    _need(topk_idx, (2,), "aux_fi")
    _fake_check("aux_fi", {"num_topk": int(topk_idx.shape[1]), "num_experts": num_experts}, topk_idx)
    return topk_idx.new_empty((num_experts,), dtype=torch.float32)


# -- topk_sum_and_topk_group_idx ---------------------------------------------------------------------

def _group_shape(scores, num_topk_sum, num_topk_groups):
    return {"num_groups": scores.shape[1], "num_experts_per_group": scores.shape[2],
            "num_topk_sum": num_topk_sum, "num_topk_groups": num_topk_groups}


def topk_sum_and_topk_group_idx_impl(scores, num_topk_sum, num_topk_groups, config=None):
    """(num_tokens, num_groups, experts_per_group) float32 -> int64 (num_tokens, num_topk_groups): the groups
    with the largest sums of their num_topk_sum best scores, best first, ties to the smaller group."""
    _need(scores, (3,), "topk_sum_and_topk_group_idx")
    shape = {"num_tokens": max(1, scores.shape[0]), **_group_shape(scores, num_topk_sum, num_topk_groups)}
    return get("topk_sum_and_topk_group_idx", shape, arch=arch_of(scores), config=_config(config))(scores)


topk_sum_and_topk_group_idx = torch.library.custom_op(
    "tkjit::topk_sum_and_topk_group_idx", mutates_args=(),
    schema="(Tensor scores, int num_topk_sum, int num_topk_groups, str? config=None) -> Tensor",
)(topk_sum_and_topk_group_idx_impl)


@topk_sum_and_topk_group_idx.register_fake
def _(scores, num_topk_sum, num_topk_groups, config=None):
    _need(scores, (3,), "topk_sum_and_topk_group_idx")
    shape = _group_shape(scores, num_topk_sum, num_topk_groups)
    _fake_check("topk_sum_and_topk_group_idx", {k: int(v) for k, v in shape.items()}, scores)
    return scores.new_empty((scores.shape[0], num_topk_groups), dtype=torch.int64)


# -- expand_to_fused ---------------------------------------------------------------------------------

def _expand_static(x, token_topk_to_pos) -> dict:
    return {"hidden": int(x.shape[1]), "num_topk": int(token_topk_to_pos.shape[1]), "dtype": dtype_name(x.dtype)}


def expand_to_fused_impl(x, token_topk_to_pos, pos_to_expert, config=None):
    """x (num_tokens, hidden) -> (num_expanded_tokens, hidden): row t copied to each valid position
    token_topk_to_pos[t, k], padding rows (pos_to_expert < 0) zero; bit-exact, any element type."""
    _need(x, (2,), "expand_to_fused")
    _need(token_topk_to_pos, (2,), "expand_to_fused")
    _need(pos_to_expert, (1,), "expand_to_fused")
    (n, h), p = x.shape, pos_to_expert.shape[0]
    check_indices("expand_to_fused", "token_topk_to_pos", token_topk_to_pos, p)
    if n == 0:  # nothing launches: every row is padding or unmapped, zero (TileKernels' reference)
        _fake_check("expand_to_fused", _expand_static(x, token_topk_to_pos), x, token_topk_to_pos, pos_to_expert)
        return x.new_zeros((p, h))
    shape = {"num_tokens": n, "num_expanded_tokens": max(1, p), **_expand_static(x, token_topk_to_pos)}
    return get("expand_to_fused", shape, arch=arch_of(x), config=_config(config))(x, token_topk_to_pos, pos_to_expert)


expand_to_fused = torch.library.custom_op(
    "tkjit::expand_to_fused", mutates_args=(),
    schema="(Tensor x, Tensor token_topk_to_pos, Tensor pos_to_expert, str? config=None) -> Tensor",
)(expand_to_fused_impl)


@expand_to_fused.register_fake
def _(x, token_topk_to_pos, pos_to_expert, config=None):
    _need(x, (2,), "expand_to_fused")
    _need(token_topk_to_pos, (2,), "expand_to_fused")
    _need(pos_to_expert, (1,), "expand_to_fused")
    _fake_check("expand_to_fused", _expand_static(x, token_topk_to_pos), x, token_topk_to_pos, pos_to_expert)
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
        _need(t, (2,), "reduce_fused")
    static = _reduce_static(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf)
    n, p = token_topk_to_pos.shape[0], x.shape[0]
    check_indices("reduce_fused", "token_topk_to_pos", token_topk_to_pos, p)
    shape = {"num_tokens": max(1, n), "num_expanded_tokens": max(1, p), **static}
    kern = get("reduce_fused", shape, arch=arch_of(x), config=_config(config))
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
        _need(t, (2,), "reduce_fused")
    static = _reduce_static(x, topk_weights, token_topk_to_pos, fp8_format, sf, x_sf)
    _fake_check("reduce_fused", static, *[t for t in (x, topk_weights, token_topk_to_pos, sf, x_sf) if t is not None])
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
    _need(topk_idx, (2,), "get_fused_mapping")
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
    checking = _check_indices_on()  # (read once: an environment lookup)
    if checking:
        check_indices("get_fused_mapping", "topk_idx", topk_idx, num_experts)
    n, k = topk_idx.shape
    dev, i32 = topk_idx.device, torch.int32
    if n == 0:  # nothing routed: every position is padding, every segment empty (checked all the same)
        _fake_check("get_fused_mapping", shape, topk_idx)
        pos = [torch.full((num_expanded_tokens,), -1, dtype=i32, device=dev) for _ in range(3)]
        return (*pos, torch.empty((0, k), dtype=i32, device=dev),
                *[torch.zeros(num_experts, dtype=i32, device=dev) for _ in range(3)])
    kernel = get("get_fused_mapping", shape, arch=arch_of(topk_idx), config=_config(config))
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
    _fake_check("get_fused_mapping", _fused_static(topk_idx, num_experts, num_expanded_tokens, alignment), topk_idx)
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
        _need(t, (2,), "expand_to_fused_with_sf")
    _need(pos_to_expert, (1,), "expand_to_fused_with_sf")


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
        _fake_check(name, static, x, x_sf, token_topk_to_pos, pos_to_expert)  # (the kernel's checks)
        sw = x_sf.shape[1]
        sf_shape = (sw, _sf_storage_cols(p)) if use_tma_aligned_col_major_sf else (p, sw)
        return x.new_zeros((p, h)), x_sf.new_zeros(sf_shape)
    kern = get(name, shape, arch=arch_of(x), config=_config(config))
    return kern(x, x_sf, token_topk_to_pos, pos_to_expert)


expand_to_fused_with_sf = torch.library.custom_op(
    "tkjit::expand_to_fused_with_sf", mutates_args=(), schema=_EXPAND_SF_SCHEMA
)(expand_to_fused_with_sf_impl)


@expand_to_fused_with_sf.register_fake
def _(x, x_sf, num_per_channels, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf=False,
      config=None):
    _expand_sf_need(x, x_sf, token_topk_to_pos, pos_to_expert)
    name = "expand_to_fused_with_sf_colmajor" if use_tma_aligned_col_major_sf else "expand_to_fused_with_sf"
    _fake_check(name, _expand_sf_static(x, x_sf, num_per_channels, token_topk_to_pos),
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
        _need(fix_routing_mask, (1,), f"{op}: fix_routing_mask")
        _need_dtype(fix_routing_mask, torch.bool, f"{op}: fix_routing_mask")
        _check(fix_routing_mask.shape[0] == num_tokens, lambda: f"{op}: fix_routing_mask has "
               f"{fix_routing_mask.shape[0]} entries, logits has {num_tokens} tokens")
    if unmapped_topk_idx is not None:
        _need(unmapped_topk_idx, (2,), f"{op}: unmapped_topk_idx")
        _need_dtype(unmapped_topk_idx, torch.int64, f"{op}: unmapped_topk_idx")
        for axis, want in enumerate((num_tokens, num_topk)):
            _check(unmapped_topk_idx.shape[axis] == want, lambda: f"{op}: unmapped_topk_idx has shape "
                   f"{tuple(unmapped_topk_idx.shape)}, expected (num_tokens, num_topk) = ({num_tokens}, {num_topk})")
        # Any row stride (a view of a wider buffer), as TileKernels.
        _check(unmapped_topk_idx.stride(1) == 1, lambda: f"{op}: unmapped_topk_idx must have a contiguous last "
               f"axis (stride(1) == 1), got strides {unmapped_topk_idx.stride()}")


def top2_sum_gate_setup(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed,
                        num_shared_experts, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask,
                        to_physical_map, logical_count, fix_routing_mask=None,
                        unmapped_topk_idx=None) -> tuple[dict, tuple[int, int, int, int]]:
    """(static shape, (ep_rank, per_gpu, tp_rank, num_tp_ranks)), or ShapeError/TensorError naming the
    argument: TileKernels' asserts (shared experts, scoring function, map shapes, fixed routing) and sizes that
    would divide by zero."""
    op = "top2_sum_gate"
    _need(logits, (2,), op)
    _need(bias, (1,), op)
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
        _need(to_physical_map, (2,), op)
        _need(logical_count, (1,), op)
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
    kern = get("top2_sum_gate", {"num_tokens": max(1, logits.shape[0]), **shape}, arch=arch_of(logits),
               config=_config(config))
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
    _fake_check("top2_sum_gate", shape, *_top2_tensors(logits, bias, mask, to_physical_map, logical_count,
                                                       fix_routing_mask, unmapped_topk_idx))
    p = num_topk + shape["num_shared_experts"]
    return (logits.new_empty((logits.shape[0], p), dtype=torch.int64),
            logits.new_empty((logits.shape[0], p), dtype=torch.float32))


# -- engram_hash / fused_weight ----------------------------------------------------------------------

_ENGRAM_HASH_INPUTS = (("ngram_token_ids", 2), ("multipliers", 2), ("vocab_sizes", 3), ("offsets", 2))


def _engram_hash_static(ngram_token_ids, multipliers, vocab_sizes, offsets) -> dict:
    """The static shape (N, L, E) read off ngram_token_ids and vocab_sizes; the other tensors are checked
    against it by the kernel (or _fake_check)."""
    for (name, ndim), t in zip(_ENGRAM_HASH_INPUTS, (ngram_token_ids, multipliers, vocab_sizes, offsets)):
        _need(t, (ndim,), f"engram_hash: {name}")
    return {"max_ngram_size": int(ngram_token_ids.shape[1]), "num_ngram_layers": int(vocab_sizes.shape[0]),
            "num_embed_table_per_ngram": int(vocab_sizes.shape[2])}


def engram_hash_impl(ngram_token_ids, multipliers, vocab_sizes, offsets, config=None):
    """ngram_token_ids (num_tokens, N) int32, multipliers (L, N) int64, vocab_sizes (L, N - 1, E) int32,
    offsets (L, (N - 1) * E) int32 -> int32 (L, num_tokens, (N - 1) * E) embedding indices. Table sizes
    < 1 are refused with TKJIT_CHECK_INDICES=1 (one device sync)."""
    static = _engram_hash_static(ngram_token_ids, multipliers, vocab_sizes, offsets)
    check_indices("engram_hash", "vocab_sizes", vocab_sizes, 1 << 31, lo=1)
    shape = {"num_tokens": max(1, ngram_token_ids.shape[0]), **static}
    kern = get("engram_hash", shape, arch=arch_of(ngram_token_ids), config=_config(config))
    return kern(ngram_token_ids, multipliers, vocab_sizes, offsets)


engram_hash = torch.library.custom_op(
    "tkjit::engram_hash", mutates_args=(),
    schema="(Tensor ngram_token_ids, Tensor multipliers, Tensor vocab_sizes, Tensor offsets, str? config=None) "
           "-> Tensor",
)(engram_hash_impl)


@engram_hash.register_fake
def _(ngram_token_ids, multipliers, vocab_sizes, offsets, config=None):
    static = _engram_hash_static(ngram_token_ids, multipliers, vocab_sizes, offsets)
    _fake_check("engram_hash", static, ngram_token_ids, multipliers, vocab_sizes, offsets)
    cols = (static["max_ngram_size"] - 1) * static["num_embed_table_per_ngram"]
    return ngram_token_ids.new_empty((static["num_ngram_layers"], ngram_token_ids.shape[0], cols), dtype=torch.int32)


def _fused_weight_static(weight_hidden, weight_embed) -> dict:
    _need(weight_hidden, (2,), "fused_weight: weight_hidden")
    _need(weight_embed, (2,), "fused_weight: weight_embed")
    return {"hc_mult": int(weight_hidden.shape[0]), "hidden_size": int(weight_hidden.shape[1])}


def fused_weight_impl(weight_hidden, weight_embed, config=None):
    """weight_hidden, weight_embed (hc_mult, hidden_size) bfloat16 -> their float32 product, same shape."""
    shape = _fused_weight_static(weight_hidden, weight_embed)
    return get("fused_weight", shape, arch=arch_of(weight_hidden), config=_config(config))(weight_hidden, weight_embed)


fused_weight = torch.library.custom_op(
    "tkjit::fused_weight", mutates_args=(),
    schema="(Tensor weight_hidden, Tensor weight_embed, str? config=None) -> Tensor",
)(fused_weight_impl)


@fused_weight.register_fake
def _(weight_hidden, weight_embed, config=None):
    _fake_check("fused_weight", _fused_weight_static(weight_hidden, weight_embed), weight_hidden, weight_embed)
    return weight_hidden.new_empty(tuple(weight_hidden.shape), dtype=torch.float32)


# -- cast_back ---------------------------------------------------------------------------------------

_CAST_BACK_SCHEMA = ("(Tensor x, Tensor sf, int block_tokens=1, int block_channels=128, str out_dtype='bfloat16', "
                     "str? config=None) -> Tensor")
_CAST_BACK_FMT = {torch.float8_e4m3fn: "e4m3", torch.int8: "e2m1"}  # int8: two FP4 e2m1 codes per byte


def _cast_back_static(name, x, sf, block_tokens, block_channels, out_dtype) -> dict:
    """The static shape: hidden is the logical width (twice x's for packed e2m1), or TensorError naming x / sf."""
    _need(x, (2,), name)
    _need(sf, (2,), name)
    fmt = _CAST_BACK_FMT.get(x.dtype)
    if fmt is None:
        raise TensorError(f"{name}: x must be float8_e4m3fn, or int8 holding two FP4 e2m1 codes per byte; "
                          f"got {x.dtype}")
    if sf.dtype not in (torch.float32, torch.int32):
        raise TensorError(f"{name}: sf must be float32, or int32 packed UE8M0 exponents; got {sf.dtype}")
    return {"hidden": int(x.shape[1]) * (2 if fmt == "e2m1" else 1), "block_tokens": block_tokens,
            "block_channels": block_channels, "in_fmt": fmt, "out_dtype": out_dtype, "sf_dtype": dtype_name(sf.dtype)}


def _check_sf_rows(name, x, sf, block_tokens: int) -> None:
    """TensorError unless sf has ceil(num_tokens / block_tokens) token rows (axis 1 of the column-major forms'
    storage view); the sizes may be symbolic (a fake call). Before the spec's checks (its ShapeError on num_sf_rows
    would name no tensor), but for a block_tokens that is not a positive int: those name it."""
    if type(block_tokens) is not int or block_tokens < 1:
        return
    n, rows = x.shape[0], sf.shape[1 if name.endswith("_colmajor") else 0]
    want = (n + block_tokens - 1) // block_tokens
    _check(rows == want, lambda: f"{name}: sf has {rows} token rows, expected ceil(num_tokens / block_tokens) = "
                                 f"ceil({n} / {block_tokens}) = {want} (sf shape {tuple(sf.shape)})")


def _cast_back(name, x, sf, block_tokens, block_channels, out_dtype, config, static_of=None):
    """One dequantising call of `name` (cast_back[_e5m6][_colmajor]): the scales' token rows checked, the kernel
    got for the shape. static_of: the static params read off the arguments (the e4m3 / e2m1 form's default)."""
    static = (static_of or _cast_back_static)(name, x, sf, block_tokens, block_channels, out_dtype)
    _check_sf_rows(name, x, sf, block_tokens)
    n, rows = x.shape[0], sf.shape[1 if name.endswith("_colmajor") else 0]
    shape = {"num_tokens": max(1, n), "num_sf_rows": max(1, rows), **static}
    return get(name, shape, arch=arch_of(x), config=_config(config))(x, sf)


def _fake_cast_back(name, col_major, x, sf, block_tokens, block_channels, out_dtype, static_of=None):
    static = (static_of or _cast_back_static)(name, x, sf, block_tokens, block_channels, out_dtype)
    _check_sf_rows(name, x, sf, block_tokens)
    _fake_check(name, static, x, sf)
    return x.new_empty((x.shape[0], static["hidden"]), dtype=torch_dtype(out_dtype))


def cast_back_impl(x, sf, block_tokens=1, block_channels=128, out_dtype="bfloat16", config=None):
    """FP8 e4m3 (num_tokens, hidden) or packed FP4 e2m1 int8 (num_tokens, hidden / 2) values and float32 scales
    (ceil(num_tokens / block_tokens), ceil(hidden / block_channels)), row-major (rows at any stride)
    -> (num_tokens, hidden) bfloat16 / float32: values * scales, bit-exact."""
    return _cast_back("cast_back", x, sf, block_tokens, block_channels, out_dtype, config)


def cast_back_colmajor_impl(x, sf, block_tokens=1, block_channels=128, out_dtype="bfloat16", config=None):
    """cast_back with column-major scales given as their storage view: sf is s.T for the column-major
    (num_sf_rows, ...) scales s, i.e. (num_sf_cols, num_sf_rows) float32, or (ceil(num_sf_cols / 4), num_sf_rows)
    int32 packed UE8M0, rows at any stride."""
    return _cast_back("cast_back_colmajor", x, sf, block_tokens, block_channels, out_dtype, config)


cast_back, cast_back_colmajor = _op_pair(
    cast_back_impl, cast_back_colmajor_impl, _CAST_BACK_SCHEMA, _fake_cast_back
)


# -- per_block_cast ----------------------------------------------------------------------------------

_BLOCK_CAST_SCHEMA = ("(Tensor x, int block_m=128, int block_k=128, bool round_scale=False, str fmt='e4m3', "
                      "str? config=None) -> (Tensor, Tensor)")
_BLOCK_CAST_FORMATS = {"e4m3": torch.float8_e4m3fn, "e2m1": torch.int8}  # values' dtype (e2m1: two codes per byte)


def _block_static(name, x, block_m, block_k, fmt, round_scale=None) -> dict:
    """per_block_cast's static params read off x (round_scale: None for the given-scales spec), or
    TensorError / ShapeError naming x / fmt."""
    _need(x, (2,), name)
    if not isinstance(fmt, str) or fmt not in _BLOCK_CAST_FORMATS:
        raise ShapeError(f"{name}: fmt must be one of {list(_BLOCK_CAST_FORMATS)}, got {fmt!r}")
    shape = {"hidden": int(x.shape[1]), "block_m": block_m, "block_k": block_k, "in_dtype": dtype_name(x.dtype),
             "fmt": fmt}
    if round_scale is not None:
        shape["round_scale"] = round_scale
    return shape


def _fake_block_values(x, fmt) -> torch.Tensor:
    """The fake values: (num_tokens, hidden) e4m3, or (num_tokens, hidden / 2) int8 of e2m1 pairs."""
    width = int(x.shape[1]) // 2 if fmt == "e2m1" else int(x.shape[1])
    return x.new_empty((x.shape[0], width), dtype=_BLOCK_CAST_FORMATS[fmt])


def _block_cast(name, x, block_m, block_k, round_scale, fmt, config):
    shape = {**_block_static(name, x, block_m, block_k, fmt, round_scale), "num_tokens": max(1, x.shape[0])}
    return get(name, shape, arch=arch_of(x), config=_config(config))(x)


def _fake_block_cast(name, x, block_m, block_k, round_scale, fmt):
    """(fake values, scale rows ceil(num_tokens / block_m), scale columns ceil(hidden / block_k))."""
    _fake_check(name, _block_static(name, x, block_m, block_k, fmt, round_scale), x)
    return _fake_block_values(x, fmt), (x.shape[0] + block_m - 1) // block_m, -(-int(x.shape[1]) // block_k)


def per_block_cast_impl(x, block_m=128, block_k=128, round_scale=False, fmt="e4m3", config=None):
    """(num_tokens, hidden) bf16/f32 -> (values, float32 scales (ceil(num_tokens / block_m), ceil(hidden / block_k)),
    one per block_m x block_k tile). Values: fmt 'e4m3' fp8 (num_tokens, hidden), or 'e2m1' int8 (num_tokens,
    hidden / 2) holding two FP4 codes per byte, the even channel in the low nibble."""
    return _block_cast("per_block_cast", x, block_m, block_k, round_scale, fmt, config)


def per_block_cast_colmajor_impl(x, block_m=128, block_k=128, round_scale=False, fmt="e4m3", config=None):
    """per_block_cast with the scales' TMA-aligned column-major storage (ceil(hidden / block_k),
    align(ceil(num_tokens / block_m), 4))."""
    return _block_cast("per_block_cast_colmajor", x, block_m, block_k, round_scale, fmt, config)


per_block_cast, per_block_cast_colmajor = _op_pair(
    per_block_cast_impl, per_block_cast_colmajor_impl, _BLOCK_CAST_SCHEMA, _with_scales(_fake_block_cast)
)


def per_block_cast_with_sf_impl(x, sf, block_m=128, block_k=128, fmt="e4m3", config=None):
    """x (num_tokens, hidden) bf16/f32 and float32 scales (ceil(num_tokens / block_m), ceil(hidden / block_k))
    -> values per block: fmt 'e4m3' fp8(clamp(x / sf, -448, 448)), or 'e2m1' e2m1(x / sf) packed two per int8."""
    shape = {**_block_static("per_block_cast_with_sf", x, block_m, block_k, fmt), "num_tokens": max(1, x.shape[0])}
    return get("per_block_cast_with_sf", shape, arch=arch_of(x), config=_config(config))(x, sf)


per_block_cast_with_sf = torch.library.custom_op(
    "tkjit::per_block_cast_with_sf", mutates_args=(),
    schema="(Tensor x, Tensor sf, int block_m=128, int block_k=128, str fmt='e4m3', str? config=None) -> Tensor",
)(per_block_cast_with_sf_impl)


@per_block_cast_with_sf.register_fake
def _(x, sf, block_m=128, block_k=128, fmt="e4m3", config=None):
    name = "per_block_cast_with_sf"
    _fake_check(name, _block_static(name, x, block_m, block_k, fmt), x, sf)
    _check_block_rows(name, sf, x.shape[0], block_m)
    return _fake_block_values(x, fmt)


# -- per_channel_cast ------------------------------------------------------------------------------
# The kernels see x as (token_blocks, num_per_tokens, hidden) (tkjit_kernels/quant/_per_channel.py says why);
# the ops take and return TileKernels' 2-D tensors: values (num_tokens, hidden), or (hidden, num_tokens)
# transposed, and scales (num_tokens / num_per_tokens, hidden), all contiguous.

_PER_CHANNEL_SCHEMA = ("(Tensor x, int num_per_tokens=128, bool round_scale=False, str? config=None) "
                       "-> (Tensor, Tensor)")


def _per_channel_static(name, x, num_per_tokens, round_scale) -> dict:
    """The static shape, or ShapeError/TensorError naming the argument (before any division by it)."""
    from tkjit_kernels.quant._per_channel import TOKENS_PER_SCALE

    _need(x, (2,), name)
    if type(num_per_tokens) is not int or num_per_tokens not in TOKENS_PER_SCALE:
        raise ShapeError(f"{name}: num_per_tokens must be one of {list(TOKENS_PER_SCALE)}, got {num_per_tokens!r}")
    _need_contiguous(x, f"{name}: x")  # (the kernel's 3-D view of x needs whole rows, back to back)
    n = x.shape[0]
    _check(n % num_per_tokens == 0, lambda: f"{name}: num_tokens (x.shape[0] = {n}) must be a multiple of "
           f"num_per_tokens ({num_per_tokens}): a scale covers whole blocks of num_per_tokens tokens", ShapeError)
    return {"hidden": int(x.shape[1]), "num_per_tokens": num_per_tokens, "in_dtype": dtype_name(x.dtype),
            "round_scale": round_scale}


def _per_channel(name, x, num_per_tokens, round_scale, config, transposed):
    static = _per_channel_static(name, x, num_per_tokens, round_scale)
    (n, h), npt = x.shape, num_per_tokens
    blocks = n // npt
    kern = get(name, {**static, "token_blocks": max(1, blocks)}, arch=arch_of(x), config=_config(config))
    out = x.new_empty((h, n) if transposed else (n, h), dtype=torch.float8_e4m3fn)
    scales = x.new_empty((blocks, h), dtype=torch.float32)
    # The 2-D tensors are allocated here and the kernel writes their 3-D views: the op returns no views.
    kern(x.view(blocks, npt, h), out=(out.view((h, blocks, npt) if transposed else (blocks, npt, h)), scales))
    return out, scales


def _fake_per_channel(name, transposed, x, num_per_tokens, round_scale):
    static = _per_channel_static(name, x, num_per_tokens, round_scale)
    _fake_check(name, static)
    n, h = x.shape
    out = x.new_empty((h, n) if transposed else (n, h), dtype=torch.float8_e4m3fn)
    return out, x.new_empty((n // num_per_tokens, h), dtype=torch.float32)


def per_channel_cast_impl(x, num_per_tokens=128, round_scale=False, config=None):
    """(num_tokens, hidden) bf16/f32 -> (fp8 e4m3 values (num_tokens, hidden), float32 scales
    (num_tokens / num_per_tokens, hidden)): one scale per channel and block of num_per_tokens tokens."""
    return _per_channel("per_channel_cast", x, num_per_tokens, round_scale, config, False)


def per_channel_cast_and_transpose_impl(x, num_per_tokens=128, round_scale=False, config=None):
    """per_channel_cast with the values transposed: (fp8 e4m3 (hidden, num_tokens), float32 scales
    (num_tokens / num_per_tokens, hidden))."""
    return _per_channel("per_channel_cast_and_transpose", x, num_per_tokens, round_scale, config, True)


per_channel_cast, per_channel_cast_and_transpose = _op_pair(
    per_channel_cast_impl, per_channel_cast_and_transpose_impl, _PER_CHANNEL_SCHEMA, _fake_per_channel
)


# -- expand_to_mhc / pre_apply_mix (mHC residual streams) --------------------------------------------

def _streams_shape(x, mhc_mult, hidden) -> dict:
    return {"num_tokens": max(1, int(x.shape[0])), "mhc_mult": mhc_mult, "hidden": hidden}


def expand_to_mhc_impl(x, mhc_mult, config=None, bwd_config=None, out=None):
    """(num_tokens, hidden) bf16 -> (num_tokens, mhc_mult, hidden) bf16, each row copied to every stream;
    its gradient runs expand_to_mhc_bwd (config bwd_config). out: written in place (eager callers only)."""
    _need(x, (2,), "expand_to_mhc")
    kern = get("expand_to_mhc", _streams_shape(x, mhc_mult, int(x.shape[1])), arch=arch_of(x), config=_config(config))
    return kern(x, out=out) if out is not None else kern(x)


expand_to_mhc = torch.library.custom_op(
    "tkjit::expand_to_mhc", mutates_args=(),
    schema="(Tensor x, int mhc_mult, str? config=None, str? bwd_config=None) -> Tensor",
)(expand_to_mhc_impl)


@expand_to_mhc.register_fake
def _(x, mhc_mult, config=None, bwd_config=None, out=None):
    _need(x, (2,), "expand_to_mhc")
    _fake_check("expand_to_mhc", {"mhc_mult": mhc_mult, "hidden": int(x.shape[1])}, x)
    return x.new_empty((x.shape[0], mhc_mult, x.shape[1]))


def expand_to_mhc_bwd_impl(out_grad, config=None):
    """(num_tokens, mhc_mult, hidden) bf16 -> (num_tokens, hidden) bf16: the streams summed in float32, in order."""
    _need(out_grad, (3,), "expand_to_mhc_bwd")
    shape = _streams_shape(out_grad, int(out_grad.shape[1]), int(out_grad.shape[2]))
    return get("expand_to_mhc_bwd", shape, arch=arch_of(out_grad), config=_config(config))(out_grad)


expand_to_mhc_bwd = torch.library.custom_op(
    "tkjit::expand_to_mhc_bwd", mutates_args=(), schema="(Tensor out_grad, str? config=None) -> Tensor",
)(expand_to_mhc_bwd_impl)


@expand_to_mhc_bwd.register_fake
def _(out_grad, config=None):
    _need(out_grad, (3,), "expand_to_mhc_bwd")
    _fake_check("expand_to_mhc_bwd", {"mhc_mult": int(out_grad.shape[1]), "hidden": int(out_grad.shape[2])}, out_grad)
    return out_grad.new_empty((out_grad.shape[0], out_grad.shape[2]))


def _mix_static(name, x, mix) -> dict:
    _need(x, (3,), name)
    _need(mix, (2,), f"{name}: mix")
    return {"mhc_mult": int(x.shape[1]), "hidden": int(x.shape[2])}


def pre_apply_mix_impl(x, mix, config=None, bwd_config=None, out=None):
    """x (num_tokens, mhc_mult, hidden) bf16, mix (num_tokens, mhc_mult) float32 -> (num_tokens, hidden) bf16:
    sum_m mix * x as fused multiply-adds in stream order, rounded once; its gradient runs pre_apply_mix_bwd."""
    static = _mix_static("pre_apply_mix", x, mix)
    kern = get("pre_apply_mix", {"num_tokens": max(1, int(x.shape[0])), **static}, arch=arch_of(x),
               config=_config(config))
    return kern(x, mix, out=out) if out is not None else kern(x, mix)


pre_apply_mix = torch.library.custom_op(
    "tkjit::pre_apply_mix", mutates_args=(),
    schema="(Tensor x, Tensor mix, str? config=None, str? bwd_config=None) -> Tensor",
)(pre_apply_mix_impl)


@pre_apply_mix.register_fake
def _(x, mix, config=None, bwd_config=None, out=None):
    _fake_check("pre_apply_mix", _mix_static("pre_apply_mix", x, mix), x, mix)
    return x.new_empty((x.shape[0], x.shape[2]))


def pre_apply_mix_bwd_impl(grad_out, x, mix, config=None):
    """(x_grad, mix_grad) of pre_apply_mix: x_grad = bf16(fma(mix, grad_out, +0.0)) (num_tokens, mhc_mult,
    hidden), mix_grad = <grad_out, x> float32 (num_tokens, mhc_mult)."""
    static = _mix_static("pre_apply_mix_bwd", x, mix)
    kern = get("pre_apply_mix_bwd", {"num_tokens": max(1, int(x.shape[0])), **static}, arch=arch_of(x),
               config=_config(config))
    return kern(grad_out, x, mix)


pre_apply_mix_bwd = torch.library.custom_op(
    "tkjit::pre_apply_mix_bwd", mutates_args=(),
    schema="(Tensor grad_out, Tensor x, Tensor mix, str? config=None) -> (Tensor, Tensor)",
)(pre_apply_mix_bwd_impl)


def _fake_mix_bwd(name, grad_out, x, mix):
    _fake_check(name, _mix_static(name, x, mix), grad_out, x, mix)


@pre_apply_mix_bwd.register_fake
def _(grad_out, x, mix, config=None):
    _fake_mix_bwd("pre_apply_mix_bwd", grad_out, x, mix)
    return x.new_empty(x.shape), mix.new_empty(mix.shape)


def pre_apply_mix_bwd_acc_impl(grad_out, x, mix, x_grad, config=None):
    """pre_apply_mix_bwd adding into x_grad in place (x_grad = bf16(fma(mix, grad_out, x_grad)), TileKernels'
    accumulation into the residual gradient); returns mix_grad."""
    static = _mix_static("pre_apply_mix_bwd_acc", x, mix)
    kern = get("pre_apply_mix_bwd_acc", {"num_tokens": max(1, int(x.shape[0])), **static}, arch=arch_of(x),
               config=_config(config))
    _, mix_grad = kern(grad_out, x, mix, x_grad)
    return mix_grad


pre_apply_mix_bwd_acc = torch.library.custom_op(
    "tkjit::pre_apply_mix_bwd_acc", mutates_args=("x_grad",),
    schema="(Tensor grad_out, Tensor x, Tensor mix, Tensor(a!) x_grad, str? config=None) -> Tensor",
)(pre_apply_mix_bwd_acc_impl)


@pre_apply_mix_bwd_acc.register_fake
def _(grad_out, x, mix, x_grad, config=None):
    _fake_mix_bwd("pre_apply_mix_bwd_acc", grad_out, x, mix)
    _fake_check("pre_apply_mix_bwd_acc", _mix_static("pre_apply_mix_bwd_acc", x, mix), grad_out, x, mix, x_grad)
    return mix.new_empty(mix.shape)


def _mhc_differentiable_once(op: str) -> str:
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
        raise RuntimeError(_mhc_differentiable_once(op))

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
    _need(x, (2,), f"{name}: x")
    _need(residual, (3,), f"{name}: residual")
    return {"mhc": int(residual.shape[1]), "hidden": int(residual.shape[2])}


def mhc_post_fwd_into(x, residual, post_layer_mix, comb_res_mix, config=None, out=None):
    """mhc_post_fwd's kernel call, into `out` (num_tokens, mhc, hidden) bfloat16 when given."""
    shape = {**_mhc_post_static("mhc_post_fwd", x, residual), "num_tokens": max(1, x.shape[0])}
    k = get("mhc_post_fwd", shape, arch=arch_of(x), config=_config(config))
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
    _fake_check(name, static, *extra, x, residual, post_layer_mix, comb_res_mix)


@mhc_post_fwd.register_fake
def _(x, residual, post_layer_mix, comb_res_mix, config=None, bwd_config=None):
    _fake_mhc_post("mhc_post_fwd", x, residual, post_layer_mix, comb_res_mix)
    return residual.new_empty(residual.shape)


def mhc_post_bwd_impl(grad_out, x, residual, post_layer_mix, comb_res_mix, config=None):
    """(grad_x, grad_residual) bf16 and (grad_post_layer_mix, grad_comb_res_mix) float32 of mhc_post_fwd
    given grad_out = dL/d out (num_tokens, mhc, hidden) bf16."""
    shape = {**_mhc_post_static("mhc_post_bwd", x, residual), "num_tokens": max(1, x.shape[0])}
    k = get("mhc_post_bwd", shape, arch=arch_of(x), config=_config(config))
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


# -- per_token_cast_e5m6 / cast_back_e5m6 ------------------------------------------------------------

_E5M6_CAST_SCHEMA = "(Tensor x, bool round_scale=False, str? config=None) -> (Tensor, Tensor)"


def _e5m6_static(name, x, round_scale) -> dict:
    _need(x, (2,), name)
    return {"hidden": int(x.shape[1]), "in_dtype": dtype_name(x.dtype), "round_scale": round_scale}


def _e5m6_cast(name, x, round_scale, config):
    shape = {**_e5m6_static(name, x, round_scale), "num_tokens": max(1, x.shape[0])}
    return get(name, shape, arch=arch_of(x), config=_config(config))(x)


def _fake_e5m6_cast(name, x, round_scale):
    """The fake words (num_tokens, hidden * 3 / 8) int32, the scale rows (num_tokens) and columns (1)."""
    static = _e5m6_static(name, x, round_scale)
    _fake_check(name, static, x)
    return x.new_empty((x.shape[0], static["hidden"] * 3 // 8), dtype=torch.int32), x.shape[0], 1


def per_token_cast_e5m6_impl(x, round_scale=False, config=None):
    """(num_tokens, hidden) bf16/f32 -> (e5m6 values as int32 words (num_tokens, hidden * 3 / 8), float32 scales
    (num_tokens, 1)): one scale per token, eight 12-bit values per three words."""
    return _e5m6_cast("per_token_cast_e5m6", x, round_scale, config)


def per_token_cast_e5m6_colmajor_impl(x, round_scale=False, config=None):
    """per_token_cast_e5m6 with the scales' TMA-aligned column-major storage (1, align(num_tokens, 4))."""
    return _e5m6_cast("per_token_cast_e5m6_colmajor", x, round_scale, config)


per_token_cast_e5m6, per_token_cast_e5m6_colmajor = _op_pair(
    per_token_cast_e5m6_impl, per_token_cast_e5m6_colmajor_impl, _E5M6_CAST_SCHEMA, _with_scales(_fake_e5m6_cast)
)


def _cast_back_e5m6_static(name, x, sf, block_tokens, block_channels, out_dtype) -> dict:
    """cast_back_e5m6's static shape: hidden is 8 / 3 of x's int32 words per row; or TensorError naming x / sf."""
    _need(x, (2,), name)
    _need(sf, (2,), name)
    if x.dtype != torch.int32 or int(x.shape[1]) % 3:
        raise TensorError(f"{name}: x must be int32 words of packed e5m6 values, three per eight values "
                          f"(num_tokens, hidden * 3 / 8); got {x.dtype} {tuple(x.shape)}")
    if sf.dtype not in (torch.float32, torch.int32):
        raise TensorError(f"{name}: sf must be float32, or int32 packed UE8M0 exponents; got {sf.dtype}")
    return {"hidden": int(x.shape[1]) // 3 * 8, "block_tokens": block_tokens, "block_channels": block_channels,
            "out_dtype": out_dtype, "sf_dtype": dtype_name(sf.dtype)}


def cast_back_e5m6_impl(x, sf, block_tokens=1, block_channels=128, out_dtype="bfloat16", config=None):
    """Packed e5m6 values as int32 words (num_tokens, hidden * 3 / 8) and float32 scales
    (ceil(num_tokens / block_tokens), ceil(hidden / block_channels)), row-major (rows at any stride)
    -> (num_tokens, hidden) bfloat16 / float32: values * scales, bit-exact."""
    return _cast_back("cast_back_e5m6", x, sf, block_tokens, block_channels, out_dtype, config,
                      _cast_back_e5m6_static)


def cast_back_e5m6_colmajor_impl(x, sf, block_tokens=1, block_channels=128, out_dtype="bfloat16", config=None):
    """cast_back_e5m6 with column-major scales given as their storage view (cast_back_colmajor's forms)."""
    return _cast_back("cast_back_e5m6_colmajor", x, sf, block_tokens, block_channels, out_dtype, config,
                      _cast_back_e5m6_static)


cast_back_e5m6, cast_back_e5m6_colmajor = _op_pair(
    cast_back_e5m6_impl, cast_back_e5m6_colmajor_impl, _CAST_BACK_SCHEMA,
    functools.partial(_fake_cast_back, static_of=_cast_back_e5m6_static),
)


# -- engram_gate ---------------------------------------------------------------------------------------
# torch.ops.tkjit.engram_gate_fwd(hidden_states, k, v, weight_fused, eps, clamp_value, config=None)
#     -> (out, dot, gate_score, rstd_x, rstd_k)
# on the flattened tokens: hidden_states, k and out (num_tokens, hc_mult, hidden_size), v (num_tokens,
# hidden_size) bfloat16 (k and v may be row-strided views), weight_fused (hc_mult, hidden_size) and the
# saved values (num_tokens, hc_mult) float32.

def _engram_gate_static(name, hidden_states, eps, clamp_value) -> dict:
    _need(hidden_states, (3,), f"{name}: hidden_states")
    return {"hc_mult": int(hidden_states.shape[1]), "hidden_size": int(hidden_states.shape[2]),
            "eps": float(eps), "clamp_value": float(clamp_value)}


def engram_gate_fwd_impl(hidden_states, k, v, weight_fused, eps, clamp_value, config=None):
    """TileKernels' engram_gate_fwd: out = x + gate * v (bf16) and dot, gate_score, rstd_x, rstd_k."""
    static = _engram_gate_static("engram_gate_fwd", hidden_states, eps, clamp_value)
    kern = get("engram_gate_fwd", {"num_tokens": max(1, hidden_states.shape[0]), **static},
               arch=arch_of(hidden_states), config=_config(config))
    return kern(hidden_states, k, v, weight_fused)


engram_gate_fwd = torch.library.custom_op(
    "tkjit::engram_gate_fwd", mutates_args=(),
    schema="(Tensor hidden_states, Tensor k, Tensor v, Tensor weight_fused, float eps, float clamp_value, "
           "str? config=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)(engram_gate_fwd_impl)


def _fake_engram_gate(name, hidden_states, k, v, weight_fused, eps, clamp_value, *extra):
    static = _engram_gate_static(name, hidden_states, eps, clamp_value)
    _fake_check(name, static, *extra, hidden_states, k, v, weight_fused)


@engram_gate_fwd.register_fake
def _(hidden_states, k, v, weight_fused, eps, clamp_value, config=None):
    _fake_engram_gate("engram_gate_fwd", hidden_states, k, v, weight_fused, eps, clamp_value)
    t, m = hidden_states.shape[:2]
    saved = [weight_fused.new_empty((t, m)) for _ in range(4)]
    return (hidden_states.new_empty(hidden_states.shape), *saved)


# -- per_channel_cast_fused --------------------------------------------------------------------------
# x (num_tokens, hidden) bf16/f32, or FP8 with its per-token scales x_sf (num_tokens, hidden / 128) float32;
# rows gathered through pos_to_token (num_tokens_out,) int32 when given. Returns TileKernels' tensors:
# values (num_tokens_out, hidden) fp8 e4m3, scales (ceil(num_tokens_out / num_per_tokens), hidden) float32.

_PCC_FUSED_SCHEMA = ("(Tensor x, Tensor? x_sf=None, Tensor? pos_to_token=None, int num_per_tokens=128, "
                     "bool round_scale=False, str? config=None) -> (Tensor, Tensor)")


def _pcc_fused_static(x, x_sf, pos_to_token, num_per_tokens, round_scale) -> dict:
    """The static shape, or ShapeError/TensorError naming the argument (before any division by it)."""
    from tkjit_kernels.quant._per_channel import TOKENS_PER_SCALE

    name = "per_channel_cast_fused"
    _need(x, (2,), name)
    if x_sf is not None:
        _need(x_sf, (2,), f"{name}: x_sf")
    if pos_to_token is not None:
        _need(pos_to_token, (1,), f"{name}: pos_to_token")
    if type(num_per_tokens) is not int or num_per_tokens not in TOKENS_PER_SCALE:
        raise ShapeError(f"{name}: num_per_tokens must be one of {list(TOKENS_PER_SCALE)}, got {num_per_tokens!r}")
    return {"hidden": int(x.shape[1]), "num_per_tokens": num_per_tokens, "in_dtype": dtype_name(x.dtype),
            "round_scale": round_scale, "has_x_sf": x_sf is not None, "has_pos": pos_to_token is not None}


def per_channel_cast_fused_impl(x, x_sf=None, pos_to_token=None, num_per_tokens=128, round_scale=False,
                                config=None):
    """per_channel_cast of x's rows gathered through pos_to_token (a position outside [0, num_tokens): a zero
    row), x bf16/f32 or FP8 e4m3 times x_sf (one float32 scale per row and 128 channels): (fp8 e4m3 values
    (num_tokens_out, hidden), float32 scales (ceil(num_tokens_out / num_per_tokens), hidden))."""
    name = "per_channel_cast_fused"
    static = _pcc_fused_static(x, x_sf, pos_to_token, num_per_tokens, round_scale)
    (n, h), npt = x.shape, num_per_tokens
    m = pos_to_token.shape[0] if pos_to_token is not None else n
    if pos_to_token is not None:
        check_indices(name, "pos_to_token", pos_to_token, n, lo=-(2**31))
    kern = get(name, {**static, "num_tokens": max(1, n), "num_tokens_out": max(1, m)}, arch=arch_of(x),
               config=_config(config))
    out = x.new_empty((m, h), dtype=torch.float8_e4m3fn)
    scales = x.new_empty(((m + npt - 1) // npt, h), dtype=torch.float32)
    if n == 0 and m:  # nothing to gather: every row is zero; one zero row of x stands in (no map entry reads it
        _fake_check(name, static, *[t for t in (x, x_sf, pos_to_token) if t is not None])  # (the given ones checked)
        x = x.new_zeros((1, h))  # as anything but zero), so the launch is not skipped as empty
        x_sf = x_sf.new_zeros((1, x_sf.shape[1])) if x_sf is not None else None
    args = [t for t in (x, x_sf, pos_to_token) if t is not None]
    kern(*args, out=(out, scales))
    return out, scales


per_channel_cast_fused = torch.library.custom_op(
    "tkjit::per_channel_cast_fused", mutates_args=(), schema=_PCC_FUSED_SCHEMA
)(per_channel_cast_fused_impl)


@per_channel_cast_fused.register_fake
def _(x, x_sf=None, pos_to_token=None, num_per_tokens=128, round_scale=False, config=None):
    name = "per_channel_cast_fused"
    static = _pcc_fused_static(x, x_sf, pos_to_token, num_per_tokens, round_scale)
    _fake_check(name, static, *[t for t in (x, x_sf) if t is not None])
    if pos_to_token is not None and pos_to_token.dtype != torch.int32:
        raise TensorError(f"{name}: input pos_to_token has dtype {pos_to_token.dtype}, expected torch.int32")
    m = pos_to_token.shape[0] if pos_to_token is not None else x.shape[0]
    out = x.new_empty((m, x.shape[1]), dtype=torch.float8_e4m3fn)
    return out, x.new_empty(((m + num_per_tokens - 1) // num_per_tokens, x.shape[1]), dtype=torch.float32)


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
    _need(input_mix, (2,), f"{name}: input_mix")
    return {"mhc_mult": int(input_mix.shape[1])}


def mhc_head_compute_mix_impl(input_mix, mhc_scale, mhc_base, mhc_pre_eps, config=None, bwd_config=None):
    """sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps, float32 (num_tokens, mhc_mult); its gradient
    runs mhc_head_compute_mix_bwd (config bwd_config)."""
    shape = {**_head_static("mhc_head_compute_mix", input_mix), "num_tokens": max(1, int(input_mix.shape[0])),
             "mhc_pre_eps": float(mhc_pre_eps)}
    return get("mhc_head_compute_mix", shape, arch=arch_of(input_mix), config=_config(config))(
        input_mix, mhc_scale, mhc_base)


mhc_head_compute_mix = torch.library.custom_op(
    "tkjit::mhc_head_compute_mix", mutates_args=(),
    schema="(Tensor input_mix, Tensor mhc_scale, Tensor mhc_base, float mhc_pre_eps, str? config=None, "
           "str? bwd_config=None) -> Tensor",
)(mhc_head_compute_mix_impl)


@mhc_head_compute_mix.register_fake
def _(input_mix, mhc_scale, mhc_base, mhc_pre_eps, config=None, bwd_config=None):
    static = {**_head_static("mhc_head_compute_mix", input_mix), "mhc_pre_eps": float(mhc_pre_eps)}
    _fake_check("mhc_head_compute_mix", static, input_mix, mhc_scale, mhc_base)
    return input_mix.new_empty(input_mix.shape)


def mhc_head_compute_mix_bwd_impl(output_mix_grad, input_mix, mhc_scale, mhc_base, config=None):
    """(input_mix_grad, mhc_scale_grad (1,), mhc_base_grad (mhc_mult,)) of mhc_head_compute_mix, float32."""
    shape = {**_head_static("mhc_head_compute_mix_bwd", input_mix), "num_tokens": max(1, int(input_mix.shape[0]))}
    k = get("mhc_head_compute_mix_bwd", shape, arch=arch_of(input_mix), config=_config(config))
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
    _fake_check("mhc_head_compute_mix_bwd", static, output_mix_grad, input_mix, mhc_scale, mhc_base)
    return (input_mix.new_empty(input_mix.shape), mhc_scale.new_empty(mhc_scale.shape),
            mhc_base.new_empty(mhc_base.shape))


def _split_static(name, input_mixes, mhc_mult) -> dict:
    _need(input_mixes, (2,), f"{name}: input_mixes")
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
    return get("mhc_pre_split_mixes", shape, arch=arch_of(input_mixes), config=_config(config))(
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
    _fake_check("mhc_pre_split_mixes", static, input_mixes, mhc_scale, mhc_base)
    n, m = input_mixes.shape[0], int(mhc_mult)
    return input_mixes.new_empty((n, m)), input_mixes.new_empty((n, m)), input_mixes.new_empty((n, m * m))


def mhc_pre_split_mixes_bwd_impl(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale,
                                 mhc_base, mhc_post_mult_value, config=None):
    """(input_mixes_grad, mhc_scale_grad (3,), mhc_base_grad (2m + m*m,)) of mhc_pre_split_mixes, float32."""
    _need(pre_layer_mix_grad, (2,), "mhc_pre_split_mixes_bwd: pre_layer_mix_grad")
    static = _split_static("mhc_pre_split_mixes_bwd", input_mixes, pre_layer_mix_grad.shape[1])
    shape = {"num_tokens": max(1, int(input_mixes.shape[0])), **static,
             "mhc_post_mult_value": float(mhc_post_mult_value)}
    k = get("mhc_pre_split_mixes_bwd", shape, arch=arch_of(input_mixes), config=_config(config))
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
    _need(pre_layer_mix_grad, (2,), f"{name}: pre_layer_mix_grad")
    static = {**_split_static(name, input_mixes, int(pre_layer_mix_grad.shape[1])),
              "mhc_post_mult_value": float(mhc_post_mult_value)}
    _fake_check(name, static, pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale,
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


# -- swiglu_forward_and_per_token_cast ----------------------------------------------------------------
# x (num_tokens, 2 * hidden) bf16/f32 -> SwiGLU (optional clamp, routing weights through pos_to_token_topk into
# topk_weights, pos_to_expert < 0 rows zero) -> (fp8 e4m3 values (num_tokens, hidden), float32 scales: row-major
# (num_tokens, hidden / group), or col_major_scales: the padded storage (hidden / group, align(num_tokens, 4))).
# clamped_count (3,) int64, when given, is added to in place. swiglu_clamp_value 0.0: no clamp.

_SWIGLU_CAST_SCHEMA = ("(Tensor x, Tensor? pos_to_token_topk=None, Tensor? topk_weights=None, "
                       "Tensor? pos_to_expert=None, Tensor(a!)? clamped_count=None, int group=128, "
                       "bool round_scale=False, bool col_major_scales=False, float swiglu_clamp_value=0.0, "
                       "float sf_clamp_min=0.0001, "
                       "str? config=None) -> (Tensor, Tensor)")


def _swiglu_cast_static(x, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count, group, round_scale,
                        swiglu_clamp_value, sf_clamp_min) -> dict:
    """The static shape, or ShapeError/TensorError naming the argument."""
    name = "swiglu_forward_and_per_token_cast"
    _need(x, (2,), name)
    if x.shape[1] % 2:
        raise TensorError(f"{name}: x must have 2 * hidden columns (gate, then up), got {x.shape[1]}")
    if (pos_to_token_topk is None) != (topk_weights is None):
        raise ShapeError(f"{name}: pos_to_token_topk and topk_weights come together")
    if pos_to_token_topk is not None:
        _need(pos_to_token_topk, (1,), f"{name}: pos_to_token_topk")
        _need(topk_weights, (1, 2), f"{name}: topk_weights")
    if pos_to_expert is not None:
        _need(pos_to_expert, (1,), f"{name}: pos_to_expert")
    if clamped_count is not None:
        _need(clamped_count, (1,), f"{name}: clamped_count")
    if type(group) is not int:
        raise ShapeError(f"{name}: group must be an int, got {group!r}")
    return {"hidden": int(x.shape[1]) // 2, "group": group, "in_dtype": dtype_name(x.dtype),
            "round_scale": bool(round_scale), "has_weights": pos_to_token_topk is not None,
            "has_expert": pos_to_expert is not None, "swiglu_clamp_value": float(swiglu_clamp_value),
            "count_clamp": clamped_count is not None, "sf_clamp_min": float(sf_clamp_min)}


def swiglu_forward_and_per_token_cast_impl(x, pos_to_token_topk=None, topk_weights=None, pos_to_expert=None,
                                           clamped_count=None, group=128, round_scale=False, col_major_scales=False,
                                           swiglu_clamp_value=0.0, sf_clamp_min=1e-4, config=None):
    """(fp8 e4m3 values (num_tokens, hidden), float32 scales: (num_tokens, hidden / group), or with
    col_major_scales their column-major storage (hidden / group, align(num_tokens, 4)))."""
    name = "swiglu_forward_and_per_token_cast" + ("_colmajor" if col_major_scales else "")
    static = _swiglu_cast_static(x, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count, group,
                                 round_scale, swiglu_clamp_value, sf_clamp_min)
    args = [x]
    nw = 1
    if pos_to_token_topk is not None:
        w = topk_weights.reshape(-1)
        nw = w.shape[0]
        if nw == 0:  # no table: every position is out of range and weighs 0 (one zero entry stands in)
            w = topk_weights.new_zeros(1)
        check_indices(name, "pos_to_token_topk", pos_to_token_topk, nw, lo=-(2**31))
        args += [pos_to_token_topk, w]
    if pos_to_expert is not None:
        args.append(pos_to_expert)
    counter = clamped_count if clamped_count is not None else x.new_empty(3, dtype=torch.int64)
    args.append(counter)
    kern = get(name, {**static, "num_tokens": max(1, x.shape[0]), "num_weights": max(1, nw)}, arch=arch_of(x),
               config=_config(config))
    _, q, sf = kern(*args)
    return q, sf


swiglu_forward_and_per_token_cast = torch.library.custom_op(
    "tkjit::swiglu_forward_and_per_token_cast", mutates_args=("clamped_count",), schema=_SWIGLU_CAST_SCHEMA
)(swiglu_forward_and_per_token_cast_impl)


@swiglu_forward_and_per_token_cast.register_fake
def _(x, pos_to_token_topk=None, topk_weights=None, pos_to_expert=None, clamped_count=None, group=128,
      round_scale=False, col_major_scales=False, swiglu_clamp_value=0.0, sf_clamp_min=1e-4, config=None):
    name = "swiglu_forward_and_per_token_cast" + ("_colmajor" if col_major_scales else "")
    static = _swiglu_cast_static(x, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count, group,
                                 round_scale, swiglu_clamp_value, sf_clamp_min)
    # the kernel's inputs as the impl passes them (the weights flattened)
    weights = [pos_to_token_topk, topk_weights.reshape(-1)] if pos_to_token_topk is not None else []
    _fake_check(name, static, x, *weights, *[t for t in (pos_to_expert, clamped_count) if t is not None])
    n, h = x.shape[0], static["hidden"]
    q = x.new_empty((n, h), dtype=torch.float8_e4m3fn)
    groups = h // group
    if col_major_scales:
        return q, x.new_empty((groups, tma_aligned(n)), dtype=torch.float32)
    return q, x.new_empty((n, groups), dtype=torch.float32)


# -- swiglu_backward_and_per_token_cast --------------------------------------------------------------
# torch.ops.tkjit.swiglu_backward_and_per_token_cast(x, x_sf, grad_out, weight, pos_to_token_topk,
#     token_topk_to_pos, num_per_channels=128, round_scale=False, swiglu_clamp_value=None, config=None)
#     -> (out, x_grad_fp8, x_grad_sf, x_grad, weight_grad)
# x (E, 2 * hidden) fp8 e4m3 with x_sf (E, 2 * hidden / num_per_channels) float32, grad_out (E, hidden) bf16,
# weight (num_tokens, num_topk) float32, pos_to_token_topk (E,) int32, token_topk_to_pos (num_tokens, num_topk)
# int32, all contiguous. Returns out (E, hidden) bf16, the gradient's FP8 values (E, 2 * hidden) and scales
# (E, 2 * hidden / num_per_channels) float32, the gradient (E, 2 * hidden) bf16 and weight_grad float32.

_SWIGLU_BWD_SCHEMA = ("(Tensor x, Tensor x_sf, Tensor grad_out, Tensor weight, Tensor pos_to_token_topk, "
                      "Tensor token_topk_to_pos, int num_per_channels=128, bool round_scale=False, "
                      "float? swiglu_clamp_value=None, str? config=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _swiglu_bwd_static(x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels,
                       round_scale, swiglu_clamp_value) -> dict:
    """The static shape, or ShapeError/TensorError naming the argument (before any division by it)."""
    from tkjit_kernels.quant.swiglu_backward_and_per_token_cast import CHANNELS

    name = "swiglu_backward_and_per_token_cast"
    for arg, t, ndim in (("x", x, 2), ("x_sf", x_sf, 2), ("grad_out", grad_out, 2), ("weight", weight, 2),
                         ("pos_to_token_topk", pos_to_token_topk, 1), ("token_topk_to_pos", token_topk_to_pos, 2)):
        _need(t, (ndim,), f"{name}: {arg}")
    if type(num_per_channels) is not int or num_per_channels not in CHANNELS:
        raise ShapeError(f"{name}: num_per_channels must be one of {list(CHANNELS)}, got {num_per_channels!r}")
    if x.shape[1] % (2 * num_per_channels):
        raise ShapeError(f"{name}: x's width ({x.shape[1]}) must be a multiple of 2 * num_per_channels "
                         f"({2 * num_per_channels})")
    return {"hidden": int(x.shape[1]) // 2, "num_per_channels": num_per_channels,
            "num_topk": int(token_topk_to_pos.shape[1]), "round_scale": bool(round_scale),
            "use_clamp": swiglu_clamp_value is not None}


def swiglu_backward_and_per_token_cast_impl(x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos,
                                            num_per_channels=128, round_scale=False, swiglu_clamp_value=None,
                                            config=None):
    """TileKernels' swiglu_backward_and_per_token_cast: (out, x_grad_fp8, x_grad_sf, x_grad, weight_grad)."""
    name = "swiglu_backward_and_per_token_cast"
    static = _swiglu_bwd_static(x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels,
                                round_scale, swiglu_clamp_value)
    e, n, k = x.shape[0], token_topk_to_pos.shape[0], static["num_topk"]
    check_indices(name, "pos_to_token_topk", pos_to_token_topk, n * k)
    check_indices(name, "token_topk_to_pos", token_topk_to_pos, e)
    kern = get(name, {**static, "num_expand_tokens": max(1, e), "num_tokens": max(1, n)}, arch=arch_of(x),
               config=_config(config))
    if e == 0 or n == 0:  # (no launch, or one on stand-ins below: the kernel's checks of the given tensors here)
        _fake_check(name, static, x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos)
    if e == 0:  # no rows: nothing to launch, and no (token, k) has a gradient
        h, g = static["hidden"], 2 * static["hidden"] // num_per_channels
        return (x.new_empty((0, h), dtype=torch.bfloat16), x.new_empty((0, 2 * h)),
                x.new_empty((0, g), dtype=torch.float32), x.new_empty((0, 2 * h), dtype=torch.bfloat16),
                weight.new_zeros(weight.shape))
    clamp = 0.0 if swiglu_clamp_value is None else float(swiglu_clamp_value)
    if n == 0:  # no weights: every row is padding; one zero weight whose map says "sent nowhere" stands in
        w0, t0 = weight.new_zeros((1, k)), token_topk_to_pos.new_full((1, k), -1)
        out, q, sf, xg, wg = kern(x, x_sf, grad_out, w0, pos_to_token_topk, t0, clamp)
        return out, q, sf, xg, wg[:0]
    return kern(x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, clamp)


swiglu_backward_and_per_token_cast = torch.library.custom_op(
    "tkjit::swiglu_backward_and_per_token_cast", mutates_args=(), schema=_SWIGLU_BWD_SCHEMA
)(swiglu_backward_and_per_token_cast_impl)


@swiglu_backward_and_per_token_cast.register_fake
def _(x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels=128, round_scale=False,
      swiglu_clamp_value=None, config=None):
    name = "swiglu_backward_and_per_token_cast"
    static = _swiglu_bwd_static(x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels,
                                round_scale, swiglu_clamp_value)
    _fake_check(name, static, x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos)
    e = x.shape[0]
    h = static["hidden"]
    return (x.new_empty((e, h), dtype=torch.bfloat16), x.new_empty((e, 2 * h)),
            x.new_empty((e, x_sf.shape[1]), dtype=torch.float32), x.new_empty((e, 2 * h), dtype=torch.bfloat16),
            weight.new_empty(weight.shape))


# -- swiglu_forward_and_per_channel_cast(_and_transpose) ---------------------------------------------
# per_channel_cast(_and_transpose) of silu(gate) * up, x = [gate | up] (num_tokens, 2 * hidden): the kernels see
# x as (token_blocks, num_per_tokens, 2 * hidden); values (num_tokens, hidden) or (hidden, num_tokens), scales
# (num_tokens / num_per_tokens, hidden), all contiguous.

_SWIGLU_CHANNEL_SCHEMA = ("(Tensor x, int num_per_tokens=128, bool round_scale=False, float? swiglu_clamp_value=None, "
                          "str? config=None) -> (Tensor, Tensor)")


def _swiglu_channel_static(name, x, num_per_tokens, round_scale, swiglu_clamp_value) -> dict:
    """per_channel_cast's static shape of the activations (hidden = x.shape[1] / 2) and the clamp, or
    ShapeError/TensorError naming the argument."""
    import math

    static = _per_channel_static(name, x, num_per_tokens, round_scale)
    width = static.pop("hidden")
    if width % 2:
        raise ShapeError(f"{name}: x.shape[1] = {width} must be even: [gate | up] halves of hidden channels each")
    static["hidden"] = width // 2
    if swiglu_clamp_value is None:
        return {**static, "use_clamp": False, "clamp_value": 0.0}
    c = float(swiglu_clamp_value)
    if not (math.isfinite(c) and c >= 0):  # (a negative clamp has no consistent meaning: min > max)
        raise ShapeError(f"{name}: swiglu_clamp_value must be finite and >= 0, got {swiglu_clamp_value!r}")
    return {**static, "use_clamp": True, "clamp_value": c}


def _swiglu_channel(name, x, num_per_tokens, round_scale, swiglu_clamp_value, config, transposed):
    static = _swiglu_channel_static(name, x, num_per_tokens, round_scale, swiglu_clamp_value)
    n, npt, h = x.shape[0], num_per_tokens, static["hidden"]
    blocks = n // npt
    out = x.new_empty((h, n) if transposed else (n, h), dtype=torch.float8_e4m3fn)
    scales = x.new_empty((blocks, h), dtype=torch.float32)
    kern = get(name, {**static, "token_blocks": max(1, blocks)}, arch=arch_of(x), config=_config(config))
    # The 2-D tensors are allocated here and the kernel writes their 3-D views: the op returns no views.
    kern(x.view(blocks, npt, 2 * h), out=(out.view((h, blocks, npt) if transposed else (blocks, npt, h)), scales))
    return out, scales


def _fake_swiglu_channel(name, transposed, x, num_per_tokens, round_scale, swiglu_clamp_value):
    static = _swiglu_channel_static(name, x, num_per_tokens, round_scale, swiglu_clamp_value)
    _fake_check(name, static)
    n, h = x.shape[0], static["hidden"]
    out = x.new_empty((h, n) if transposed else (n, h), dtype=torch.float8_e4m3fn)
    return out, x.new_empty((n // num_per_tokens, h), dtype=torch.float32)


def swiglu_forward_and_per_channel_cast_and_transpose_impl(x, num_per_tokens=128, round_scale=False,
                                                           swiglu_clamp_value=None, config=None):
    """x = [gate | up] (num_tokens, 2 * hidden) bf16/f32 -> per_channel_cast_and_transpose of silu(gate) * up:
    (fp8 e4m3 (hidden, num_tokens), float32 scales (num_tokens / num_per_tokens, hidden))."""
    return _swiglu_channel("swiglu_forward_and_per_channel_cast_and_transpose", x, num_per_tokens, round_scale,
                           swiglu_clamp_value, config, True)


def swiglu_forward_and_per_channel_cast_impl(x, num_per_tokens=128, round_scale=False, swiglu_clamp_value=None,
                                             config=None):
    """The same without the transpose: (fp8 e4m3 (num_tokens, hidden), float32 scales)."""
    return _swiglu_channel("swiglu_forward_and_per_channel_cast", x, num_per_tokens, round_scale,
                           swiglu_clamp_value, config, False)


swiglu_forward_and_per_channel_cast, swiglu_forward_and_per_channel_cast_and_transpose = _op_pair(
    swiglu_forward_and_per_channel_cast_impl, swiglu_forward_and_per_channel_cast_and_transpose_impl,
    _SWIGLU_CHANNEL_SCHEMA, _fake_swiglu_channel,
)


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
    _need(hidden_states, (3,), f"{name}: hidden_states")
    return {"hc_mult": int(hidden_states.shape[1]), "hidden_size": int(hidden_states.shape[2]),
            "clamp_value": float(clamp_value), "num_partials": int(num_partials)}


def engram_gate_bwd_impl(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value,
                         num_partials=ENGRAM_PARTIALS, config=None):
    """TileKernels' engram_gate_bwd: (grad_x, grad_k, grad_v) bf16 and grad_w_partial (num_partials, hc_mult,
    hidden_size) float32, from grad_out = dL/d out and the forward's inputs and saved values."""
    static = _engram_bwd_static("engram_gate_bwd", hidden_states, clamp_value, num_partials)
    kern = get("engram_gate_bwd", {"num_tokens": max(1, hidden_states.shape[0]), **static},
               arch=arch_of(hidden_states), config=_config(config))
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
    _fake_check(name, static, grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k)
    t, m, h = hidden_states.shape
    return (hidden_states.new_empty((t, m, h)), hidden_states.new_empty((t, m, h)), hidden_states.new_empty((t, h)),
            weight_fused.new_empty((static["num_partials"], m, h)))


def _grad_w_static(name, grad_w_partial) -> dict:
    _need(grad_w_partial, (3,), f"{name}: grad_w_partial")
    p, m, h = (int(n) for n in grad_w_partial.shape)
    return {"hc_mult": m, "hidden_size": h, "num_partials": p}


def grad_w_reduce_impl(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed,
                       config=None):
    """TileKernels' grad_w_reduce: g = the partials summed over axis 0 (float32, in order), then in place
    grad_weight_hidden += g * weight_embed and grad_weight_embed += g * weight_hidden."""
    static = _grad_w_static("grad_w_reduce", grad_w_partial)
    kern = get("grad_w_reduce", static, arch=arch_of(grad_w_partial), config=_config(config))
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
    _fake_check(name, static, grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)


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
    _need(x, (2,), f"{name}: x")
    _need(fn, (2,), f"{name}: fn")
    _need_dtype(fn, torch.float32, f"{name}: input fn")  # (tf32_round reads its bits as float32's)
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
    k = get("mhc_pre_norm_fn_split", {**static, "num_tokens": int(x.shape[0]), "k_splits": k_splits},
            arch=arch_of(x))
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
    k = get("mhc_pre_norm_fn", shape, arch=arch_of(x), config=_config(config))
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
    _fake_check("mhc_pre_norm_fn", static, x, fn)
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
        _need(t, (len(shape),), f"{name}: {what}")
        if what != "out_grad":  # (out_grad is taken as float32 whatever it is)
            _need_dtype(t, torch.float32, f"{name}: {what}")
        for got, want in zip(t.shape, shape):
            _check(got == want, lambda what=what, t=t, shape=shape:
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
    k = get("mhc_pre_norm_fn_bwd", shape, arch=arch_of(x), config=_config(config))
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
    _fake_check(name, static, out_mul, sqrsum, x, fn)  # (out_mul and sqrsum as the kernel's mul_grad, sqrsum_grad)
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


# -- per_token_cast_e2m1 ------------------------------------------------------------------------------

def _fake_e2m1_cast(name, x, group, round_scale):
    """The fake values (num_tokens, hidden / 2) int8, the scale rows (num_tokens) and groups ceil(hidden / group)."""
    _need(x, (2,), name)
    hidden = int(x.shape[1])
    _fake_check(name, {"hidden": hidden, "group": group, "in_dtype": dtype_name(x.dtype),
                       "round_scale": round_scale}, x)
    return x.new_empty((x.shape[0], hidden // 2), dtype=torch.int8), x.shape[0], -(-hidden // group)


def per_token_cast_e2m1_impl(x, group=128, round_scale=False, config=None):
    """(num_tokens, hidden) bf16/f32 -> (FP4 e2m1 values, two per byte, int8 (num_tokens, hidden / 2), float32
    scales (num_tokens, ceil(hidden / group)))."""
    return _cast("per_token_cast_e2m1", x, group, round_scale, config)


def per_token_cast_e2m1_colmajor_impl(x, group=128, round_scale=False, config=None):
    """per_token_cast_e2m1 with the scales' TMA-aligned column-major storage (ceil(hidden / group),
    align(num_tokens, 4))."""
    return _cast("per_token_cast_e2m1_colmajor", x, group, round_scale, config)


per_token_cast_e2m1, per_token_cast_e2m1_colmajor = _op_pair(
    per_token_cast_e2m1_impl, per_token_cast_e2m1_colmajor_impl, _CAST_SCHEMA, _with_scales(_fake_e2m1_cast)
)


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
        _need(t, (ndim,), f"{name}: {what}")
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
    kern = get("mhc_multilayer_recompute", {"num_tokens": max(1, n), **static}, arch=arch_of(initial_residual),
               config=_config(config))
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
        _fake_check(name, static, initial_residual, pre_mix, layer_output, post_mix, comb_mix)
    else:
        _fake_check("pre_apply_mix", {"mhc_mult": static["mhc_mult"], "hidden": static["hidden"]}, initial_residual,
                    pre_mix[0])
    n, m, h = initial_residual.shape
    return (initial_residual.new_empty((static["num_layers"], n, h)),
            initial_residual.new_empty((static["num_post"], n, m, h)))


# -- per_block_cast_lossless -------------------------------------------------------------------------

_LOSSLESS_SCHEMA = ("(Tensor x, Tensor sf, int in_block_m=1, int in_block_k=32, int out_block_m=128, "
                    "int out_block_k=128, str? config=None) -> (Tensor, Tensor)")


def _lossless_static(name, x, sf, in_block_m, in_block_k, out_block_m, out_block_k) -> dict:
    """per_block_cast_lossless's static params: hidden is the logical width (twice x's), or TensorError."""
    _need(x, (2,), name)
    _need(sf, (2,), name)
    if x.dtype != torch.int8:
        raise TensorError(f"{name}: x must be int8 holding two FP4 e2m1 codes per byte, got {x.dtype}")
    if sf.dtype != torch.float32:
        raise TensorError(f"{name}: sf must be float32 (row-major power-of-two scales), got {sf.dtype}")
    return {"hidden": int(x.shape[1]) * 2, "in_block_m": in_block_m, "in_block_k": in_block_k,
            "out_block_m": out_block_m, "out_block_k": out_block_k}


def _lossless(name, x, sf, in_block_m, in_block_k, out_block_m, out_block_k, config):
    """The kernel, then its lossy flag read back (a device sync): a TensorError naming the first failing block.
    Not checked while a CUDA graph is being captured (no sync is possible there)."""
    static = _lossless_static(name, x, sf, in_block_m, in_block_k, out_block_m, out_block_k)
    kern = get(name, {"num_tokens": max(1, x.shape[0]), **static}, arch=arch_of(x), config=_config(config))
    q, scales, lossy = kern(x, sf)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if x.shape[0] and not capturing and int(lossy.item()):
        from tkjit_kernels.quant.per_block_cast_lossless import problem

        why = problem(static, sf) or "the kernel flagged a block the host check does not find (report this)"
        raise TensorError(f"{name}: the e2m1 -> e4m3 cast would lose values: {why}")
    return q, scales


def _fake_lossless(name, x, sf, in_block_m, in_block_k, out_block_m, out_block_k):
    """(fake values, scale rows ceil(num_tokens / out_block_m), scale columns ceil(hidden / out_block_k))."""
    static = _lossless_static(name, x, sf, in_block_m, in_block_k, out_block_m, out_block_k)
    _fake_check(name, static, x, sf)
    _check_block_rows(name, sf, x.shape[0], in_block_m)
    return (x.new_empty((x.shape[0], static["hidden"]), dtype=torch.float8_e4m3fn),
            (x.shape[0] + out_block_m - 1) // out_block_m, -(-static["hidden"] // out_block_k))


def per_block_cast_lossless_impl(x, sf, in_block_m=1, in_block_k=32, out_block_m=128, out_block_k=128, config=None):
    """FP4 e2m1 x (int8 (num_tokens, hidden / 2)) with power-of-two float32 scales sf (ceil(num_tokens /
    in_block_m), ceil(hidden / in_block_k)), row-major at any row stride -> (fp8 e4m3 values (num_tokens, hidden),
    float32 scales (ceil(num_tokens / out_block_m), ceil(hidden / out_block_k))), exact; TensorError if not."""
    return _lossless("per_block_cast_lossless", x, sf, in_block_m, in_block_k, out_block_m, out_block_k, config)


def per_block_cast_lossless_colmajor_impl(x, sf, in_block_m=1, in_block_k=32, out_block_m=128, out_block_k=128,
                                          config=None):
    """per_block_cast_lossless with the scales' TMA-aligned column-major storage (ceil(hidden / out_block_k),
    align(ceil(num_tokens / out_block_m), 4))."""
    return _lossless("per_block_cast_lossless_colmajor", x, sf, in_block_m, in_block_k, out_block_m, out_block_k,
                     config)


per_block_cast_lossless, per_block_cast_lossless_colmajor = _op_pair(
    per_block_cast_lossless_impl, per_block_cast_lossless_colmajor_impl, _LOSSLESS_SCHEMA, _with_scales(_fake_lossless)
)


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
    _need(residual, (3,), f"{name}: residual")
    _need_contiguous(residual, f"{name}: residual")  # (the GEMM reads it as a (num_tokens, mhc_mult * hidden) view)
    _need(fn, (2,), f"{name}: fn")
    _need_dtype(fn, torch.float32, f"{name}: input fn")  # (tf32_round reads its bits as float32's)
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
    gemm = get("mhc_pre_norm_fn", gemm_shape, arch=arch_of(residual), config=_config(gemm_config))
    fuse = get(name, shape, arch=arch_of(residual), config=_config(config))
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
    _fake_check("mhc_pre_norm_fn", {"mhc_mult3": 2 * m + m * m, "mhc_hidden": m * h, "norm_eps": float(rms_eps)},
                residual.view(residual.shape[0], m * h), fn)
    # (the GEMM's out_mul and sqrsum, the fused kernel's first inputs, stand in as empties of their shapes)
    _fake_check(name, _big_fuse_shape(static, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value,
                                      sinkhorn_repeat), fn.new_empty((residual.shape[0], 2 * m + m * m)),
                fn.new_empty((residual.shape[0],)), mhc_scale, mhc_base, residual)
    return _big_fuse_empty(residual, m, h)


def _big_fuse_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


def _big_fuse_backward(ctx, *grads):
    raise NotImplementedError("mhc_pre_big_fuse is inference-only (TileKernels' big_fuse has no backward): "
                              "use mhc_pre_norm_fn, mhc_pre_split_mixes, sinkhorn and mhc_pre_apply_mix for gradients")


mhc_pre_big_fuse.register_autograd(_big_fuse_backward, setup_context=_big_fuse_setup_context)


LEAN_OPS: set[str] = set()  # the ops whose autograd kernel is the lean one (_lean_dispatch; tools/hostcost.py)
LEAN_SKIPPED: dict[str, str] = {}  # why this torch kept its own kernels: each reason -> the first op it hit


def _override(op, key: str, fn, with_keyset: bool = True) -> RuntimeError | None:
    """Register fn as op's kernel for dispatch key `key` in place of custom_op's; where this torch refuses the
    override, its own kernel stays (the refusal is returned)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch warns that a kernel is overridden)
        try:
            try:
                op._lib.impl(op._name, fn, key, with_keyset=with_keyset, allow_override=True)
            except TypeError:  # a torch before `allow_override` (2.11): its Python-side check refuses a second
                # kernel for a key custom_op registered; the dispatcher itself takes it (as allow_override does)
                getattr(torch.library, "_impls", set()).discard(f"{op._lib.ns}/{op._name}/{key}")
                op._lib.impl(op._name, fn, key, with_keyset=with_keyset)
        except RuntimeError as e:
            return e
    return None


def _skipped(op, e: BaseException) -> None:
    LEAN_SKIPPED.setdefault(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", op._name)


def _redispatcher(overload) -> Callable:
    """overload.redispatch without its Python frame where this torch's handle has it (redispatch_boxed)."""
    return getattr(getattr(overload, "_handle", None), "redispatch_boxed", None) or overload.redispatch


def _version_bump(op) -> None:
    """The version bump of an op that mutates an argument, so a call that leaves out a mutable argument with a
    default (`Tensor(a!)? x=None`: top2_sum_gate, swiglu_forward_and_per_token_cast) works. torch before 2.12
    indexed the dispatcher's args for it, and the dispatcher drops arguments left at their default: IndexError
    (pytorch#176078). As torch's later fix does, a mutated argument that is given gets its version bumped, one
    left out is skipped."""
    from torch._library import utils

    try:
        overload = op._opoverload
        schema = overload._schema
        if not schema.is_mutable or schema._is_view_op():
            return
        idxs, keys = utils.mutated_args_kwargs(schema)
        redispatch, after = _redispatcher(overload), torch._C._after_ADInplaceOrView_keyset
        bump = torch.autograd.graph.increment_version
    except AttributeError:
        return

    def version_bump(keyset, *args, **kwargs):
        for i in idxs:
            if i < len(args) and args[i] is not None:
                bump(args[i])
        for k in keys:
            if kwargs.get(k) is not None:
                bump(kwargs[k])
        return redispatch(keyset & after, *args, **kwargs)

    _override(op, "ADInplaceOrView", version_bump)


def _lean_dispatch(op) -> None:
    """Spare a dispatcher call the Python layers `custom_op` puts around an op's implementation when they have
    nothing to do (about half of the ~8 us they add; `tools/hostcost.py`). Autograd: without a tensor that needs a
    gradient, straight below autograd (with one, torch's own autograd kernel: the registered backward, or the
    error of an op that has none); the implementation: the function itself, not torch's wrapper of it (that
    wrapper checks in-place and out= returns, which these ops do not declare, and the aliasing of outputs,
    which their tests check). Where this torch names things otherwise, its own kernels stay."""
    from torch import _C

    try:
        from torch._library.autograd import make_autograd_impl
    except ImportError as e:
        return _skipped(op, e)
    try:
        overload, fns, impl = op._opoverload, op._backend_fns, op._init_fn
        redispatch = _redispatcher(overload)
        below, needs_grad, grad_on = _C._after_autograd_keyset, _C._any_requires_grad, _C.is_grad_enabled
        below_autograd = _C._AutoDispatchBelowAutograd
        needs_grad(torch.empty(0), None)  # (positionally: a torch whose check takes no keywords takes these)
    except (AttributeError, TypeError) as e:
        return _skipped(op, e)
    with_grad = []  # torch's autograd kernel, made at the first call that needs it (~0.3 ms an op)

    def autograd(keyset, *args, **kwargs):
        if grad_on() and needs_grad(*args, *kwargs.values()):
            if not with_grad:
                with_grad.append(make_autograd_impl(overload, op))
            return with_grad[0](keyset, *args, **kwargs)
        with below_autograd():
            return redispatch(keyset & below, *args, **kwargs)

    refused = _override(op, "Autograd", autograd)
    if refused is None:
        LEAN_OPS.add(op._name)
    else:
        _skipped(op, refused)
    if list(fns) == [None] and impl is not None and not overload._schema.is_mutable:
        _override(op, "CompositeExplicitAutograd", impl, with_keyset=False)


OPS = [v for v in list(globals().values()) if isinstance(v, torch._library.custom_ops.CustomOpDef)]  # every op
for _op in OPS:
    _version_bump(_op)
    _lean_dispatch(_op)
del _op
