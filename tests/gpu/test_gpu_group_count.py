"""group_count and aux_fi on the GPU: every config of the space against the exact reference, the real
tile_kernels package as oracle, 0 tokens, out-of-range ids, the torch ops (opcheck, torch.compile,
CUDA graphs) and the compat entry points."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.pool import compile_many
from tkjit.testing import check

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
IDS = {"group_count": "num_groups", "aux_fi": "num_experts"}
TOKENS = (1, 7, 4001, 65536)
STATIC = [(8, 256), (9, 72), (2, 72), (6, 256), (1, 1)]  # (num_topk, ids)


def _shape(name, k, e, n=4001):
    return {"num_tokens": n, "num_topk": k, IDS[name]: e}


@pytest.mark.parametrize("name", list(IDS))
def test_every_config_every_size(name):
    spec = tkjit.get_spec(name)
    jobs = []
    for k, e in STATIC[1:2]:  # num_topk 9: the vec=2 / vec=8 tail steps (81 configs)
        full = spec.canonical_shape(_shape(name, k, e))
        jobs += [(name, spec.static_shape(full), c, "sm_90a", "explicit") for c in spec.configs(full, "sm_90a")]
    errors = compile_many(jobs)
    assert all(err is None for _, err in errors), [err for _, err in errors if err][:5]
    for k, e in STATIC[1:2]:
        full = spec.canonical_shape(_shape(name, k, e))
        for c in spec.configs(full, "sm_90a"):
            kern = tkjit.get(name, full, config=c)
            for n in TOKENS:
                for seed in (0, 1):  # odd seeds: out-of-range ids (skipped)
                    assert check(kern, _shape(name, k, e, n), seed=seed) is None
    # 0 tokens: zeros, nothing launched
    kern = tkjit.get(name, _shape(name, 8, 256))
    args = (torch.empty(0, 8, dtype=torch.int64, device="cuda"),) + ((8,) if name == "aux_fi" else ())
    out = kern(*args)
    for o in out if isinstance(out, tuple) else (out,):
        assert not o.any()


@pytest.mark.parametrize("name", list(IDS))
@pytest.mark.parametrize("config", [{"layout": "grid", "blocks": 264, "threads": 128, "vec": 8},
                                    {"layout": "grid", "blocks": 132, "threads": 1024, "vec": 2},
                                    {"layout": "grid", "blocks": 1, "threads": 512, "vec": 2}])
def test_outputs_need_no_fill(name, config):
    # No output is zero-filled before the launch (blocks > 1 zero theirs in the kernel, before a grid
    # barrier): out= tensors full of garbage, called again and again, give the reference every time.
    shape = _shape(name, 8, 256, 65536)
    spec = tkjit.get_spec(name)
    full = spec.canonical_shape(shape)
    kern = tkjit.get(name, full, config=config)
    args = spec.make_inputs(full, "cuda", 1)
    ref = spec.reference(full, *args)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = [torch.full_like(r, 7) for r in refs]
    for _ in range(3):
        got = kern(*args, out=outs[0] if len(outs) == 1 else outs)
        for g, r in zip(got if isinstance(got, tuple) else (got,), refs):
            assert torch.equal(g, r)


@pytest.mark.parametrize("name", list(IDS))
def test_default_configs_and_hot_counter(name):
    for k, e in STATIC:
        for n in TOKENS:
            kern = tkjit.get(name, _shape(name, k, e, n))
            assert check(kern, _shape(name, k, e, n), seed=3) is None
    # every entry on one id: maximal shared-atomic contention, counts near 2**19
    idx = torch.full((65536, 8), 5, dtype=torch.int64, device="cuda")
    got = tkjit.ops.group_count(idx, 256) if name == "group_count" else tkjit.ops.aux_fi(idx, 256, 8)
    assert float(got[5]) == (65536 * 8 if name == "group_count" else 256.0) and int((got != 0).sum()) == 1


def _tk_cases():
    for n in (4001, 8192):
        for k in (2, 6, 8, 9):
            for e in (72, 256):
                yield n, k, e


def test_against_tile_kernels():
    tk = pytest.importorskip("tile_kernels")
    from tile_kernels.torch import moe as tk_torch

    for n, k, e in _tk_cases():
        idx = torch.randint(-1, e, (n, k), device="cuda")
        assert torch.equal(tkjit.ops.group_count(idx, e), tk.moe.group_count(idx, e))
        for k_aux in (k, 1):
            got = tkjit.ops.aux_fi(idx, e, k_aux)
            # TileKernels' kernel sums integer counts per block then adds float partials across
            # blocks; its CPU torch reference is the exact target; the CUDA torch reference
            # multiplies by a reciprocal (may differ by one ulp).
            assert torch.equal(got.cpu(), tk_torch.aux_fi(idx.cpu(), e, k_aux))
            ref_cuda = tk_torch.aux_fi(idx, e, k_aux)
            assert torch.allclose(got, ref_cuda, rtol=2 ** -23, atol=0)
            tk_out = tk.moe.aux_fi(idx, e, k_aux)
            assert torch.allclose(got, tk_out, rtol=1e-5, atol=0)


def test_ops_opcheck_compile_and_cuda_graph():
    idx = torch.randint(-1, 256, (4001, 8), device="cuda")
    for op, args in ((torch.ops.tkjit.group_count.default, (256,)), (torch.ops.tkjit.aux_fi.default, (256, 8))):
        torch.library.opcheck(op, (idx, *args))
    fn = lambda x: (tkjit.ops.group_count(x, 256), tkjit.ops.aux_fi(x, 256, 8))  # noqa: E731
    eager = fn(idx)
    compiled = torch.compile(fn, fullgraph=True)(idx)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    fn(idx)  # warm
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(idx)
    idx.copy_(torch.randint(-1, 256, (4001, 8), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    want = fn(idx)
    assert all(torch.equal(a, b) for a, b in zip(out, want))


def test_compat_and_bad_input():
    from tkjit.compat.tile_kernels import moe
    from tkjit.errors import TensorError

    idx = torch.randint(-1, 256, (4001, 8), device="cuda")
    assert torch.equal(moe.group_count(idx, 256), tkjit.ops.group_count(idx, 256))
    assert torch.equal(moe.aux_fi(idx, 256, 8), tkjit.ops.aux_fi(idx, 256, 8))
    with pytest.raises(TensorError, match="int64"):
        moe.group_count(idx.int(), 256)
    with pytest.raises(TensorError, match="contiguous"):
        moe.aux_fi(idx[:, ::2], 256, 8)
