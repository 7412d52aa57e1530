"""swiglu_forward_and_per_token_cast(_colmajor) on the CPU: shapes, constraints, defaults, the reference (against
TileKernels' torch reference's formulas, hand-checked clamp counts, weights and skipped rows), the torch op (fake
impl, opcheck, in-place counter), tkjit.ops and the TileKernels-compatible entry point (kernels that write the
reference), sm_90a cross-compiles."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.errors import ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.scales import pack_ue8m0
from tkjit.spec import validate
from tkjit_kernels.quant import swiglu_forward_and_per_token_cast as mod

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

NAME = "swiglu_forward_and_per_token_cast"
COLMAJOR = NAME + "_colmajor"
CUDA_ONLY = (NAME, COLMAJOR)


@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, CUDA_ONLY)


def _shape(**kw):
    return get_spec(NAME).canonical_shape({"num_tokens": 64, "num_weights": 1, "hidden": 256, **kw})


def _same(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _x(n, hidden, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2 * hidden, generator=g) * 4 * torch.exp(torch.randn(n, 1, generator=g))
    return x.to(dtype)


def _tk_swiglu(x, pos_to_token_topk=None, topk_weights=None, swiglu_clamp_value=None, clamped_count=None):
    """TileKernels' torch reference (tile_kernels/torch/swiglu.py swiglu_forward), its formulas as written."""
    hidden = x.shape[1] // 2
    x_fp32 = x.float()
    x_left, x_right = x_fp32[:, :hidden], x_fp32[:, hidden:]
    if swiglu_clamp_value is not None:
        if clamped_count is not None:
            clamped_count[0] += (x_left > swiglu_clamp_value).sum()
            clamped_count[1] += (x_right > swiglu_clamp_value).sum()
            clamped_count[2] += (x_right < -swiglu_clamp_value).sum()
        x_left = torch.clamp(x_left, max=swiglu_clamp_value)
        x_right = torch.clamp(x_right, min=-swiglu_clamp_value, max=swiglu_clamp_value)
    out = x_left / (1.0 + torch.exp(-x_left)) * x_right
    if pos_to_token_topk is not None:
        num_tokens, num_topk = topk_weights.shape
        pos_mask = pos_to_token_topk >= 0
        token_indices = torch.div(pos_to_token_topk[pos_mask], num_topk, rounding_mode="floor")
        topk_indices = pos_to_token_topk[pos_mask] % num_topk
        w_expanded = torch.zeros(x.shape[0], dtype=torch.float32)
        w_expanded[pos_mask] = topk_weights[token_indices, topk_indices].float()
        out = out * w_expanded.unsqueeze(1)
    return out


def _tk_cast(y, group, round_sf=False):
    """TileKernels' torch `cast(y, 'e4m3', (1, group), round_sf=...)` for a float32 y whose width group divides:
    (values, row-major scales)."""
    n, h = y.shape
    blocks = y.view(n, h // group, group)
    max_val = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    full = torch.full_like(max_val, 448.0)
    sf = max_val / full
    if round_sf:
        sf = ((sf.view(torch.int32) + 0x007FFFFF) & 0x7F800000).view(torch.float32)
        inv = 1.0 / sf
    else:
        inv = full / max_val
    q = torch.clamp(blocks * inv, -448.0, 448.0).to(torch.float8_e4m3fn).view(n, h)
    return q, sf.view(n, h // group)


# -- the spec -----------------------------------------------------------------------------------------

def test_specs_validate():
    for name in CUDA_ONLY:
        spec = get_spec(name)
        validate(spec)
        assert spec.family == "quant" and spec.tolerance.exact
        assert [a.name for a in spec.inputs] == ["x", "pos_to_token_topk", "topk_weights", "pos_to_expert",
                                                "clamped_count"]
        assert [a.name for a in spec.outputs] == ["out", "scales"]


@pytest.mark.parametrize("hidden, group, in_dtype", [(7168, 128, "float32"), (4096, 4096, "bfloat16"),
                                                     (1536, 1536, "float32"), (256, 64, "bfloat16")])
def test_defaults_are_per_token_casts(hidden, group, in_dtype):
    """The layout is per_token_cast's: the same default for the same (hidden, group, in_dtype), but for
    bf16 groups of 128 (next test)."""
    shape = _shape(hidden=hidden, group=group, in_dtype=in_dtype)
    ptc = get_spec("per_token_cast").canonical_shape({"num_tokens": 64, "hidden": hidden, "group": group,
                                                      "in_dtype": in_dtype})
    cfg = get_spec(NAME).default_config(shape, "sm_90a")
    assert cfg == get_spec("per_token_cast").default_config(ptc, "sm_90a")
    assert get_spec(NAME).constraint(shape, cfg) is None


@pytest.mark.parametrize("hidden", [128, 2048, 7168])
def test_bf16_group_128_defaults(hidden):
    """bf16 groups of 128: two 16-byte loads of each half a thread, eight threads a group; four groups a
    thread in turn (128-thread blocks) where the clamp is counted, the measured fastest of each shape."""
    spec = get_spec(NAME)
    dense = _shape(hidden=hidden)
    routed = _shape(hidden=hidden, swiglu_clamp_value=10.0, count_clamp=True)
    assert spec.default_config(dense, "sm_90a") == {"vec": 16, "group_threads": 8, "threads": 256, "iters": 1}
    assert spec.default_config(routed, "sm_90a") == {"vec": 16, "group_threads": 8, "threads": 128, "iters": 4}
    for s in (dense, routed):
        assert spec.constraint(s, spec.default_config(s, "sm_90a")) is None


@pytest.mark.parametrize("kw, match", [
    ({"group": 96}, "group=96"),
    ({"hidden": 576, "group": 128}, "multiple of 16 and of group"),
    ({"count_clamp": True}, "count_clamp needs swiglu_clamp_value"),
    ({"sf_clamp_min": 1e-37}, "sf_clamp_min"),
    ({"num_weights": 8}, "num_weights=8 must be 1 without has_weights"),
])
def test_bad_shapes(kw, match):
    with pytest.raises(ShapeError, match=match):
        get_spec(NAME).canonical_shape({"num_tokens": 64, "num_weights": 1, "hidden": 256, **kw})


def test_cpu_target_refused():
    shape = _shape()
    cfg = get_spec(NAME).default_config(shape, "sm_90a")
    assert "CUDA targets only" in get_spec(NAME).arch_constraint("cpu", cfg, shape)


def test_output_dims_and_bytes():
    spec, colmajor = get_spec(NAME), get_spec(COLMAJOR)
    shape = _shape(num_tokens=5, hidden=512)
    assert [tuple(d) for _, _, d in spec.output_decls(shape)] == [(5, 512), (5, 4)]
    assert [tuple(d) for _, _, d in colmajor.output_decls(shape)] == [(5, 512), (4, 8)]
    assert spec.bytes_moved(shape) == 5 * (2 * 512 * 2 + 512) + 4 * 5 * 4
    assert colmajor.bytes_moved(shape) == 5 * (2 * 512 * 2 + 512) + 4 * 8 * 4


# -- the reference ------------------------------------------------------------------------------------

@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group, round_scale", [(128, False), (128, True), (256, False), (32, True)])
def test_reference_is_tile_kernels_reference(in_dtype, group, round_scale):
    x = _x(65, 256, in_dtype)
    x[3] = 0
    x[7] *= 1e-7
    counter = torch.zeros(3, dtype=torch.int64)
    shape = _shape(num_tokens=65, group=group, in_dtype=str(in_dtype)[6:], round_scale=round_scale)
    got_count, q, sf = mod.reference(shape, x, counter)
    q_tk, sf_tk = _tk_cast(_tk_swiglu(x), group, round_scale)
    assert torch.equal(got_count, counter) and _same(q, q_tk) and torch.equal(sf, sf_tk)
    assert torch.equal(sf[3], torch.full((256 // group,), 1e-4 / 448.0 if not round_scale else 2.0**-22))


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_weights_clamp_and_counts_are_tile_kernels(seed):
    n, nt, k, c = 96, 24, 4, 3.5
    x = _x(n, 128, seed=seed)
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(-1, nt * k, (n,), generator=g, dtype=torch.int32)
    wts = torch.rand(nt, k, generator=g)
    shape = _shape(num_tokens=n, num_weights=nt * k, hidden=128, has_weights=True, swiglu_clamp_value=c,
                   count_clamp=True)
    start = torch.tensor([5, 0, 7])
    got_count, q, sf = mod.reference(shape, x, pos, wts.reshape(-1), start.clone())
    tk_count = start.clone()
    q_tk, sf_tk = _tk_cast(_tk_swiglu(x, pos, wts, c, tk_count), 128)
    assert torch.equal(got_count, tk_count) and _same(q, q_tk) and torch.equal(sf, sf_tk)
    assert got_count.tolist() != start.tolist()


def test_reference_counts_by_hand():
    x = torch.tensor([[1.0, 5.0, -6.0, 2.0, 9.0, -9.0, 0.5, 4.0]]).repeat(2, 16)  # (2, 128): hidden 64
    x = x.to(torch.bfloat16)
    shape = _shape(num_tokens=2, hidden=64, group=64, swiglu_clamp_value=4.0, count_clamp=True)
    count, _, _ = mod.reference(shape, x, torch.zeros(3, dtype=torch.int64))
    # per row: left half = 8 copies of [1, 5, -6, 2, 9, -9, 0.5, 4]: > 4: 5 and 9 -> 2 per copy
    assert count.tolist() == [2 * 2 * 8, 2 * 2 * 8, 2 * 2 * 8]  # < -4: -6 and -9
    y, _ = mod.swiglu(x, swiglu_clamp_value=4.0)
    left = torch.tensor([1.0, 4.0, -6.0, 2.0, 4.0, -9.0, 0.5, 4.0])  # gate clamped above only
    right = torch.tensor([1.0, 4.0, -4.0, 2.0, 4.0, -4.0, 0.5, 4.0])  # up clamped both sides
    want = left / (1.0 + torch.exp(-left)) * right
    assert torch.equal(y[0, :8], want) and torch.equal(y[1, 56:64], want)


def test_reference_routing_rows():
    """-1 and out-of-range positions weigh 0 (a zero row: +-0 values, the clamp's scale); pos_to_expert < 0 rows
    are zero rows and count nothing."""
    n = 6
    x = torch.full((n, 256), 20.0, dtype=torch.bfloat16)  # every gate and up value > 10: all clamped
    pos = torch.tensor([0, -1, 3, 2**31 - 1, 7, -5], dtype=torch.int32)
    wts = torch.tensor([0.5, 2.0, 0.25, 1.0, 3.0, 1.5, 0.75, 0.125])
    pe = torch.tensor([1, 0, -1, 4, 2, -1], dtype=torch.int32)
    shape = _shape(num_tokens=n, num_weights=8, hidden=128, has_weights=True, has_expert=True,
                   swiglu_clamp_value=10.0, count_clamp=True)
    count, q, sf = mod.reference(shape, x, pos, wts, pe, torch.zeros(3, dtype=torch.int64))
    assert count.tolist() == [4 * 128, 4 * 128, 0]  # rows 2 and 5 are skipped
    for r in (1, 2, 3, 5):
        assert (q[r].float() == 0).all() and sf[r].item() == pytest.approx(1e-4 / 448, rel=1e-6)
    y = 10.0 / (1 + torch.exp(torch.tensor(-10.0))) * 10.0
    for r, w in ((0, 0.5), (4, 0.125)):
        assert sf[r].item() == (y * w / torch.tensor(448.0)).item() and (q[r].float() == 448).all()


def test_reference_sf_clamp_min():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    x[1, :] = 1e-3
    shape = _shape(num_tokens=4, hidden=128, sf_clamp_min=1.0)
    _, q, sf = mod.reference(shape, x, torch.zeros(3, dtype=torch.int64))
    assert torch.equal(sf, torch.full((4, 1), 1.0) / torch.tensor(448.0))


def test_make_inputs():
    shape = _shape(num_tokens=100, num_weights=32, has_weights=True, has_expert=True, swiglu_clamp_value=2.0,
                   count_clamp=True)
    for seed in (0, 1):
        x, pos, wts, pe, cnt = get_spec(NAME).make_inputs(shape, seed=seed)
        assert x.shape == (100, 512) and x.dtype == torch.bfloat16 and x.isfinite().all()
        assert pos.dtype == pe.dtype == torch.int32 and wts.shape == (32,) and cnt.shape == (3,)
        assert (pos == -1).any() and (pe == -1).any() and ((x[:, :256].float() > 2).any())
        assert ((pos >= 32) | (pos < -1)).any() == (seed == 1)
    (x, cnt) = get_spec(NAME).make_inputs(_shape(num_tokens=7), seed=0)
    assert x.shape == (7, 512) and cnt.dtype == torch.int64


# -- the op and tkjit.ops -----------------------------------------------------------------------------

def _routing(n, nt=16, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(-1, nt * k, (n,), generator=g, dtype=torch.int32)
    pe = torch.randint(-1, 8, (n,), generator=g, dtype=torch.int32)
    return pos, torch.rand(nt, k, generator=g), pe


@pytest.mark.parametrize("n", [0, 1, 65])
@pytest.mark.parametrize("layout", ["row", "col", "packed"])
def test_ops_shapes_and_values(reference_kernels, n, layout):
    x = _x(n, 256)
    pos, wts, pe = _routing(n)
    counter = torch.tensor([1, 2, 3])
    q, sf = tkjit.ops.swiglu_forward_and_per_token_cast(
        x, 128, pos_to_token_topk=pos, topk_weights=wts, pos_to_expert=pe, swiglu_clamp_value=6.0,
        clamped_count=counter, round_scale=layout == "packed", col_major_scales=layout != "row",
        packed_ue8m0=layout == "packed")
    assert len(reference_kernels) == (1 if n else 0)
    shape = _shape(num_tokens=max(n, 1), num_weights=64, has_weights=True, has_expert=True, swiglu_clamp_value=6.0,
                   count_clamp=True, round_scale=layout == "packed")
    want_count, q_ref, sf_ref = mod.reference(shape, x, pos, wts.reshape(-1), pe, torch.tensor([1, 2, 3]))
    assert torch.equal(counter, want_count)  # in place
    assert q.shape == (n, 256) and q.dtype == torch.float8_e4m3fn and _same(q, q_ref)
    t4 = -(-n // 4) * 4
    if layout == "row":
        assert sf.shape == (n, 2) and sf.stride() == (2, 1) and torch.equal(sf, sf_ref)
    elif layout == "col":
        assert sf.shape == (n, 2) and (n == 0 or sf.stride() == (1, t4)) and torch.equal(sf, sf_ref)
    else:
        storage = torch.zeros(2, t4)
        storage[:, :n] = sf_ref.T
        assert sf.dtype == torch.int32 and sf.shape == (n, 1) and (n == 0 or sf.stride() == (1, t4))
        assert torch.equal(sf, pack_ue8m0(storage)[:, :n].T)


def test_ops_no_options(reference_kernels):
    x = _x(33, 512, torch.float32)
    q, sf = tkjit.ops.swiglu_forward_and_per_token_cast(x, 512)
    q_tk, sf_tk = _tk_cast(_tk_swiglu(x), 512)
    assert _same(q, q_tk) and torch.equal(sf, sf_tk)
    q2, sf2 = torch.ops.tkjit.swiglu_forward_and_per_token_cast(x, group=512)
    assert _same(q2, q) and torch.equal(sf2, sf)


def test_ops_refuse_bad_input(reference_kernels):
    op = tkjit.ops.swiglu_forward_and_per_token_cast
    x = _x(16, 256)
    pos, wts, pe = _routing(16)
    with pytest.raises(TensorError, match="2 \\* hidden"):
        op(x[:, 1:].contiguous())
    with pytest.raises(ShapeError, match="come together"):
        op(x, pos_to_token_topk=pos)
    with pytest.raises(ShapeError, match="clamped_count needs swiglu_clamp_value"):
        op(x, clamped_count=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ShapeError, match="must be > 0"):
        op(x, swiglu_clamp_value=-1.0)
    with pytest.raises(ShapeError, match="packed_ue8m0 needs col_major_scales"):
        op(x, packed_ue8m0=True)
    with pytest.raises(ShapeError, match="group"):
        op(x, 96)
    with pytest.raises(TensorError, match="dtype"):
        op(x, pos_to_token_topk=pos.long(), topk_weights=wts)
    with pytest.raises(TensorError, match="dtype"):
        op(x, pos_to_token_topk=pos, topk_weights=wts.double())
    with pytest.raises(TensorError, match="pos_to_expert"):
        op(x, pos_to_expert=pe[:8])
    with pytest.raises(TensorError, match="clamped_count"):
        op(x, swiglu_clamp_value=1.0, clamped_count=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TensorError, match="clamped_count"):
        op(x, swiglu_clamp_value=1.0, clamped_count=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ShapeError, match="in_dtype"):
        op(x.half())


@pytest.mark.parametrize("col_major", [False, True])
def test_fake_impl(col_major):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = _x(9, 256)
    pos, wts, pe = _routing(9)
    with FakeTensorMode() as mode:
        fx, fpos, fw, fpe = (mode.from_tensor(t) for t in (x, pos, wts, pe))
        fc = mode.from_tensor(torch.zeros(3, dtype=torch.int64))
        q, s = torch.ops.tkjit.swiglu_forward_and_per_token_cast(fx, fpos, fw, fpe, fc, 128, False, col_major, 2.0)
        with pytest.raises(TensorError, match="dtype"):
            torch.ops.tkjit.swiglu_forward_and_per_token_cast(fx, fpos.long(), fw)
    assert q.shape == (9, 256) and q.dtype == torch.float8_e4m3fn
    assert s.shape == ((2, 12) if col_major else (9, 2)) and s.dtype == torch.float32


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("routing, col_major", [(False, False), (True, True), (True, False)])
def test_opcheck(reference_kernels, routing, col_major):
    x = _x(40, 256)
    pos, wts, pe = _routing(40) if routing else (None, None, None)
    counter = torch.zeros(3, dtype=torch.int64) if routing else None
    clamp = 3.0 if routing else 0.0
    result = torch.library.opcheck(torch.ops.tkjit.swiglu_forward_and_per_token_cast.default,
                                   (x, pos, wts, pe, counter, 128, True, col_major, clamp), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_schema():
    schema = str(torch.ops.tkjit.swiglu_forward_and_per_token_cast.default._schema)
    assert schema == (
        "tkjit::swiglu_forward_and_per_token_cast(Tensor x, Tensor? pos_to_token_topk=None, Tensor? topk_weights=None, "
        "Tensor? pos_to_expert=None, Tensor(a!)? clamped_count=None, int group=128, bool round_scale=False, "
        "bool col_major_scales=False, float swiglu_clamp_value=0., float sf_clamp_min=0.0001, str? config=None) "
        "-> (Tensor, Tensor)")


# -- the TileKernels-compatible entry point -----------------------------------------------------------

def test_compat_signature_is_tile_kernels():
    """TileKernels 1.0.0's signature (quant/swiglu_forward_and_per_token_cast_kernel.py)."""
    import tkjit.compat.tile_kernels as tk

    sig = inspect.signature(tk.quant.swiglu_forward_and_per_token_cast)
    assert list(sig.parameters) == [
        "x", "fmt", "num_per_channels", "pos_to_token_topk", "topk_weights", "pos_to_expert",
        "use_tma_aligned_col_major_sf", "round_sf", "use_packed_ue8m0", "swiglu_clamp_value", "clamped_count",
        "sf_clamp_min"]
    assert [p.default for p in sig.parameters.values()][3:] == [None, None, None, False, False, False, None, None,
                                                                None]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())


@pytest.mark.parametrize("n", [0, 7, 130])
@pytest.mark.parametrize("col_major, round_sf, packed", [(False, False, False), (True, False, False),
                                                         (True, True, True), (False, True, False)])
def test_compat_is_tile_kernels_reference(reference_kernels, n, col_major, round_sf, packed):
    """TileKernels' torch references (swiglu_forward, then cast) bit for bit; its counter in place; its layouts."""
    import tkjit.compat.tile_kernels as tk

    x = _x(n, 256)
    pos, wts, _ = _routing(n, seed=n)
    count, tk_count = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])
    q, sf = tk.quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos, wts, None, col_major, round_sf, packed,
                                                        5.0, count)
    q_tk, sf_tk = _tk_cast(_tk_swiglu(x, pos, wts, 5.0, tk_count), 128, round_sf)
    assert torch.equal(count, tk_count) and _same(q, q_tk)
    if not col_major:
        assert sf.shape == (n, 2) and torch.equal(sf, sf_tk)
    elif not packed:
        assert (n == 0 or sf.stride() == (1, -(-n // 4) * 4)) and torch.equal(sf, sf_tk)
    else:
        assert sf.dtype == torch.int32 and sf.shape == (n, 1)
        exps = sf_tk.view(torch.int32) >> 23  # two groups: bytes 0 and 1 of each token's word
        assert torch.equal(sf[:, 0], exps[:, 0] | (exps[:, 1] << 8))


def test_compat_group_hidden_and_f32(reference_kernels):
    import tkjit.compat.tile_kernels as tk

    x = _x(20, 384, torch.float32)
    q, sf = tk.quant.swiglu_forward_and_per_token_cast(x, "e4m3", 384)
    q_tk, sf_tk = _tk_cast(_tk_swiglu(x), 384)
    assert _same(q, q_tk) and torch.equal(sf, sf_tk) and sf.shape == (20, 1)


@pytest.mark.parametrize("args, kw, error, match", [
    ((_x(4, 256), "e2m1", 128), {}, ShapeError, "fmt must be 'e4m3'"),
    ((_x(4, 256), "e4m3", 64), {}, ShapeError, "num_per_channels=64 must be 128 or hidden"),
    ((_x(4, 64), "e4m3", 64), {}, ShapeError, "multiple of 128"),
    ((_x(4, 256), "e4m3", 256), {"use_tma_aligned_col_major_sf": True}, ShapeError, "needs num_per_channels=128"),
    ((_x(4, 256), "e4m3", 128), {"use_packed_ue8m0": True}, ShapeError, "needs use_tma_aligned_col_major_sf"),
    ((_x(4, 256).T, "e4m3", 128), {}, TensorError, "contiguous"),
    ((_x(4, 256).half(), "e4m3", 128), {}, TensorError, "x"),
    ((_x(4, 256), "e4m3", 128), {"pos_to_token_topk": torch.zeros(4, dtype=torch.int32)}, ShapeError,
     "topk_weights must be given"),
    ((_x(4, 256), "e4m3", 128), {"pos_to_token_topk": torch.zeros(3, dtype=torch.int32),
                                 "topk_weights": torch.ones(2, 2)}, TensorError, "pos_to_token_topk must have"),
    ((_x(4, 256), "e4m3", 128), {"pos_to_token_topk": torch.zeros(4, dtype=torch.int32),
                                 "topk_weights": torch.ones(4)}, TensorError, "topk_weights"),
    ((_x(4, 256), "e4m3", 128), {"pos_to_expert": torch.zeros(4, dtype=torch.int64)}, TensorError,
     "pos_to_expert"),
    ((_x(4, 256), "e4m3", 128), {"clamped_count": torch.zeros(3, dtype=torch.int64)}, ShapeError,
     "clamped_count needs swiglu_clamp_value"),
    ((_x(4, 256), "e4m3", 128), {"swiglu_clamp_value": 1.0, "clamped_count": torch.zeros(2, dtype=torch.int64)},
     TensorError, "clamped_count"),
    ((_x(4, 256), "e4m3", 128), {"swiglu_clamp_value": 0.0}, NotImplementedError, "swiglu_clamp_value=0.0"),
    ((_x(4, 256), "e4m3", 128), {"swiglu_clamp_value": float("nan")}, NotImplementedError, "swiglu_clamp_value"),
    ((_x(4, 256), "e4m3", 128), {"sf_clamp_min": 0.0}, NotImplementedError, "sf_clamp_min"),
])
def test_compat_refuses(reference_kernels, args, kw, error, match):
    import tkjit.compat.tile_kernels as tk

    with pytest.raises(error, match=match):
        tk.quant.swiglu_forward_and_per_token_cast(*args, **kw)


def test_compat_sf_clamp_min(reference_kernels):
    import tkjit.compat.tile_kernels as tk

    x = _x(8, 128) * 1e-6
    _, sf = tk.quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, sf_clamp_min=0.5)
    assert torch.equal(sf, torch.full((8, 1), 0.5) / torch.tensor(448.0))


# -- sm_90a cross-compiles ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, shape", [
    (NAME, {"hidden": 2048}),
    (NAME, {"hidden": 4096, "group": 4096, "in_dtype": "float32", "round_scale": True}),
    (COLMAJOR, {"hidden": 2048, "num_weights": 4096, "has_weights": True, "has_expert": True,
                "swiglu_clamp_value": 10.0, "count_clamp": True, "sf_clamp_min": 1e-6}),
])
def test_compiles_for_sm90a(cache_dir, name, shape):
    k = tkjit.get(name, {"num_tokens": 4096, "num_weights": 1, **shape}, arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert "expf(" in src and "__expf" not in src  # the accurate exp, as TileKernels (no fast math)
    assert "__fadd_rn(" in src and "__fdiv_rn(" in src  # exp rounded before the add; IEEE divisions
    assert ("topk_weights[" in src) == shape.get("has_weights", False)
    assert ("pos_to_expert[" in src) == shape.get("has_expert", False)
    assert ("AtomicAdd" in src) == shape.get("count_clamp", False)
    assert "int64_t" in src  # 64-bit offsets
