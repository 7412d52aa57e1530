"""torch.ops.tkjit ops of the quant family: FP8 / FP4 / e5m6 casts (per token, per block, per channel) and
their cast-backs, and the SwiGLU casts."""

import functools
import inspect

import torch

from tkjit.errors import ShapeError, TensorError
from tkjit.kernel import dtype_name, torch_dtype
from tkjit.scales import tma_aligned
from tkjit.torch_ops.checks import check, check_block_rows, check_indices, fake_check, need, need_contiguous
from tkjit.torch_ops.serve import kernel_of


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


# -- per_token_cast --------------------------------------------------------------------------------

_CAST_SCHEMA = "(Tensor x, int group=128, bool round_scale=False, str? config=None) -> (Tensor, Tensor)"


def _cast(name, x, group, round_scale, config):
    need(x, (2,), name)
    shape = {"num_tokens": max(1, x.shape[0]), "hidden": x.shape[1], "group": group,
             "in_dtype": dtype_name(x.dtype), "round_scale": round_scale}
    return kernel_of(name, shape, x, config)(x)


def _fake_cast(name, x, group, round_scale):
    need(x, (2,), name)
    hidden = int(x.shape[1])
    fake_check(name, {"hidden": hidden, "group": group, "in_dtype": dtype_name(x.dtype),
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


# -- cast_back ---------------------------------------------------------------------------------------

_CAST_BACK_SCHEMA = ("(Tensor x, Tensor sf, int block_tokens=1, int block_channels=128, str out_dtype='bfloat16', "
                     "str? config=None) -> Tensor")
_CAST_BACK_FMT = {torch.float8_e4m3fn: "e4m3", torch.int8: "e2m1"}  # int8: two FP4 e2m1 codes per byte


def _cast_back_static(name, x, sf, block_tokens, block_channels, out_dtype) -> dict:
    """The static shape: hidden is the logical width (twice x's for packed e2m1), or TensorError naming x / sf."""
    need(x, (2,), name)
    need(sf, (2,), name)
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
    check(rows == want, lambda: f"{name}: sf has {rows} token rows, expected ceil(num_tokens / block_tokens) = "
                                 f"ceil({n} / {block_tokens}) = {want} (sf shape {tuple(sf.shape)})")


def _cast_back(name, x, sf, block_tokens, block_channels, out_dtype, config, static_of=None):
    """One dequantising call of `name` (cast_back[_e5m6][_colmajor]): the scales' token rows checked, the kernel
    got for the shape. static_of: the static params read off the arguments (the e4m3 / e2m1 form's default)."""
    static = (static_of or _cast_back_static)(name, x, sf, block_tokens, block_channels, out_dtype)
    _check_sf_rows(name, x, sf, block_tokens)
    n, rows = x.shape[0], sf.shape[1 if name.endswith("_colmajor") else 0]
    shape = {"num_tokens": max(1, n), "num_sf_rows": max(1, rows), **static}
    return kernel_of(name, shape, x, config)(x, sf)


def _fake_cast_back(name, col_major, x, sf, block_tokens, block_channels, out_dtype, static_of=None):
    static = (static_of or _cast_back_static)(name, x, sf, block_tokens, block_channels, out_dtype)
    _check_sf_rows(name, x, sf, block_tokens)
    fake_check(name, static, x, sf)
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
    need(x, (2,), name)
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
    return kernel_of(name, shape, x, config)(x)


def _fake_block_cast(name, x, block_m, block_k, round_scale, fmt):
    """(fake values, scale rows ceil(num_tokens / block_m), scale columns ceil(hidden / block_k))."""
    fake_check(name, _block_static(name, x, block_m, block_k, fmt, round_scale), x)
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
    return kernel_of("per_block_cast_with_sf", shape, x, config)(x, sf)


per_block_cast_with_sf = torch.library.custom_op(
    "tkjit::per_block_cast_with_sf", mutates_args=(),
    schema="(Tensor x, Tensor sf, int block_m=128, int block_k=128, str fmt='e4m3', str? config=None) -> Tensor",
)(per_block_cast_with_sf_impl)


@per_block_cast_with_sf.register_fake
def _(x, sf, block_m=128, block_k=128, fmt="e4m3", config=None):
    name = "per_block_cast_with_sf"
    fake_check(name, _block_static(name, x, block_m, block_k, fmt), x, sf)
    check_block_rows(name, sf, x.shape[0], block_m)
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

    need(x, (2,), name)
    if type(num_per_tokens) is not int or num_per_tokens not in TOKENS_PER_SCALE:
        raise ShapeError(f"{name}: num_per_tokens must be one of {list(TOKENS_PER_SCALE)}, got {num_per_tokens!r}")
    need_contiguous(x, f"{name}: x")  # (the kernel's 3-D view of x needs whole rows, back to back)
    n = x.shape[0]
    check(n % num_per_tokens == 0, lambda: f"{name}: num_tokens (x.shape[0] = {n}) must be a multiple of "
           f"num_per_tokens ({num_per_tokens}): a scale covers whole blocks of num_per_tokens tokens", ShapeError)
    return {"hidden": int(x.shape[1]), "num_per_tokens": num_per_tokens, "in_dtype": dtype_name(x.dtype),
            "round_scale": round_scale}


def _per_channel(name, x, num_per_tokens, round_scale, config, transposed):
    static = _per_channel_static(name, x, num_per_tokens, round_scale)
    (n, h), npt = x.shape, num_per_tokens
    blocks = n // npt
    kern = kernel_of(name, {**static, "token_blocks": max(1, blocks)}, x, config)
    out = x.new_empty((h, n) if transposed else (n, h), dtype=torch.float8_e4m3fn)
    scales = x.new_empty((blocks, h), dtype=torch.float32)
    # The 2-D tensors are allocated here and the kernel writes their 3-D views: the op returns no views.
    kern(x.view(blocks, npt, h), out=(out.view((h, blocks, npt) if transposed else (blocks, npt, h)), scales))
    return out, scales


def _fake_per_channel(name, transposed, x, num_per_tokens, round_scale):
    static = _per_channel_static(name, x, num_per_tokens, round_scale)
    fake_check(name, static)
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


# -- per_token_cast_e5m6 / cast_back_e5m6 ------------------------------------------------------------

_E5M6_CAST_SCHEMA = "(Tensor x, bool round_scale=False, str? config=None) -> (Tensor, Tensor)"


def _e5m6_static(name, x, round_scale) -> dict:
    need(x, (2,), name)
    return {"hidden": int(x.shape[1]), "in_dtype": dtype_name(x.dtype), "round_scale": round_scale}


def _e5m6_cast(name, x, round_scale, config):
    shape = {**_e5m6_static(name, x, round_scale), "num_tokens": max(1, x.shape[0])}
    return kernel_of(name, shape, x, config)(x)


def _fake_e5m6_cast(name, x, round_scale):
    """The fake words (num_tokens, hidden * 3 / 8) int32, the scale rows (num_tokens) and columns (1)."""
    static = _e5m6_static(name, x, round_scale)
    fake_check(name, static, x)
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
    need(x, (2,), name)
    need(sf, (2,), name)
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
    need(x, (2,), name)
    if x_sf is not None:
        need(x_sf, (2,), f"{name}: x_sf")
    if pos_to_token is not None:
        need(pos_to_token, (1,), f"{name}: pos_to_token")
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
    kern = kernel_of(name, {**static, "num_tokens": max(1, n), "num_tokens_out": max(1, m)}, x, config)
    out = x.new_empty((m, h), dtype=torch.float8_e4m3fn)
    scales = x.new_empty(((m + npt - 1) // npt, h), dtype=torch.float32)
    if n == 0 and m:  # nothing to gather: every row is zero; one zero row of x stands in (no map entry reads it
        fake_check(name, static, *[t for t in (x, x_sf, pos_to_token) if t is not None])  # (the given ones checked)
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
    fake_check(name, static, *[t for t in (x, x_sf) if t is not None])
    if pos_to_token is not None and pos_to_token.dtype != torch.int32:
        raise TensorError(f"{name}: input pos_to_token has dtype {pos_to_token.dtype}, expected torch.int32")
    m = pos_to_token.shape[0] if pos_to_token is not None else x.shape[0]
    out = x.new_empty((m, x.shape[1]), dtype=torch.float8_e4m3fn)
    return out, x.new_empty(((m + num_per_tokens - 1) // num_per_tokens, x.shape[1]), dtype=torch.float32)


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
    need(x, (2,), name)
    if x.shape[1] % 2:
        raise TensorError(f"{name}: x must have 2 * hidden columns (gate, then up), got {x.shape[1]}")
    if (pos_to_token_topk is None) != (topk_weights is None):
        raise ShapeError(f"{name}: pos_to_token_topk and topk_weights come together")
    if pos_to_token_topk is not None:
        need(pos_to_token_topk, (1,), f"{name}: pos_to_token_topk")
        need(topk_weights, (1, 2), f"{name}: topk_weights")
    if pos_to_expert is not None:
        need(pos_to_expert, (1,), f"{name}: pos_to_expert")
    if clamped_count is not None:
        need(clamped_count, (1,), f"{name}: clamped_count")
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
    kern = kernel_of(name, {**static, "num_tokens": max(1, x.shape[0]), "num_weights": max(1, nw)}, x, config)
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
    fake_check(name, static, x, *weights, *[t for t in (pos_to_expert, clamped_count) if t is not None])
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
        need(t, (ndim,), f"{name}: {arg}")
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
    kern = kernel_of(name, {**static, "num_expand_tokens": max(1, e), "num_tokens": max(1, n)}, x, config)
    if e == 0 or n == 0:  # (no launch, or one on stand-ins below: the kernel's checks of the given tensors here)
        fake_check(name, static, x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos)
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
    fake_check(name, static, x, x_sf, grad_out, weight, pos_to_token_topk, token_topk_to_pos)
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
    kern = kernel_of(name, {**static, "token_blocks": max(1, blocks)}, x, config)
    # The 2-D tensors are allocated here and the kernel writes their 3-D views: the op returns no views.
    kern(x.view(blocks, npt, 2 * h), out=(out.view((h, blocks, npt) if transposed else (blocks, npt, h)), scales))
    return out, scales


def _fake_swiglu_channel(name, transposed, x, num_per_tokens, round_scale, swiglu_clamp_value):
    static = _swiglu_channel_static(name, x, num_per_tokens, round_scale, swiglu_clamp_value)
    fake_check(name, static)
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


# -- per_token_cast_e2m1 ------------------------------------------------------------------------------

def _fake_e2m1_cast(name, x, group, round_scale):
    """The fake values (num_tokens, hidden / 2) int8, the scale rows (num_tokens) and groups ceil(hidden / group)."""
    need(x, (2,), name)
    hidden = int(x.shape[1])
    fake_check(name, {"hidden": hidden, "group": group, "in_dtype": dtype_name(x.dtype),
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


# -- per_block_cast_lossless -------------------------------------------------------------------------

_LOSSLESS_SCHEMA = ("(Tensor x, Tensor sf, int in_block_m=1, int in_block_k=32, int out_block_m=128, "
                    "int out_block_k=128, str? config=None) -> (Tensor, Tensor)")


def _lossless_static(name, x, sf, in_block_m, in_block_k, out_block_m, out_block_k) -> dict:
    """per_block_cast_lossless's static params: hidden is the logical width (twice x's), or TensorError."""
    need(x, (2,), name)
    need(sf, (2,), name)
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
    kern = kernel_of(name, {"num_tokens": max(1, x.shape[0]), **static}, x, config)
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
    fake_check(name, static, x, sf)
    check_block_rows(name, sf, x.shape[0], in_block_m)
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
