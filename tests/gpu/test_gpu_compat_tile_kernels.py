"""tkjit.compat.tile_kernels against the real TileKernels on the GPU, with TileKernels' own parametrisations.

For every served op, tkjit's output is compared with TileKernels' through TileKernels' own
`testing.numeric.assert_equal` (dtype, shape, strides where non-empty, device, every byte) wherever the
two compute the same thing bit for bit:
  moe.topk_gate               bit for bit (both: stable descending order, ties to the smaller index)
  transpose / batched_transpose  bit for bit (a copy)
  quant.per_token_cast[_with_sf_only], e4m3, round_sf=True (the combination TileKernels tests)
                              bit for bit, row-major and column-major scales
  quant.per_token_cast, round_sf=False
                              bit for bit against TileKernels' torch reference `tile_kernels.torch.cast`;
                              against its kernel: same dtype, shape and strides, scales within 2 ulp and
                              < 0.1% of FP8 codes one step apart (its kernel forms amax / 448 and 448 / amax
                              another way than its reference, which tkjit follows)
  quant.per_token_cast, fmt='e2m1', packed UE8M0 scales, pre-quantised (values, scales) inputs,
  quant.per_token_cast_with_precomputed_sf
                              bit for bit against TileKernels' torch reference; against its kernel wherever
                              its kernel agrees with its reference
  modeling.mhc.ops.sinkhorn_normalize
                              forward and gradient within rtol 1e-5 (another order of float operations)
TileKernels' parameter lists: num_tokens 4001, 8001 and 0 (its TK_FULL_TEST list; aligned to 64 where it
needs it), hidden 576..7168, expert counts 16..512 and the non-powers of two 36, 72, 96, 108, 144 (and 160,
288 beside them: tkjit takes any count from 1 to 1024).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.compat.tile_kernels as compat
from tkjit.arch import arch_of
from tkjit.pool import compile_many
from tkjit.tuning_db import choose_config

sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from quant_checks import tk_kernel_or_none as _tk_kernel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]

tile_kernels = pytest.importorskip("tile_kernels")  # skips the module where TileKernels is not installed
pytest.importorskip("tile_kernels.modeling.mhc.ops")
from tile_kernels.testing.numeric import assert_equal  # noqa: E402

NUM_TOKENS = (4001, 8001, 0)
HIDDEN = (576, 2048, 2560, 3072, 4096, 6144, 7168)
EXPERTS = (16, 32, 36, 64, 72, 96, 108, 128, 144, 160, 256, 288, 384, 512)
TOPK = (1, 2, 6, 7, 8, 9)


def _align(n, a):
    return -(-n // a) * a


def _served(kernel: str, shape: dict) -> bool:
    """Whether tkjit's spec takes the shape now (the compat layer raises NotImplementedError otherwise)."""
    spec = tkjit.get_spec(kernel)
    try:
        spec.canonical_shape({**{p.name: 1 for p in spec.runtime_params}, **shape})
        return True
    except tkjit.ShapeError:
        return False


def _gpu_arch() -> str:
    return arch_of(torch.empty(0, device="cuda"))


def _precompile(kernel: str, shapes: list[dict]) -> None:
    """Compile, in parallel, the variants the calls below will ask for (one tkjit.get at a time would
    compile them serially)."""
    spec = tkjit.get_spec(kernel)
    arch = _gpu_arch()
    jobs, seen = [], set()
    for shape in shapes:
        if not _served(kernel, {k: v for k, v in shape.items() if k != "num_tokens"}):
            continue
        full = spec.canonical_shape(shape)
        cfg, source = choose_config(spec, full, arch, None)
        key = (repr(sorted(spec.static_shape(full).items())), repr(sorted(cfg.items())))
        if key not in seen:
            seen.add(key)
            jobs.append((kernel, spec.static_shape(full), cfg, arch, source))
    errors = [e for _, e in compile_many(jobs) if e]
    assert not errors, errors[:3]


# -- API ---------------------------------------------------------------------------------------------------

def _public_functions(module):
    return {n: f for n, f in vars(module).items() if not n.startswith("_") and inspect.isfunction(f)}


@pytest.mark.parametrize("module", ["config", "engram", "modeling.mhc", "modeling.mhc.ops", "moe", "quant",
                                    "transpose"])
def test_signatures_match_the_installed_tile_kernels(module):
    import importlib

    theirs = importlib.import_module(f"tile_kernels.{module}")
    ours = importlib.import_module(f"tkjit.compat.tile_kernels.{module}")
    names = getattr(ours, "__all__", None) or list(_public_functions(ours))
    for name in names:
        t = getattr(theirs, name)
        o = getattr(ours, name)
        if inspect.ismodule(t):
            continue
        t_params = list(inspect.signature(t).parameters.values())
        o_params = list(inspect.signature(o).parameters.values())
        assert [(p.name, p.kind, p.default) for p in o_params] == [(p.name, p.kind, p.default) for p in t_params], name


def test_num_sms_matches(monkeypatch):
    monkeypatch.setattr(compat.config, "_num_sms", 0)
    assert compat.get_device_num_sms() == tile_kernels.get_device_num_sms()
    assert compat.config.get_max_smem_per_sm() == tile_kernels.config.get_max_smem_per_sm()
    n = tile_kernels.get_device_num_sms()
    try:
        for value in (n - 20, n):
            compat.set_num_sms(value)
            tile_kernels.set_num_sms(value)
            assert compat.get_num_sms() == tile_kernels.get_num_sms() == value
    finally:
        tile_kernels.set_num_sms(n)
    with pytest.raises(tkjit.ShapeError, match="exceeds"):
        compat.set_num_sms(n + 1)


# -- moe.topk_gate -----------------------------------------------------------------------------------------

TOPK_CASES = [(t, e, k) for t in NUM_TOKENS for e in EXPERTS for k in TOPK if k <= e]


@pytest.fixture(scope="module")
def topk_compiled(shared_cache):
    _precompile("topk_gate", [{"num_tokens": max(1, t), "num_experts": e, "k": k} for t, e, k in TOPK_CASES])


@pytest.mark.parametrize("num_tokens, num_experts, num_topk", TOPK_CASES)
def test_topk_gate_is_bit_exact(topk_compiled, num_tokens, num_experts, num_topk):
    g = torch.Generator(device="cuda").manual_seed(num_tokens + num_experts * 16 + num_topk)
    for rounded in (False, True):  # rounded: ties everywhere (and signed zeros), the smaller index wins
        scores = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
        if rounded:
            scores = scores.round(decimals=1)
        assert_equal(compat.moe.topk_gate(scores, num_topk), tile_kernels.moe.topk_gate(scores, num_topk))


# -- transpose -----------------------------------------------------------------------------------------------

TRANSPOSE_DTYPES = (torch.bfloat16, torch.float32, torch.float8_e4m3fn)
TRANSPOSE_CASES = [(_align(t, 64), h, d) for t in NUM_TOKENS for h in HIDDEN for d in TRANSPOSE_DTYPES]


def _bits(shape, dtype, seed):
    if 0 in shape:  # (a dtype view of an empty byte tensor can fail on its strides)
        return torch.empty(shape, dtype=dtype, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    nbytes = torch.empty(0, dtype=dtype).element_size()
    ints = torch.randint(0, 256, (*shape[:-1], shape[-1] * nbytes), device="cuda", dtype=torch.uint8, generator=g)
    x = ints.view(dtype)
    return torch.nan_to_num(x) if dtype.is_floating_point and nbytes > 1 else x


@pytest.fixture(scope="module")
def transpose_compiled(shared_cache):
    from tkjit.kernel import dtype_name

    shapes = [{"rows": max(1, t), "cols": h, "dtype": dtype_name(d)} for t, h, d in TRANSPOSE_CASES]
    _precompile("transpose", shapes)
    _precompile("batched_transpose", [{**s, "batch": 3} for s in shapes])


def _transposed(fn, x):
    """TileKernels' fn(x); where it refuses an empty x (its size assert), torch's transpose of it."""
    if x.numel() == 0:
        got = _tk_kernel(fn, x)
        return got if got is not None else x.transpose(-1, -2).contiguous()
    return fn(x)


@pytest.mark.parametrize("num_tokens, hidden, dtype", TRANSPOSE_CASES)
def test_transpose_is_bit_exact(transpose_compiled, num_tokens, hidden, dtype):
    tk = tile_kernels.transpose
    x = _bits((num_tokens, hidden), dtype, seed=num_tokens + hidden)
    assert_equal(compat.transpose.transpose(x), _transposed(tk.transpose, x))
    xt = _bits((hidden, num_tokens), dtype, seed=num_tokens + hidden + 1)  # the way back
    assert_equal(compat.transpose.transpose(xt), _transposed(tk.transpose, xt))
    xb = _bits((3, num_tokens, hidden), dtype, seed=num_tokens + hidden + 2)
    assert_equal(compat.transpose.batched_transpose(xb), _transposed(tk.batched_transpose, xb))
    wide = _bits((num_tokens, 2 * hidden), dtype, seed=num_tokens + hidden + 3)[:, hidden // 2: hidden // 2 + hidden]
    assert_equal(compat.transpose.transpose(wide), _transposed(tk.transpose, wide))  # a row-strided view


def test_transpose_takes_sizes_tile_kernels_refuses():
    x = _bits((4001, 7168), torch.bfloat16, seed=7)
    with pytest.raises(AssertionError):
        tile_kernels.transpose.transpose(x)
    assert torch.equal(compat.transpose.transpose(x).view(torch.int16), x.T.contiguous().view(torch.int16))


# -- quant.per_token_cast --------------------------------------------------------------------------------------

# (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0): TileKernels' two, then the others
OPTIONS = [(False, True, False), (True, True, True), (False, False, False), (True, False, False), (True, True, False),
           (True, False, True)]
CAST_CASES = [
    (t, h, d, g, o)
    for t in NUM_TOKENS for h in HIDDEN for d in (torch.float32, torch.bfloat16) for g in (32, 64, 128, h)
    for o in OPTIONS
]
E2M1_CASES = [(t, h, g, o) for t in NUM_TOKENS for h in HIDDEN for g in (16, 32) for o in OPTIONS[:3]]


def _precompile_casts(kernel: str, cases) -> None:
    for name, col in ((kernel, False), (f"{kernel}_colmajor", True)):
        _precompile(name, [
            {"num_tokens": max(1, t), "hidden": h, "group": g, "in_dtype": str(d).removeprefix("torch."),
             "round_scale": o[1]}
            for t, h, d, g, o in cases if o[0] == col
        ])


@pytest.fixture(scope="module")
def cast_compiled(shared_cache):
    _precompile_casts("per_token_cast", CAST_CASES)
    _precompile_casts("per_token_cast_e2m1", [(t, h, torch.bfloat16, g, o) for t, h, g, o in E2M1_CASES])


def _codes_close(q, q_tk):
    """FP8 codes equal but for < 0.1% one step apart (same sign, magnitudes differing by one)."""
    a, b = q.view(torch.uint8).int(), q_tk.view(torch.uint8).int()
    diff = a != b
    assert diff.float().mean().item() < 1e-3 if a.numel() else True
    assert ((a[diff] - b[diff]).abs() <= 1).all()


def _assert_same(a, b):
    """assert_equal, but for the stride of a size-1 dim: TileKernels' torch reference lays one column of scales
    (num_per_channels = hidden) out with strides (1, 1), its kernel (and tkjit) with (1, align(num_tokens, 4))."""
    assert_equal(a, b, check_stride=1 not in a.shape)


def _same(a, b) -> bool:
    """_assert_same as a predicate."""
    try:
        _assert_same(a, b)
        return True
    except AssertionError:
        return False


def _matches_reference_then_kernel(ours, ref, theirs):
    """ours equals TileKernels' torch reference bit for bit, and its kernel's output wherever that equals the
    reference (where it does not, TileKernels' kernel rounds another way, or fills the bytes past the last group
    of a packed UE8M0 word that its reference and tkjit zero, and tkjit follows the reference)."""
    for o, r in zip(ours, ref):
        _assert_same(o, r)
    if theirs is not None and all(_same(t, r) for t, r in zip(theirs, ref)):
        for o, t in zip(ours, theirs):
            assert_equal(o, t)
    elif theirs is not None:
        print("TileKernels' kernel differs from its torch reference here; tkjit follows the reference")


@pytest.mark.parametrize("num_tokens, hidden, in_dtype, num_per_channels, options", CAST_CASES)
def test_per_token_cast_matches(cast_compiled, num_tokens, hidden, in_dtype, num_per_channels, options):
    col_major, round_sf, packed = options
    x = torch.randn(num_tokens, hidden, dtype=in_dtype, device="cuda")
    kw = dict(use_tma_aligned_col_major_sf=col_major, round_sf=round_sf, use_packed_ue8m0=packed)
    q, sf = compat.quant.per_token_cast(x, "e4m3", num_per_channels, **kw)
    q_ref, sf_ref = tile_kernels.torch.cast(x, "e4m3", (1, num_per_channels), **kw)
    got = _tk_kernel(tile_kernels.quant.per_token_cast, x, "e4m3", num_per_channels, **kw)
    if round_sf or packed:  # bit for bit with its reference, and with its kernel wherever that agrees
        _matches_reference_then_kernel((q, sf), (q_ref, sf_ref), got)
    else:
        _assert_same(q, q_ref)
        _assert_same(sf, sf_ref)
    if got is not None and not (round_sf or packed):
        for ours, theirs in ((q, got[0]), (sf, got[1])):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            assert ours.numel() == 0 or ours.stride() == theirs.stride()
        if num_tokens:
            torch.testing.assert_close(sf, got[1], rtol=2.5e-7, atol=0)
            _codes_close(q, got[0])
    assert_equal(compat.quant.per_token_cast_with_sf_only(x, "e4m3", num_per_channels, **kw), sf)
    if num_tokens:  # TileKernels' non-contiguous case: rows 2 * hidden apart
        x_nc = torch.randn(num_tokens, 2 * hidden, dtype=in_dtype, device="cuda")[:, :hidden]
        x_nc.copy_(x)
        q_nc, sf_nc = compat.quant.per_token_cast(x_nc, "e4m3", num_per_channels, **kw)
        assert_equal(q_nc, q)
        assert_equal(sf_nc, sf)
    if not col_major and not packed and num_per_channels % 32 == 0:  # casts with these scales given
        q_pre = compat.quant.per_token_cast_with_precomputed_sf(x, "e4m3", num_per_channels, sf)
        _assert_same(q_pre, tile_kernels.torch.cast(x, "e4m3", (1, num_per_channels), sf=sf))
        if round_sf:  # x * (1 / sf) is x * (448 / amax) only where sf is a power of two
            assert_equal(q_pre, q)


@pytest.mark.parametrize("num_tokens, hidden, num_per_channels, options", E2M1_CASES)
def test_per_token_cast_e2m1_matches(cast_compiled, num_tokens, hidden, num_per_channels, options):
    col_major, round_sf, packed = options
    x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device="cuda")
    kw = dict(use_tma_aligned_col_major_sf=col_major, round_sf=round_sf, use_packed_ue8m0=packed)
    ours = compat.quant.per_token_cast(x, "e2m1", num_per_channels, **kw)
    ref = tile_kernels.torch.cast(x, "e2m1", (1, num_per_channels), **kw)
    theirs = _tk_kernel(tile_kernels.quant.per_token_cast, x, "e2m1", num_per_channels, **kw)
    _matches_reference_then_kernel(ours, ref, theirs)
    assert_equal(compat.quant.per_token_cast_with_sf_only(x, "e2m1", num_per_channels, **kw), ours[1])


@pytest.mark.parametrize("in_fmt, x_block_size", [("e4m3", (128, 128)), ("e4m3", (1, 128)), ("e2m1", (1, 32))])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_of_quantised_inputs(in_fmt, x_block_size, fmt):
    """TileKernels' re-cast of a (values, scales) input: bit for bit with its torch reference."""
    x = torch.randn(4001, 2048, dtype=torch.bfloat16, device="cuda")
    xq = tile_kernels.torch.cast(x, in_fmt, x_block_size, round_sf=True)
    ours = compat.quant.per_token_cast(xq, fmt, 32, x_block_size=x_block_size, round_sf=True)
    ref = tile_kernels.torch.cast(xq, fmt, (1, 32), x_block_size=x_block_size, round_sf=True)
    theirs = _tk_kernel(tile_kernels.quant.per_token_cast, xq, fmt, 32, x_block_size=x_block_size, round_sf=True)
    _matches_reference_then_kernel(ours, ref, theirs)


# -- modeling.mhc.ops.sinkhorn_normalize ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("shape, repeat, eps", [((4, 4), 10, 1e-6), ((4, 4), 20, 1e-6), ((2, 4, 4), 10, 1e-6),
                                                 ((8, 8), 10, 1e-6)])
def test_sinkhorn_normalize_matches(shared_cache, num_tokens, shape, repeat, eps):
    x = torch.randn(num_tokens, *shape, device="cuda")
    xs = [x.clone().requires_grad_() for _ in range(3)]
    y = compat.modeling.mhc.ops.sinkhorn_normalize(xs[0], repeat, eps)
    y_ref = tile_kernels.torch.sinkhorn_normalize_ref(xs[2], repeat, eps)
    # (TileKernels' kernel refuses an empty batch: a zero grid)
    y_tk = tile_kernels.modeling.mhc.ops.sinkhorn_normalize(xs[1], repeat, eps) if num_tokens else y_ref
    assert y.dtype == y_tk.dtype and y.shape == y_tk.shape and (y.numel() == 0 or y.stride() == y_tk.stride())
    torch.testing.assert_close(y, y_tk, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    if num_tokens:
        grad = torch.randn_like(y)
        for out in (y, y_tk, y_ref):
            out.backward(grad)
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xs[0].grad, xs[2].grad, rtol=1e-4, atol=1e-5)
