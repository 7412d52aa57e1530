"""expand_to_fused on the CPU: spec, layout rules, reference semantics, the torch op's plumbing (the kernel
replaced by one writing the reference: it is CUDA-only), compat argument errors, an sm_90a cross-compile."""

import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
import tkjit.torch_ops
from tkjit.compat.tile_kernels import moe as tk_moe
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.spec import validate
from tkjit_kernels.moe import _fused_rows as rows
from tkjit_kernels.moe import expand_to_fused as mod

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

NAME = "expand_to_fused"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(scope="module")
def spec():
    return get_spec(NAME)


def _shape(n=37, p=300, h=576, k=6, dtype="bfloat16"):
    return {"num_tokens": n, "num_expanded_tokens": p, "hidden": h, "num_topk": k, "dtype": dtype}


def test_spec_validates(spec):
    validate(spec)
    assert spec.family == "moe" and spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        cfg = spec.default_config(full, "sm_90a")
        assert cfg in spec.configs(full, "sm_90a")
    d = spec.default_config(spec.canonical_shape(spec.examples[0]), "sm_90a")
    assert d == {"threads": 128, "rows": 1, "vec_bytes": 16, "unroll": 7}  # a whole 7168 bf16 row, 16 B accesses


@pytest.mark.parametrize("dtype", mod.DTYPES)
def test_every_hidden_has_a_valid_default(spec, dtype):
    for h in (*range(1, 80), 576, 1000, 2048, 4096, 7168, 7169, 65536):
        full = spec.canonical_shape(_shape(h=h, dtype=dtype))
        cfg = spec.default_config(full, "sm_90a")
        assert spec.check_config(full, cfg, "sm_90a") == cfg
        vec, hv, lanes, chunk, chunks = rows.geometry(h, rows.ELEM_BYTES[dtype], cfg)
        assert vec * hv == h and chunks * chunk >= hv
        assert cfg["vec_bytes"] == rows.widest_vec(h, rows.ELEM_BYTES[dtype])


def test_layout_covers_every_vector_once():
    for h, elem in ((576, 2), (7168, 2), (4096, 4), (1000, 1), (24, 2)):
        for c in (rows.default(h, elem), {"threads": 64, "rows": 2, "vec_bytes": 8, "unroll": 3}):
            if rows.constraint(h, elem, c):
                continue
            vec, hv, lanes, chunk, chunks = rows.geometry(h, elem, c)
            got = [by * chunk + lane + u * lanes for by in range(chunks) for lane in range(lanes)
                   for u in range(c["unroll"])]
            assert sorted(v for v in got if v < hv) == list(range(hv)), (h, c)


def test_bad_shapes_and_configs(spec):
    with pytest.raises(ShapeError, match="'dtype'='int64' not allowed"):
        spec.canonical_shape(_shape(dtype="int64"))
    with pytest.raises(ShapeError, match="'hidden'=0 below its minimum"):
        spec.canonical_shape(_shape(h=0))
    with pytest.raises(ShapeError, match="'num_topk'=1025 above its maximum"):
        spec.canonical_shape(_shape(k=1025))
    full = spec.canonical_shape(_shape())
    base = spec.default_config(full)
    with pytest.raises(ConfigError, match="not a whole number of 16-byte vectors"):
        spec.check_config(spec.canonical_shape(_shape(h=580)), {**base, "vec_bytes": 16})
    with pytest.raises(ConfigError, match="narrower than one 4-byte element"):
        spec.check_config(spec.canonical_shape(_shape(dtype="float32")), {**base, "vec_bytes": 2})
    with pytest.raises(ConfigError, match="4x the instructions"):
        spec.check_config(full, {**base, "vec_bytes": 4})
    with pytest.raises(ConfigError, match="some lanes idle"):
        spec.check_config(spec.canonical_shape(_shape(h=64)), {**base, "threads": 256, "rows": 1, "unroll": 1})
    with pytest.raises(ConfigError, match="exceeds the"):
        spec.check_config(full, {"threads": 64, "rows": 1, "vec_bytes": 16, "unroll": 3})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, base, "cpu")


def _naive(x, pos, pos_to_expert):
    """Element by element, from the docstring's rules."""
    p = pos_to_expert.shape[0]
    out = torch.zeros(p, x.shape[1], dtype=torch.float64)
    written = [False] * p
    for t in range(pos.shape[0]):
        for k in range(pos.shape[1]):
            q = int(pos[t, k])
            if 0 <= q < p and int(pos_to_expert[q]) >= 0:
                assert not written[q]  # make_inputs never maps two slots to one position
                written[q] = True
                out[q] = x[t].double()
    for q in range(p):
        assert written[q] == (int(pos_to_expert[q]) >= 0)  # no row is both unmapped and non-padding
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
def test_reference_against_naive(spec, seed, dtype):
    s = spec.canonical_shape(_shape(n=23, p=150, h=40, k=6, dtype=dtype))
    x, pos, pte = spec.make_inputs(s, "cpu", seed)
    assert x.dtype == getattr(torch, dtype) and pos.dtype == pte.dtype == torch.int32
    if seed % 2:
        assert bool(((pos >= 150) | (pos < -1)).any())  # odd seeds: out-of-range entries
    ref = spec.reference(s, x, pos, pte)
    assert ref.dtype == x.dtype and ref.shape == (150, 40)
    assert torch.equal(ref.double(), _naive(x, pos, pte))
    # bit-exact: copies keep NaN payloads and signed zeros
    y = x.clone()
    y.view(torch.uint8)[0, : y.element_size()] = 0xFF
    r = spec.reference(s, y, pos, pte)
    used = pos[0][(pos[0] >= 0) & (pos[0] < 150)]
    for q in used.tolist():
        if pte[q] >= 0:
            assert torch.equal(mod._bits(r[q]), mod._bits(y[0]))


def test_reference_padding_wins_and_mapping_more_than_rows(spec):
    x = torch.arange(12.0).view(3, 4)
    pos = torch.tensor([[0, 1], [2, -1], [5, 99]], dtype=torch.int32)
    pte = torch.tensor([3, -1, 0, -1, 7, 1], dtype=torch.int32)
    r = spec.reference(spec.canonical_shape(_shape(n=3, p=6, h=4, k=2, dtype="float32")), x, pos, pte)
    assert r[0].tolist() == x[0].tolist() and r[2].tolist() == x[1].tolist() and r[5].tolist() == x[2].tolist()
    assert r[1].tolist() == [0.0] * 4 and r[3].tolist() == [0.0] * 4  # padding (a slot mapped to 1: dropped)
    assert r[4].tolist() == [0.0] * 4  # neither: the reference's zero; the kernel leaves it unwritten


def test_bytes_moved(spec):
    s = spec.canonical_shape(spec.examples[0])
    assert spec.bytes_moved(s) == (8192 + s["num_expanded_tokens"]) * 7168 * 2 + 8192 * 8 * 4 + s[
        "num_expanded_tokens"] * 4


@pytest.mark.slow
def test_compiles_for_sm90a(cache_dir):
    k = tkjit.get(NAME, _shape(n=4001, p=40000, h=7168, k=8), arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert k.config == {"threads": 128, "rows": 1, "vec_bytes": 16, "unroll": 7}
    assert src.count("*(uint4*)(xs") == 2  # 16-byte loads into registers, 16-byte stores of them (unrolled loops)
    assert "int64_t)pos) * (int64_t)7168" in src  # row offsets in 64 bits


# -- the torch op, its fake, compat ------------------------------------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    """expand_to_fused as a CPU CompiledKernel that writes its reference (real argument checks)."""
    serve_references(monkeypatch, (NAME,))


def _args(n=37, p=300, h=64, k=6, dtype="bfloat16", seed=0):
    spec = get_spec(NAME)
    return spec.make_inputs(spec.canonical_shape(_shape(n=max(n, 1), p=p, h=h, k=k, dtype=dtype)), "cpu", seed)


def test_opcheck(reference_kernels):
    args = _args()
    result = torch.library.opcheck(torch.ops.tkjit.expand_to_fused.default, args, test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
def test_op_matches_reference_and_fake(reference_kernels, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _args(dtype=dtype, seed=1)
    out = tkjit.ops.expand_to_fused(*args)
    ref = get_spec(NAME).reference(None, *args)
    assert torch.equal(mod._bits(out), mod._bits(ref))
    with FakeTensorMode(allow_non_fake_inputs=True) as m:
        fake = torch.ops.tkjit.expand_to_fused(*(m.from_tensor(a) for a in args))
    assert (fake.shape, fake.dtype, fake.stride()) == (out.shape, out.dtype, out.stride())


def test_zero_tokens_and_zero_rows(reference_kernels):
    x = torch.randn(0, 64).bfloat16()
    pos = torch.empty(0, 6, dtype=torch.int32)
    pte = torch.full((9,), -1, dtype=torch.int32)
    out = tkjit.ops.expand_to_fused(x, pos, pte)
    assert out.shape == (9, 64) and not out.any()
    x, pos, _ = _args(n=5)
    out = tkjit.ops.expand_to_fused(x, torch.full_like(pos, -1), torch.empty(0, dtype=torch.int32))
    assert out.shape == (0, 64)


def test_torch_compile_fullgraph(reference_kernels):
    args = _args(seed=2)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, pos, pte):
        return tkjit.ops.expand_to_fused(x * 2, pos, pte) + 1

    assert torch.equal(f(*args), tkjit.ops.expand_to_fused(args[0] * 2, *args[1:]) + 1)


def test_fake_refuses_bad_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(5, 64).bfloat16()
        pos = torch.zeros(5, 6, dtype=torch.int32)
        pte = torch.zeros(40, dtype=torch.int32)
        with pytest.raises(TensorError, match="token_topk_to_pos has dtype torch.int64"):
            torch.ops.tkjit.expand_to_fused(x, pos.long(), pte)
        with pytest.raises(ShapeError, match="'dtype'='int64' not allowed"):
            torch.ops.tkjit.expand_to_fused(x.long(), pos, pte)
        with pytest.raises(TensorError, match="1-D"):
            torch.ops.tkjit.expand_to_fused(x, pos, pte.view(8, 5))


def test_compat_argument_errors(reference_kernels):
    x, pos, pte = _args()
    with pytest.raises(TensorError, match="moe.expand_to_fused: token_topk_to_pos must be torch.int32"):
        tk_moe.expand_to_fused(x, pos.long(), pte)
    with pytest.raises(TensorError, match="x must be 2-D"):
        tk_moe.expand_to_fused(x[0], pos, pte)
    with pytest.raises(TensorError, match="must be contiguous"):
        tk_moe.expand_to_fused(x.t().contiguous().t(), pos, pte)
    with pytest.raises(TensorError, match="token_topk_to_pos has 36 rows, x has 37 tokens"):
        tk_moe.expand_to_fused(x, pos[1:], pte)
    with pytest.raises(NotImplementedError, match="x.dtype='int64'"):
        tk_moe.expand_to_fused(x.long(), pos, pte)
    out = tk_moe.expand_to_fused(x, pos, pte)
    assert torch.equal(out, get_spec(NAME).reference(None, x, pos, pte))
    assert not tk_moe.expand_to_fused(x[:0], pos[:0], pte).any()
