"""expand_to_fused_with_sf (and its _colmajor twin) on the CPU: spec, reference semantics against a
TileKernels-style reference, the torch op's plumbing (the kernel replaced by one writing the reference: it
is CUDA-only), the col-major view and its strides, compat argument errors, an sm_90a cross-compile."""

from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
import tkjit.torch_ops.serve
from tkjit.compat.tile_kernels import moe as tk_moe
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.kernel import CompiledKernel
from tkjit.registry import get_spec
from tkjit.spec import validate
from tkjit_kernels.moe import expand_to_fused_with_sf as mod
from tkjit_kernels.moe.expand_to_fused import _bits

ROW, COL = "expand_to_fused_with_sf", "expand_to_fused_with_sf_colmajor"
NAMES = (ROW, COL)
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _shape(n=37, p=301, h=576, k=6, npc=128, dtype="float8_e4m3fn", sf_dtype="float32"):
    return {"num_tokens": n, "num_expanded_tokens": p, "hidden": h, "num_topk": k, "num_per_channels": npc,
            "dtype": dtype, "sf_dtype": sf_dtype}


@pytest.mark.parametrize("name", NAMES)
def test_spec_validates(name):
    spec = get_spec(name)
    validate(spec)
    assert spec.family == "moe" and spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
    d = spec.default_config(spec.canonical_shape(spec.examples[0]), "sm_90a")
    assert d == {"threads": 128, "rows": 2, "vec_bytes": 16, "unroll": 7}  # a whole 7168-byte fp8 row per 64 lanes
    assert tkjit.get_spec("expand_to_fused").space == spec.space  # the same row layout


def test_hidden_sf_as_tile_kernels():
    for h, npc, sdt, want in ((7168, 128, "float32", 56), (7168, 32, "float32", 224), (7168, 32, "int32", 56),
                              (576, 128, "float32", 5), (576, 128, "int32", 2), (100, 32, "int32", 1)):
        assert mod.hidden_sf(_shape(h=h, npc=npc, sf_dtype=sdt)) == want


def test_bad_shapes_and_configs():
    spec = get_spec(ROW)
    with pytest.raises(ShapeError, match="'num_per_channels'=64 not allowed"):
        spec.canonical_shape(_shape(npc=64))
    with pytest.raises(ShapeError, match="'sf_dtype'='bfloat16' not allowed"):
        spec.canonical_shape(_shape(sf_dtype="bfloat16"))
    with pytest.raises(ShapeError, match="'dtype'='int64' not allowed"):
        spec.canonical_shape(_shape(dtype="int64"))
    full = spec.canonical_shape(_shape())
    base = spec.default_config(full)
    with pytest.raises(ConfigError, match="not a whole number of 16-byte vectors"):
        spec.check_config(spec.canonical_shape(_shape(h=580)), {**base, "vec_bytes": 16})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, base, "cpu")


def _fused_mapping(topk, num_experts, alignment):
    """get_fused_mapping's layout, written out: experts in order, each segment align(count, alignment) rows,
    entries in increasing token * num_topk + slot, then padding (-1)."""
    n, k = topk.shape
    pos = torch.full((n, k), -1, dtype=torch.int32)
    pte = []
    for e in range(num_experts):
        slots = [(t, s) for t in range(n) for s in range(k) if int(topk[t, s]) == e]
        for t, s in slots:
            pos[t, s] = len(pte)
            pte.append(e)
        pte += [-1] * (-(-len(slots) // alignment) * alignment - len(slots))
    return pos, torch.tensor(pte, dtype=torch.int32)


def _tk_style(x, x_sf, pos, pte, col_major):
    """TileKernels' torch reference, from its semantics: zeros, then every slot >= 0 copied (data and sf);
    col-major: out_sf is the .T of a (hidden_sf, align(p, 4)) zero buffer's first p columns."""
    p, sw = pte.shape[0], x_sf.shape[1]
    out = torch.zeros((p, x.shape[1]), dtype=x.dtype)
    if col_major:
        out_sf = torch.zeros((sw, -(-p // 4) * 4), dtype=x_sf.dtype)[:, :p].T
    else:
        out_sf = torch.zeros((p, sw), dtype=x_sf.dtype)
    flat = pos.reshape(-1)
    mask = flat >= 0
    k = pos.shape[1]
    _bits(out)[flat[mask].long()] = _bits(x).repeat_interleave(k, 0)[mask]
    out_sf[flat[mask].long()] = x_sf.repeat_interleave(k, 0)[mask]
    return out, out_sf


def _routed(n, k, e, h, npc, dtype, sf_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    topk[torch.rand(n, k, generator=g) < 0.1] = -1
    pos, pte = _fused_mapping(topk, e, 8)
    spec = get_spec(ROW)
    x, x_sf, _, _ = spec.make_inputs(spec.canonical_shape(_shape(n=n, p=1, h=h, npc=npc, k=k, dtype=dtype,
                                                                 sf_dtype=sf_dtype)), "cpu", seed)
    return x, x_sf, pos, pte


@pytest.mark.parametrize("dtype,sf_dtype,npc", [("float8_e4m3fn", "float32", 128), ("float8_e4m3fn", "int32", 32),
                                                ("bfloat16", "float32", 32), ("int8", "int32", 128)])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_tile_kernels_style(dtype, sf_dtype, npc, seed):
    x, x_sf, pos, pte = _routed(23, 6, 9, 320, npc, dtype, sf_dtype, seed)
    s = _shape(n=23, p=pte.shape[0], h=320, npc=npc, k=6, dtype=dtype, sf_dtype=sf_dtype)
    out, out_sf = mod.reference(s, x, x_sf, pos, pte)
    want, want_sf = _tk_style(x, x_sf, pos, pte, False)
    assert torch.equal(_bits(out), _bits(want)) and torch.equal(_bits(out_sf), _bits(want_sf))
    out_c, storage = mod.reference_colmajor(s, x, x_sf, pos, pte)
    want_c, want_sf_c = _tk_style(x, x_sf, pos, pte, True)
    p = pte.shape[0]
    assert storage.shape == (x_sf.shape[1], -(-p // 4) * 4) and not storage[:, p:].any()
    view = storage[:, :p].T
    assert view.stride() == want_sf_c.stride() and torch.equal(_bits(view), _bits(want_sf_c))
    assert torch.equal(_bits(out_c), _bits(want_c))
    assert not out[pte < 0].view(torch.uint8).any() and not out_sf[pte < 0].any()  # padding rows zero


def test_reference_skips_out_of_range_and_padding():
    x = torch.arange(12.0).view(3, 4)
    x_sf = torch.tensor([[1.0], [2.0], [3.0]])
    pos = torch.tensor([[0, 1], [2, -1], [5, 99]], dtype=torch.int32)
    pte = torch.tensor([3, -1, 0, -1, 7, 1], dtype=torch.int32)
    out, sf = mod.reference(_shape(n=3, p=6, h=4, k=2, dtype="float32"), x, x_sf, pos, pte)
    assert sf.flatten().tolist() == [1.0, 0.0, 2.0, 0.0, 0.0, 3.0]  # padding row 1 stays zero; 99 skipped
    assert out[5].tolist() == x[2].tolist() and out[1].tolist() == [0.0] * 4


def test_make_inputs_avoid_poison():
    spec = get_spec(COL)
    for dtype, sdt in (("int8", "int32"), ("uint8", "float32")):
        x, x_sf, pos, pte = spec.make_inputs(spec.canonical_shape(_shape(n=300, dtype=dtype, sf_dtype=sdt)), "cpu", 1)
        assert int(x.min()) > torch.iinfo(x.dtype).min if dtype == "int8" else int(x.max()) < 255
        assert not x_sf.isnan().any() if sdt == "float32" else int(x_sf.min()) > -(2**31)
        assert bool(((pos >= 301) | (pos < -1)).any())  # odd seeds: out-of-range entries


def test_bytes_moved():
    s = get_spec(COL).canonical_shape(_shape(n=100, p=1001, h=7168, k=8))
    assert get_spec(COL).bytes_moved(s) - get_spec(ROW).bytes_moved(s) == 3 * 56 * 4  # 1004 padded sf columns


@pytest.mark.slow
def test_compiles_for_sm90a(cache_dir):
    k = tkjit.get(COL, _shape(n=4001, p=40001, h=7168, k=8, npc=32, sf_dtype="int32"), arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert k.config == {"threads": 128, "rows": 2, "vec_bytes": 16, "unroll": 7}
    assert src.count("*(fp8_e4_16_t*)(xs") == 2  # 16-byte loads into registers, 16-byte stores of them
    assert "int* __restrict__ out_sf" in src and "const int* __restrict__ x_sf" in src
    # sf words index the column-major storage in 64 bits: word * align(p, 4) + pos
    assert "(((int64_t)num_expanded_tokens) + (int64_t)3) >> (int64_t)2)) * (int64_t)4) + ((int64_t)pos))" in src


# -- the torch op, its fake, the view, compat -----------------------------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    """Both specs as CPU CompiledKernels that write their references (real argument checks)."""
    real_get = tkjit.torch_ops.serve.get

    def get(name, shape, arch=None, config=None):
        if name not in NAMES:
            return real_get(name, shape, arch=arch, config=config)
        spec = tkjit.get_spec(name)
        full = spec.canonical_shape(shape)

        def launch(x, x_sf, pos, pte, out, out_sf):
            ref, ref_sf = spec.reference(full, x, x_sf, pos, pte)
            out.copy_(ref)
            out_sf.copy_(ref_sf)

        return CompiledKernel(spec, full, spec.default_config(full, "sm_90a"), "cpu", "0" * 40, "explicit",
                              Path("."), launch)

    monkeypatch.setattr(tkjit.torch_ops.serve, "get", get)


def _args(n=37, p=301, h=64, k=6, npc=32, dtype="float8_e4m3fn", sf_dtype="float32", seed=0):
    spec = get_spec(ROW)
    return spec.make_inputs(spec.canonical_shape(_shape(n=max(n, 1), p=p, h=h, k=k, npc=npc, dtype=dtype,
                                                        sf_dtype=sf_dtype)), "cpu", seed)


@pytest.mark.parametrize("col_major", [False, True])
def test_opcheck(reference_kernels, col_major):
    x, x_sf, pos, pte = _args(dtype="bfloat16")  # (opcheck's schema test multiplies x: no fp8 there)
    result = torch.library.opcheck(torch.ops.tkjit.expand_to_fused_with_sf.default,
                                   (x, x_sf, 32, pos, pte, col_major), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


@pytest.mark.parametrize("col_major", [False, True])
@pytest.mark.parametrize("dtype,sf_dtype", [("float8_e4m3fn", "float32"), ("bfloat16", "int32")])
def test_op_matches_reference_view_and_fake(reference_kernels, col_major, dtype, sf_dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, x_sf, pos, pte = _args(dtype=dtype, sf_dtype=sf_dtype, seed=1)
    out, out_sf = tkjit.ops.expand_to_fused_with_sf((x, x_sf), 32, pos, pte, col_major)
    ref, ref_sf = get_spec(ROW).reference(None, x, x_sf, pos, pte)
    assert torch.equal(_bits(out), _bits(ref)) and torch.equal(out_sf, ref_sf)
    assert out_sf.stride() == ((1, 304) if col_major else (x_sf.shape[1], 1))  # 301 rows padded to 304
    if col_major:
        storage = out_sf.T.as_strided((x_sf.shape[1], 304), (304, 1))
        assert not storage[:, 301:].any()  # the padding columns are zero
    with FakeTensorMode(allow_non_fake_inputs=True) as m:
        fx, fsf = tkjit.ops.expand_to_fused_with_sf((m.from_tensor(x), m.from_tensor(x_sf)), 32, m.from_tensor(pos),
                                                    m.from_tensor(pte), col_major)
    assert (fx.shape, fx.dtype, fx.stride()) == (out.shape, out.dtype, out.stride())
    assert (fsf.shape, fsf.dtype, fsf.stride()) == (out_sf.shape, out_sf.dtype, out_sf.stride())


@pytest.mark.parametrize("col_major", [False, True])
def test_zero_tokens_and_zero_rows(reference_kernels, col_major):
    x = torch.randn(0, 256).to(torch.float8_e4m3fn)
    out, sf = tkjit.ops.expand_to_fused_with_sf((x, torch.empty(0, 2)), 128, torch.empty(0, 6, dtype=torch.int32),
                                                torch.full((9,), -1, dtype=torch.int32), col_major)
    assert out.shape == (9, 256) and sf.shape == (9, 2) and not out.view(torch.uint8).any() and not sf.any()
    assert sf.stride() == ((1, 12) if col_major else (2, 1))
    with pytest.raises(TensorError, match="axis 1 must be 2"):
        tkjit.ops.expand_to_fused_with_sf((x, torch.empty(0, 3)), 128, torch.empty(0, 6, dtype=torch.int32),
                                          torch.full((9,), -1, dtype=torch.int32), col_major)
    x, x_sf, pos, _ = _args(n=5)
    out, sf = tkjit.ops.expand_to_fused_with_sf((x, x_sf), 32, torch.full_like(pos, -1),
                                                torch.empty(0, dtype=torch.int32), col_major)
    assert out.shape == (0, 64) and sf.shape == (0, 2)


def test_torch_compile_fullgraph(reference_kernels):
    x, x_sf, pos, pte = _args(seed=2)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, x_sf, pos, pte):
        a, a_sf = tkjit.ops.expand_to_fused_with_sf((x, x_sf * 2), 32, pos, pte, True)
        return a, a_sf + 1

    got, got_sf = f(x, x_sf, pos, pte)
    want, want_sf = tkjit.ops.expand_to_fused_with_sf((x, x_sf * 2), 32, pos, pte, True)
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(got_sf, want_sf + 1)


def test_fake_refuses_bad_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.expand_to_fused_with_sf
    with FakeTensorMode():
        x = torch.randn(5, 256).to(torch.float8_e4m3fn)
        sf = torch.ones(5, 2)
        pos = torch.zeros(5, 6, dtype=torch.int32)
        pte = torch.zeros(40, dtype=torch.int32)
        with pytest.raises(TensorError, match=r"x_sf has shape \(5, 3\), expected \(num_tokens, 2\) \(axis 1 must"):
            op(x, torch.ones(5, 3), 128, pos, pte)
        with pytest.raises(TensorError, match="axis 1 must be 1"):
            op(x, sf.int(), 128, pos, pte, True)  # packed: ceil(2 / 4) words
        with pytest.raises(ShapeError, match="'num_per_channels'=64 not allowed"):
            op(x, sf, 64, pos, pte)
        with pytest.raises(TensorError, match="token_topk_to_pos has dtype torch.int64"):
            op(x, sf, 128, pos.long(), pte)
        with pytest.raises(TensorError, match="1-D"):
            op(x, sf, 128, pos, pte.view(8, 5))


def test_compat(reference_kernels):
    f = tk_moe.expand_to_fused_with_sf
    x, x_sf, pos, pte = _args(h=256, npc=128)  # hidden_sf 2
    with pytest.raises(TensorError, match="QuantTensor"):
        f(x, 128, pos, pte)
    with pytest.raises(TensorError, match="x\\[1\\] \\(sf\\) must be torch.float32, torch.int32"):
        f((x, x_sf.double()), 128, pos, pte)
    with pytest.raises(TensorError, match="token_topk_to_pos must be torch.int32"):
        f((x, x_sf), 128, pos.long(), pte)
    with pytest.raises(TensorError, match="must be contiguous"):
        f((x, x_sf.t().contiguous().t()), 128, pos, pte)
    with pytest.raises(ShapeError, match="num_per_channels must be 32 or 128, got 64"):
        f((x, x_sf), 64, pos, pte)
    with pytest.raises(TensorError, match="x\\[1\\] \\(sf\\) has 36 rows, x\\[0\\] has 37 tokens"):
        f((x, x_sf[1:]), 128, pos, pte)
    with pytest.raises(TensorError, match="has 2 columns, expected 8"):
        f((x, x_sf), 32, pos, pte)
    with pytest.raises(ShapeError, match="needs use_tma_aligned_col_major_sf=True"):
        f((x, x_sf[:, :1].int()), 128, pos, pte)
    with pytest.raises(NotImplementedError, match="x\\[0\\].dtype='int64'"):
        f((x.view(torch.uint8)[:, :32].contiguous().view(torch.int64), x_sf[:, :1].contiguous()), 128, pos, pte)
    for col_major in (False, True):
        out, out_sf = f((x, x_sf), 128, pos, pte, col_major)
        want, want_sf = get_spec(ROW).reference(None, x, x_sf, pos, pte)
        assert torch.equal(_bits(out), _bits(want)) and torch.equal(out_sf, want_sf)
        _, tk_sf = _tk_style(x, x_sf, torch.where((pos < 301) & (pos >= -1), pos, -1), pte, col_major)
        assert out_sf.stride() == tk_sf.stride()
    packed = torch.randint(0, 2**30, (37, 1), dtype=torch.int32)  # ceil(ceil(256 / 128) / 4) = 1 word
    out, out_sf = f((x, packed), 128, pos, pte, True)
    assert out_sf.dtype == torch.int32 and out_sf.shape == (301, 1) and out_sf.stride() == (1, 304)
    out, out_sf = f((x[:0], x_sf[:0]), 128, pos[:0], pte, True)
    assert not out.view(torch.uint8).any() and not out_sf.any() and out_sf.shape == (301, 2)
