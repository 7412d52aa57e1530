"""per_token_cast(_colmajor) specs on the CPU: shapes, constraints, reference semantics, scale
layouts, sm_90a cross-compiles."""

from pathlib import Path

import pytest
import torch

import tkjit
from tkjit.errors import ConfigError, ShapeError
from tkjit.kernel import CompiledKernel
from tkjit.registry import get_spec
from tkjit.spec import Align, validate

NAME = "per_token_cast"
COLMAJOR = "per_token_cast_colmajor"


@pytest.fixture(scope="module")
def spec():
    return get_spec(NAME)


def _shape(**kw):
    return {"num_tokens": 16, "hidden": 256, "group": 128, **kw}


def test_spec_validates(spec):
    validate(spec)
    assert spec.family == "quant"
    assert spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")


@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "hidden,group",
    [(7168, 128), (7168, 32), (4096, 64), (576, 32), (576, 64), (576, 576), (7168, 7168), (4096, 4096), (16, 16),
     (65536, 65536), (1152, 1152),
     # partial last group, and group 16
     (576, 128), (48, 32), (64, 128), (2064, 128), (1040, 64), (7168, 16), (576, 16), (16, 128)],
)
def test_defaults_valid(spec, in_dtype, hidden, group):
    full = spec.canonical_shape(_shape(hidden=hidden, group=group, in_dtype=in_dtype))
    cfg = spec.default_config(full, "sm_90a")
    assert spec.check_config(full, cfg, "sm_90a") == cfg
    assert group // cfg["group_threads"] <= 128


def test_bad_shapes(spec):
    with pytest.raises(ShapeError, match="group=48 must be one of"):
        spec.canonical_shape(_shape(hidden=576, group=48))
    with pytest.raises(ShapeError, match="group=256 must be one of"):  # TileKernels' groups only
        spec.canonical_shape(_shape(hidden=576, group=256))
    with pytest.raises(ShapeError, match="'group'=8 below its minimum 16"):
        spec.canonical_shape(_shape(hidden=64, group=8))
    with pytest.raises(ShapeError, match="group=96 must be one of"):
        spec.canonical_shape(_shape(hidden=192, group=96))
    with pytest.raises(ShapeError, match="multiple of 16"):
        spec.canonical_shape(_shape(hidden=584, group=128))  # a partial group still holds whole 16s
    with pytest.raises(ShapeError, match="in_dtype.*not allowed"):
        spec.canonical_shape(_shape(in_dtype="float16"))
    with pytest.raises(ShapeError, match="must be a str"):
        spec.canonical_shape(_shape(in_dtype=torch.bfloat16))
    with pytest.raises(ShapeError, match="must be a bool"):
        spec.canonical_shape(_shape(round_scale=1))
    with pytest.raises(ShapeError, match="multiple of 16"):
        spec.canonical_shape(_shape(hidden=24, group=24))
    with pytest.raises(ShapeError, match="power-of-two"):
        spec.canonical_shape(_shape(hidden=16 * 1001, group=16 * 1001))


def test_bad_configs(spec):
    full = spec.canonical_shape(_shape(in_dtype="float32"))
    with pytest.raises(ConfigError, match="at most 32 bytes"):
        spec.check_config(full, {"vec": 16, "group_threads": 4, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="spill"):
        spec.check_config(
            spec.canonical_shape(_shape(hidden=1024, group=1024)),
            {"vec": 8, "group_threads": 4, "threads": 256, "iters": 1},
        )
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full), "cpu")


def test_output_dims(spec):
    full = spec.canonical_shape(_shape(num_tokens=3, hidden=7168, group=128))
    (o, odt, odims), (s, sdt, sdims) = spec.output_decls(full)
    assert (o, odt, odims) == ("out", "float8_e4m3fn", (3, 7168))
    assert (s, sdt, sdims) == ("scales", "float32", (3, 56))
    assert spec.bytes_moved(full) == 3 * (7168 * 3 + 56 * 4)
    assert spec.bytes_moved({**full, "in_dtype": "float32"}) == 3 * (7168 * 5 + 56 * 4)


@pytest.mark.parametrize(
    "hidden,group,groups", [(576, 128, 5), (48, 32, 2), (64, 128, 1), (2064, 128, 17), (576, 16, 36), (7168, 128, 56)]
)
def test_partial_last_group_dims(spec, hidden, group, groups):
    """num_groups = ceil(hidden / group), in both layouts and in the bytes moved."""
    full = spec.canonical_shape(_shape(num_tokens=3, hidden=hidden, group=group))
    (_, _, odims), (_, _, sdims) = spec.output_decls(full)
    assert odims == (3, hidden) and sdims == (3, groups)
    assert spec.bytes_moved(full) == 3 * (hidden * 3 + groups * 4)
    cm = get_spec(COLMAJOR)
    (_, _, odims), (_, _, sdims) = cm.output_decls(full)
    assert odims == (3, hidden) and sdims == (groups, 4)
    assert cm.bytes_moved(full) == 3 * hidden * 3 + groups * 4 * 4


def test_reference_partial_last_group_hand_checked(spec):
    """hidden 48, group 32: the second group is channels 32..47 and its amax is over those 16 only."""
    s = spec.canonical_shape({"num_tokens": 3, "hidden": 48, "group": 32, "in_dtype": "float32"})
    x = torch.zeros(3, 48)
    x[0, :32] = 1000.0  # a large first group must not leak into the second
    x[0, 32:] = torch.linspace(-14.0, 7.0, 16)  # amax 14 -> scale 14/448 = 1/32, values * 32
    x[1, 40] = 896.0  # amax 896 -> scale 2: 896 -> 448
    x[1, 33] = 3.0  # 3 / 2 = 1.5
    x[2, 32:] = 1e-6  # under the clamp: amax 1e-4
    q, sf = spec.reference(s, x)
    assert q.shape == (3, 48) and q.is_contiguous() and sf.shape == (3, 2)
    assert sf[0, 0].item() == (torch.tensor(1000.0) / torch.tensor(448.0)).item() and q[0, 0].float().item() == 448.0
    assert sf[0, 1].item() == 14.0 / 448.0
    assert q[0, 32].float().item() == -448.0 and q[0, 47].float().item() == 224.0
    assert sf[1, 0].item() == torch.tensor(1e-4) / torch.tensor(448.0)  # an all-zero whole group
    assert sf[1, 1].item() == 2.0 and q[1, 40].float().item() == 448.0 and q[1, 33].float().item() == 1.5
    assert sf[2, 1].item() == torch.tensor(1e-4) / torch.tensor(448.0)
    assert q[2, 32].float().item() == 4.5  # 1e-6 * 448 / 1e-4 = 4.48 -> nearest e4m3 4.5
    # The partial group gives the same values as a 16-wide group over the same channels would.
    s16 = spec.canonical_shape({"num_tokens": 3, "hidden": 16, "group": 16, "in_dtype": "float32"})
    q16, sf16 = spec.reference(s16, x[:, 32:].contiguous())
    assert torch.equal(sf[:, 1:], sf16) and torch.equal(q[:, 32:].view(torch.uint8), q16.view(torch.uint8))


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("hidden,group", [(576, 128), (2064, 128), (1040, 64), (48, 32), (64, 128), (576, 16)])
def test_reference_partial_matches_group_by_group(spec, hidden, group, round_scale):
    """Every group, whole or partial, is quantised on its own: the reference equals a cast of each
    group's channels as a group == width shape (a hand-rolled, per-group path)."""
    s = spec.canonical_shape({"num_tokens": 9, "hidden": hidden, "group": group, "round_scale": round_scale})
    (x,) = spec.make_inputs(s, "cpu", 2)
    q, sf = spec.reference(s, x)
    ng = -(-hidden // group)
    assert sf.shape == (9, ng)
    for j in range(ng):
        part = x[:, j * group:(j + 1) * group].contiguous()
        w = part.shape[1]
        pq, psf = spec.reference({**s, "hidden": w, "group": w}, part)
        assert torch.equal(sf[:, j:j + 1].view(torch.int32), psf.view(torch.int32))
        assert torch.equal(q[:, j * group:j * group + w].view(torch.uint8), pq.view(torch.uint8))


def test_colmajor_reference_partial_last_group(spec):
    cm = get_spec(COLMAJOR)
    s = cm.canonical_shape({"num_tokens": 7, "hidden": 576, "group": 128, "in_dtype": "float32"})
    (x,) = cm.make_inputs(s, "cpu", 4)
    q, storage = cm.reference(s, x)
    q_row, sf_row = spec.reference(s, x)
    assert storage.shape == (5, 8) and torch.equal(storage[:, :7].T, sf_row) and (storage[:, 7:] == 0).all()
    assert torch.equal(q.view(torch.uint8), q_row.view(torch.uint8))


def test_group_16(spec):
    s = spec.canonical_shape({"num_tokens": 2, "hidden": 64, "group": 16, "in_dtype": "float32"})
    x = torch.arange(128, dtype=torch.float32).view(2, 64) - 40.0
    q, sf = spec.reference(s, x)
    assert sf.shape == (2, 4)
    amax = x.abs().view(2, 4, 16).amax(-1).clamp(min=1e-4)
    assert torch.equal(sf, amax / torch.full_like(amax, 448.0))


def test_reference_hand_checked(spec):
    s = spec.canonical_shape({"num_tokens": 2, "hidden": 64, "group": 32, "in_dtype": "float32"})
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-7.0, 3.5, 32)  # amax 7 -> scale 7/448 = 1/64, values * 64
    x[0, 32:] = 1e-6  # under the clamp: amax 1e-4
    x[1, :32] = 448.0
    x[1, 5] = -896.0  # amax 896 -> scale 2, -896 -> -448, 448 -> 224
    q, sf = spec.reference(s, x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 64)
    assert sf.dtype == torch.float32 and sf.shape == (2, 2)
    assert sf[0, 0].item() == pytest.approx(7 / 448) and sf[1, 0].item() == 2.0
    assert sf[0, 1].item() == torch.tensor(1e-4) / torch.tensor(448.0)
    assert sf[1, 1].item() == torch.tensor(1e-4) / torch.tensor(448.0)  # zeros: clamped amax
    assert q[0, 0].float().item() == -448.0
    assert q[1, 5].float().item() == -448.0 and q[1, 0].float().item() == 224.0
    assert (q[1, 32:].float() == 0).all()
    # 1e-6 * 448/1e-4 = 4.48 -> nearest e4m3 is 4.5
    assert q[0, 40].float().item() == 4.5
    # dequantised values are close to x
    deq = q.float() * sf.repeat_interleave(32, 1)
    assert torch.allclose(deq[0, :32], x[0, :32], rtol=0.07)


def test_reference_round_scale(spec):
    s = spec.canonical_shape({"num_tokens": 1, "hidden": 32, "group": 32, "in_dtype": "float32", "round_scale": True})
    x = torch.full((1, 32), 3.0)
    x[0, 0] = 5.0  # 5/448 -> rounded up to 2^-6 = 1/64; 5*64 = 320, 3*64 = 192
    q, sf = spec.reference(s, x)
    assert sf.item() == 2.0**-6
    assert q[0, 0].float().item() == 320.0 and q[0, 1].float().item() == 192.0
    x2 = torch.full((1, 32), 448.0 * 2**-3)  # exact power of two stays
    assert spec.reference(s, x2)[1].item() == 2.0**-3


def test_make_inputs(spec):
    full = spec.canonical_shape(_shape(num_tokens=40, hidden=576, group=64))
    (x,) = spec.make_inputs(full, "cpu", 3)
    assert x.dtype == torch.bfloat16 and x.shape == (40, 576)
    assert (x[5] == 0).all() and x[3].abs().max() < 1e-4
    (y,) = spec.make_inputs({**full, "in_dtype": "float32"}, "cpu", 3)
    assert y.dtype == torch.float32


# -- column-major, TMA-aligned scales --------------------------------------------------------------
@pytest.fixture(scope="module")
def colmajor():
    return get_spec(COLMAJOR)


def test_colmajor_spec_validates(spec, colmajor):
    validate(colmajor)
    assert colmajor.tolerance.exact and colmajor.family == "quant"
    # Same shapes, space, defaults and values as the row-major spec: only the scales layout differs.
    assert [p.name for p in colmajor.params] == [p.name for p in spec.params]
    assert colmajor.space == spec.space
    for ex in colmajor.examples:
        full = colmajor.canonical_shape(ex)
        assert colmajor.default_config(full, "sm_90a") == spec.default_config(full, "sm_90a")
    assert colmajor.outputs[1].dims[1] == Align("num_tokens", 4)
    import tkjit_kernels

    assert tkjit_kernels.INDEX[COLMAJOR] == tkjit_kernels.INDEX[NAME]


@pytest.mark.parametrize("n,padded", [(1, 4), (3, 4), (4, 4), (5, 8), (4001, 4004), (65536, 65536)])
def test_colmajor_output_dims(colmajor, n, padded):
    full = colmajor.canonical_shape(_shape(num_tokens=n, hidden=7168, group=128))
    (o, _, odims), (s, sdt, sdims) = colmajor.output_decls(full)
    assert (o, odims) == ("out", (n, 7168))
    assert (s, sdt, sdims) == ("scales", "float32", (56, padded))
    assert colmajor.bytes_moved(full) == n * 7168 * 3 + 56 * padded * 4


def test_colmajor_reference_hand_checked(spec, colmajor):
    # 5 tokens -> columns padded to 8; scale (t, g) = t + 1 + 10 g exactly (amax = 448 * scale).
    s = colmajor.canonical_shape({"num_tokens": 5, "hidden": 64, "group": 32, "in_dtype": "float32"})
    x = torch.zeros(5, 64)
    for t in range(5):
        for g in range(2):
            x[t, g * 32 + 7] = -448.0 * (t + 1 + 10 * g)
            x[t, g * 32 + 9] = 1.0
    q, storage = colmajor.reference(s, x)
    assert storage.dtype == torch.float32 and storage.shape == (2, 8) and storage.is_contiguous()
    flat = storage.reshape(-1)
    for t in range(5):
        for g in range(2):
            assert flat[g * 8 + t].item() == t + 1 + 10 * g
    assert (storage[:, 5:] == 0).all() and not storage[:, 5:].signbit().any()  # padding: +0.0
    q_row, sf_row = spec.reference(s, x)
    assert torch.equal(q.view(torch.uint8), q_row.view(torch.uint8))
    assert torch.equal(storage[:, :5].T, sf_row)
    assert q[2, 7].float().item() == -448.0 and q[2, 9].float().item() == 0.34375  # 1/3 -> nearest e4m3


def test_colmajor_reference_round_scale_and_wide_group(spec, colmajor):
    s = colmajor.canonical_shape({"num_tokens": 6, "hidden": 576, "group": 576, "round_scale": True})
    (x,) = colmajor.make_inputs(s, "cpu", 1)
    q, storage = colmajor.reference(s, x)
    q_row, sf_row = spec.reference(s, x)
    assert storage.shape == (1, 8) and torch.equal(storage[:, :6].T, sf_row) and (storage[:, 6:] == 0).all()
    assert torch.equal(q.view(torch.uint8), q_row.view(torch.uint8))


def _fake_kernel(spec, shape):
    """A CompiledKernel whose 'launch' writes the reference: exercises checks, allocation, ops views."""
    full = spec.canonical_shape(shape)

    def launch(x, *outs):
        ref = spec.reference({**full, "num_tokens": x.shape[0]}, x)
        for o, r in zip(outs, ref):
            o.copy_(r)

    return CompiledKernel(spec, full, spec.default_config(full), "cpu", "0" * 40, "explicit", Path("."), launch)


def test_colmajor_allocates_and_checks_aligned_scales(colmajor):
    k = _fake_kernel(colmajor, {"num_tokens": 5, "hidden": 256, "group": 128})
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    q, storage = k(x)
    assert q.shape == (5, 256) and storage.shape == (2, 8)
    out = torch.empty(5, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(tkjit.TensorError, match="rounded up to a multiple of 4"):
        k(x, out=(out, torch.empty(2, 5)))
    with pytest.raises(tkjit.TensorError, match=r"expected \(2, align\(num_tokens, 4\)\)"):
        k(x, out=(out, torch.empty(5, 2)))  # a row-major buffer is refused
    k(x, out=(out, torch.empty(2, 8)))


def test_colmajor_check_catches_unwritten_padding(colmajor):
    """tkjit.testing.check poisons outputs: a kernel that skipped the padding would not pass."""
    from tkjit.testing import check

    shape = {"num_tokens": 7, "hidden": 256, "group": 64}
    k = _fake_kernel(colmajor, shape)
    assert check(k, shape, device="cpu") is None
    full = colmajor.canonical_shape(shape)

    def no_padding(x, q, storage):
        rq, rs = colmajor.reference(full, x)
        q.copy_(rq)
        storage[:, :7] = rs[:, :7]

    k._launch = no_padding
    assert "scales: 4 of 32 elements differ" in check(k, shape, device="cpu")


@pytest.mark.parametrize("n", [0, 1, 5, 8, 13])
def test_ops_col_major_view(monkeypatch, n):
    import tkjit.ops
    import tkjit.torch_ops.serve

    seen = []

    def fake_get(name, shape, arch=None, config=None):
        seen.append(name)
        return _fake_kernel(get_spec(name), shape)

    monkeypatch.setattr(tkjit.torch_ops.serve, "get", fake_get)
    x = torch.randn(n, 256) * 3
    q, s = tkjit.ops.per_token_cast(x, 64, col_major_scales=True)
    q_row, s_row = tkjit.ops.per_token_cast(x, 64)
    assert seen == [COLMAJOR, NAME]
    padded = -(-n // 4) * 4
    assert s.shape == (n, 4) and s_row.shape == (n, 4)
    assert torch.equal(s, s_row) and torch.equal(q.view(torch.uint8), q_row.view(torch.uint8))
    if n:  # (an empty batch launches nothing; its view has no meaningful strides)
        assert s.stride() == (1, padded)
        base = s.T  # (4, n) rows of the padded storage
        assert base.stride() == (padded, 1) and s.data_ptr() == base.data_ptr()
        assert s.untyped_storage().nbytes() == 4 * padded * 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,shape,config",
    [
        (NAME, {"hidden": 7168, "group": 128}, None),  # the DeepSeek default: bf16, 16-byte loads
        (NAME, {"hidden": 7168, "group": 7168, "in_dtype": "float32"}, None),  # cross-warp (shared) reduction
        (NAME, {"hidden": 576, "group": 32, "round_scale": True}, {"vec": 16, "group_threads": 2, "threads": 128,
                                                                   "iters": 4}),
        (NAME, {"hidden": 4096, "group": 64, "in_dtype": "float32"}, {"vec": 4, "group_threads": 1, "threads": 512,
                                                                       "iters": 1}),
        (COLMAJOR, {"hidden": 7168, "group": 128}, None),
        (COLMAJOR, {"hidden": 576, "group": 576, "round_scale": True}, None),  # cross-warp reduction
        (COLMAJOR, {"hidden": 576, "group": 32, "in_dtype": "float32"}, {"vec": 4, "group_threads": 2,
                                                                          "threads": 128, "iters": 4}),
        # partial last group (hidden % group != 0) and group 16
        (NAME, {"hidden": 576, "group": 128}, None),
        (NAME, {"hidden": 576, "group": 128, "in_dtype": "float32", "round_scale": True},
         {"vec": 4, "group_threads": 8, "threads": 256, "iters": 4}),
        (NAME, {"hidden": 48, "group": 32}, {"vec": 8, "group_threads": 4, "threads": 128, "iters": 1}),  # all guarded
        (NAME, {"hidden": 64, "group": 128}, None),  # one partial group per token
        (NAME, {"hidden": 7168, "group": 16}, None),
        (NAME, {"hidden": 576, "group": 16, "in_dtype": "float32"}, {"vec": 4, "group_threads": 4, "threads": 128,
                                                                      "iters": 1}),
        (COLMAJOR, {"hidden": 576, "group": 128}, None),
        (COLMAJOR, {"hidden": 2064, "group": 128, "in_dtype": "float32", "round_scale": True},
         {"vec": 8, "group_threads": 2, "threads": 128, "iters": 1}),  # two 16-byte loads per chunk
    ],
)
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, {"num_tokens": 4001, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fdiv_rn" in src  # IEEE divisions whatever the fast-math setting
    if shape.get("round_scale"):
        assert "8388607" in src or "0x7fffff" in src.lower()
    # Column-major: the value store plus the last token's padding store (zeros).
    assert src.count("scales[") == (2 if name == COLMAJOR else 1)
    # Whole groups only: one load and one store loop, no guard. A partial last group adds a guarded
    # loop for the chunk slots it may lack, beside the unguarded one for the slots every group fills
    # (when there are any); with hidden < group no group fills the guarded slots and they compile away.
    h, g, c = shape["hidden"], shape["group"], k.config
    tail = h % g
    whole = (tail // c["vec"]) // c["group_threads"]
    sites = 2 if tail and whole and h > g else 1
    assert src.count("(x + ") == sites and src.count("(out + ") == sites


@pytest.mark.parametrize("n", [0, 5])
def test_fake_impls_partial_last_group(n):
    """torch.compile's fake implementations give ceil(hidden / group) scales, as the kernels do."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tkjit.ops  # noqa: F401  (registers torch.ops.tkjit)

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(n, 576, dtype=torch.bfloat16))
        q, s = torch.ops.tkjit.per_token_cast(x, 128)
        _, storage = torch.ops.tkjit.per_token_cast_colmajor(x, 16)
        q2, s2 = tkjit.ops.per_token_cast(x, 128, col_major_scales=True)
    assert q.shape == (n, 576) and s.shape == (n, 5) and s.dtype == torch.float32
    assert storage.shape == (36, -(-n // 4) * 4)
    assert q2.shape == (n, 576) and s2.shape == (n, 5)


@pytest.mark.parametrize("name", [NAME, COLMAJOR])
def test_partial_last_group_allocates_and_checks_scales(name):
    """The launcher allocates ceil(hidden / group) scale columns and refuses a hidden // group buffer."""
    spec = get_spec(name)
    k = _fake_kernel(spec, {"num_tokens": 5, "hidden": 576, "group": 128})
    x = torch.randn(5, 576, dtype=torch.bfloat16)
    q, s = k(x)
    assert q.shape == (5, 576) and s.shape == ((5, 5) if name == NAME else (5, 8))
    out = torch.empty(5, 576, dtype=torch.float8_e4m3fn)
    short = torch.empty(5, 4) if name == NAME else torch.empty(4, 8)
    with pytest.raises(tkjit.TensorError, match="must be 5"):
        k(x, out=(out, short))
