"""group_count and aux_fi specs on the CPU: shapes, configs, reference semantics, C-target runs, the torch
ops and the compat entry points (the C target lowers layout=loop; layout=grid cross-compiles for sm_90a)."""

import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat.tile_kernels import moe as tk_moe
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.spec import validate
from tkjit.testing import check
from tkjit_kernels.moe import group_count as mod

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from common import launches_cooperatively  # noqa: E402

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(scope="module", autouse=True)
def shared_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TKJIT_CACHE_DIR", str(tmp_path_factory.mktemp("group-count-cache")))
        tkjit.reset()
        yield
    tkjit.reset()


@pytest.mark.parametrize("name", ["group_count", "aux_fi"])
def test_spec_validates(name):
    spec = get_spec(name)
    validate(spec)
    assert spec.family == "moe" and spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
        assert spec.default_config(full, "cpu") == {"layout": "loop", "blocks": 1, "threads": 128, "vec": 1}
    # (264 blocks of 1024 threads cannot all be co-resident: a cooperative grid refuses them)
    assert len(spec.configs(spec.canonical_shape(spec.examples[0]), "sm_90a")) == 7 * 4 * 3 - 3
    assert not any(o.zeroed for o in spec.outputs)  # the kernel writes (or zeroes) all of them: one launch


def test_default_grid_one_block_then_wide():
    # One block while it covers the entries in a step or two; beyond, TileKernels' launch shape (two
    # blocks of 128 threads per H200 SM): a narrower grid measured slower than it on the H200.
    small = mod.default({"num_tokens": 64, "num_topk": 8, "num_groups": 256})
    big = mod.default({"num_tokens": 1 << 20, "num_topk": 8, "num_groups": 256})
    assert small["blocks"] == 1 and (big["blocks"], big["threads"]) == (264, 128)
    assert mod.default({"num_tokens": 4096, "num_topk": 8, "num_groups": 256})["blocks"] == 264
    # vec=8 (four 16-byte loads in flight, TileKernels' row per thread) once the grid takes 4+ steps of vec=2
    assert mod.default({"num_tokens": 8192, "num_topk": 8, "num_groups": 256})["vec"] == 2
    assert mod.default({"num_tokens": 65536, "num_topk": 8, "num_groups": 256})["vec"] == 8


def test_bad_shapes_and_configs():
    spec = get_spec("group_count")
    with pytest.raises(ShapeError, match="'num_groups'=8193 above its maximum 8192"):
        spec.canonical_shape({"num_tokens": 4, "num_topk": 8, "num_groups": 8193})
    with pytest.raises(ShapeError, match="'num_topk'=65 above its maximum 64"):
        spec.canonical_shape({"num_tokens": 4, "num_topk": 65, "num_groups": 8})
    full = spec.canonical_shape({"num_tokens": 4, "num_topk": 8, "num_groups": 8})
    with pytest.raises(ConfigError, match="layout=loop is one thread"):
        spec.check_config(full, {"layout": "loop", "blocks": 4, "threads": 128, "vec": 1})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, {"layout": "grid", "blocks": 1, "threads": 128, "vec": 1}, "cpu")
    with pytest.raises(ConfigError, match="for the C target only"):
        spec.check_config(full, {"layout": "loop", "blocks": 1, "threads": 128, "vec": 1}, "sm_90a")
    with pytest.raises(ConfigError, match="must be co-resident"):
        spec.check_config(full, {"layout": "grid", "blocks": 264, "threads": 1024, "vec": 2}, "sm_90a")


def _bincount(idx, n):
    """An independent count: a Python loop over the entries."""
    out = [0] * n
    for v in idx.reshape(-1).tolist():
        if 0 <= v < n:
            out[v] += 1
    return out


def test_references_hand_checked():
    idx = torch.tensor([[0, 2, -1, 2], [5, 3, 2, 7], [-5, 1 << 40, 3, 0]])
    assert mod.group_count_reference({"num_groups": 6}, idx).tolist() == [2, 0, 3, 2, 0, 1]
    fi, counts = mod.aux_fi_reference({"num_experts": 6}, idx, 2)
    assert counts.tolist() == [2, 0, 3, 2, 0, 1, 0] and counts.dtype == torch.int32
    assert fi.dtype == torch.float32
    # TileKernels' torch formula, on the CPU: counts.float() * num_experts / (num_tokens * num_aux_topk)
    want = torch.tensor([2, 0, 3, 2, 0, 1]).float() * 6 / (3 * 2)
    assert torch.equal(fi, want)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_reference_matches_tilekernels_torch_formula(seed):
    spec = get_spec("aux_fi")
    for n, k, e in ((4001, 8, 256), (4001, 9, 72), (1, 2, 72), (777, 6, 256)):
        shape = spec.canonical_shape({"num_tokens": n, "num_topk": k, "num_experts": e})
        idx, k_aux = spec.make_inputs(shape, "cpu", seed)
        fi, counts = spec.reference(shape, idx, k_aux)
        valid = idx[(idx >= 0) & (idx < e)]
        c = torch.zeros(e, dtype=torch.int64).scatter_add_(0, valid, torch.ones_like(valid))
        assert counts[:e].tolist() == c.tolist() == _bincount(idx, e)
        assert torch.equal(fi, c.float() * e / (n * k_aux))  # bit-exact with torch on the CPU


def test_make_inputs_cover_padding_duplicates_and_out_of_range():
    spec = get_spec("group_count")
    shape = spec.canonical_shape({"num_tokens": 512, "num_topk": 8, "num_groups": 72})
    (a,) = spec.make_inputs(shape, "cpu", 0)
    (b,) = spec.make_inputs(shape, "cpu", 1)
    assert a.dtype == torch.int64 and a.shape == (512, 8)
    assert (a == -1).any() and (a == 36).float().mean() > 0.04  # padding, a popular id
    assert ((a < -1) | (a >= 72)).sum() == 0 and ((b < -1) | (b >= 72)).sum() > 0
    assert any(len(set(r)) < 8 for r in a.tolist())  # duplicates inside rows
    assert torch.equal(a, spec.make_inputs(shape, "cpu", 0)[0])


@pytest.mark.parametrize("name,ids", [("group_count", "num_groups"), ("aux_fi", "num_experts")])
def test_c_target_runs(name, ids):
    for e, k in ((72, 8), (256, 9), (1, 1)):
        kern = tkjit.get(name, {"num_tokens": 100, "num_topk": k, ids: e}, arch="cpu")
        for n in (1, 7, 4001):
            for seed in (0, 1, 2):
                assert check(kern, {"num_tokens": n, "num_topk": k, ids: e}, device="cpu", seed=seed) is None
    # Outputs are not zero-filled before the launch: the kernel writes every element (into garbage here).
    shape = {"num_tokens": 37, "num_topk": 8, ids: 72}
    spec = get_spec(name)
    args = spec.make_inputs(spec.canonical_shape(shape), "cpu", 1)
    ref = spec.reference(spec.canonical_shape(shape), *args)
    outs = [torch.full_like(r, 7) for r in (ref if isinstance(ref, tuple) else (ref,))]
    kern = tkjit.get(name, shape, arch="cpu")
    got = kern(*args, out=outs[0] if len(outs) == 1 else outs)
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        assert torch.equal(g, r)


def test_aux_fi_zero_tokens_and_extremes():
    kern = tkjit.get("aux_fi", {"num_tokens": 100, "num_topk": 8, "num_experts": 72}, arch="cpu")
    for _ in range(3):  # the first call is checked in full, the later ones go through its plan
        torch.full((72,), float("nan"))  # freed memory that an unfilled output could reuse
        fi, counts = kern(torch.empty(0, 8, dtype=torch.int64), 8)
        # fi is not zero-filled when launched (the kernel writes it all); an empty batch launches nothing
        assert torch.equal(fi, torch.zeros(72)) and torch.equal(counts, torch.zeros(73, dtype=torch.int32))
    for _ in range(3):  # into out= tensors full of garbage: an empty batch's outputs are zeros there too
        fi, counts = torch.full((72,), float("nan")), torch.full((73,), 7, dtype=torch.int32)
        kern(torch.empty(0, 8, dtype=torch.int64), 8, out=(fi, counts))
        assert torch.equal(fi, torch.zeros(72)) and torch.equal(counts, torch.zeros(73, dtype=torch.int32))
    idx = torch.full((5, 8), 3, dtype=torch.int64)
    fi, _ = kern(idx, 0)  # num_aux_topk = 0: inf where counted, nan elsewhere (torch: x / 0)
    assert fi[3] == float("inf") and fi[[0, 1, 2]].isnan().all()
    with pytest.raises(TensorError, match="missing scalar num_aux_topk"):
        kern(idx)


@pytest.mark.slow
@pytest.mark.parametrize("name,ids,config", [
    ("group_count", "num_groups", {"layout": "grid", "blocks": 264, "threads": 256, "vec": 2}),
    ("aux_fi", "num_experts", {"layout": "grid", "blocks": 132, "threads": 256, "vec": 2}),
    ("aux_fi", "num_experts", {"layout": "grid", "blocks": 264, "threads": 128, "vec": 8}),
])
def test_compiles_for_sm90a(name, ids, config):
    kern = tkjit.get(name, {"num_tokens": 4001, "num_topk": 9, ids: 72}, arch="sm_90a", config=config)
    src = (kern.path / "kernel.cu").read_text()
    assert "AtomicAdd" in src and "longlong2" in src  # shared counters, 16-byte loads
    # blocks > 1: the grid zeroes its atomics' output itself, then a grid barrier (a cooperative launch)
    assert "cooperative_groups::this_grid().sync()" in src
    assert launches_cooperatively(kern.path)
    if name == "aux_fi":
        assert "__threadfence" in src and "AtomicAddRet" in src  # the ticket of the last block
        assert "__fdividef" not in src


# -- torch ops and compat --------------------------------------------------------------------------

def _idx(n=37, k=8, e=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, e, (n, k), generator=g)


def test_ops_and_compat_match_the_reference():
    idx = _idx()
    counts = torch.tensor(_bincount(idx, 72), dtype=torch.int32)
    assert torch.equal(tkjit.ops.group_count(idx, 72), counts)
    assert torch.equal(tk_moe.group_count(idx, 72), counts)
    want = counts.float() * 72 / (37 * 6)
    assert torch.equal(tkjit.ops.aux_fi(idx, 72, 6), want)
    assert torch.equal(tk_moe.aux_fi(idx, 72, 6), want)
    empty = torch.empty(0, 8, dtype=torch.int64)
    assert torch.equal(tk_moe.group_count(empty, 72), torch.zeros(72, dtype=torch.int32))
    assert torch.equal(tk_moe.aux_fi(empty, 72, 8), torch.zeros(72))


@pytest.mark.parametrize("op,args", [
    ("group_count", (72,)), ("aux_fi", (72, 6)),
])
@pytest.mark.parametrize("tokens", [0, 37])
def test_opcheck_and_fake(op, args, tokens):
    from torch._subclasses.fake_tensor import FakeTensorMode

    f = getattr(torch.ops.tkjit, op).default
    idx = _idx(tokens)
    result = torch.library.opcheck(f, (idx, *args), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result
    real = f(idx, *args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = f(mode.from_tensor(idx), *args)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


def test_torch_compile_fullgraph():
    idx = _idx()

    def fn(x):
        return tkjit.ops.group_count(x, 72), tkjit.ops.aux_fi(x, 72, 8)

    got = torch.compile(fn, fullgraph=True)(idx)
    want = fn(idx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_check_indices(monkeypatch):
    monkeypatch.setenv("TKJIT_CHECK_INDICES", "1")
    idx = _idx()
    idx[3, 2] = 72
    with pytest.raises(TensorError, match=r"group_count: group_idx\[3, 2\] = 72 is out of range \[-1, 72\)"):
        tkjit.ops.group_count(idx, 72)
    with pytest.raises(TensorError, match=r"aux_fi: topk_idx\[3, 2\] = 72"):
        tkjit.ops.aux_fi(idx, 72, 8)


def test_compat_argument_errors():
    idx = _idx()
    with pytest.raises(TensorError, match="group_idx must be 2-D"):
        tk_moe.group_count(idx[0], 72)
    with pytest.raises(TensorError, match="group_idx must be torch.int64"):
        tk_moe.group_count(idx.int(), 72)
    with pytest.raises(TensorError, match="topk_idx must be contiguous"):
        tk_moe.aux_fi(idx.t(), 72, 8)
    with pytest.raises(ShapeError, match="num_aux_topk must be an int"):
        tk_moe.aux_fi(idx, 72, 1.5)
    with pytest.raises(ShapeError, match=r"num_groups \(0\) must be >= 1"):
        tk_moe.group_count(idx, 0)
    with pytest.raises(NotImplementedError, match="num_groups=9000"):
        tk_moe.group_count(idx, 9000)
