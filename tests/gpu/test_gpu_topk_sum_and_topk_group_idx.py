"""topk_sum_and_topk_group_idx on the GPU: every config of the space against the exact reference (odd
seeds: ties, signed zeros, -inf), the real tile_kernels package as oracle, the op (opcheck,
torch.compile, CUDA graphs) and the compat entry point."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.pool import compile_many
from tkjit.testing import check

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME = "topk_sum_and_topk_group_idx"
TOKENS = (1, 7, 4001, 65536)
# (num_groups, experts per group, num_topk_sum, num_topk_groups)
STATIC = [(8, 32, 2, 4), (8, 9, 1, 2), (12, 6, 2, 4), (16, 16, 2, 4), (4, 18, 1, 2), (32, 2, 2, 5), (1, 1, 1, 1)]


def _shape(g, epg, ks, kg, n=4001):
    return {"num_tokens": n, "num_groups": g, "num_experts_per_group": epg, "num_topk_sum": ks, "num_topk_groups": kg}


EVERY = [STATIC[0], STATIC[2], STATIC[5], STATIC[6]]  # every config here; the default at the rest


def test_default_config_every_shape():
    for s in STATIC:
        for n in TOKENS:
            assert check(tkjit.get(NAME, _shape(*s, n=n)), _shape(*s, n=n), seed=1) is None


def test_every_config_every_size():
    spec = tkjit.get_spec(NAME)
    jobs = []
    for s in EVERY:
        full = spec.canonical_shape(_shape(*s))
        jobs += [(NAME, spec.static_shape(full), c, "sm_90a", "explicit") for c in spec.configs(full, "sm_90a")]
    errors = compile_many(jobs)
    assert all(err is None for _, err in errors), [err for _, err in errors if err][:5]
    for s in EVERY:
        full = spec.canonical_shape(_shape(*s))
        for c in spec.configs(full, "sm_90a"):
            kern = tkjit.get(NAME, full, config=c)
            for n in TOKENS:
                for seed in (0, 1):
                    assert check(kern, _shape(*s, n=n), seed=seed) is None, (s, c, n, seed)
            out = kern(torch.empty(0, s[0], s[1], device="cuda"))
            assert out.shape == (0, s[3])


# TileKernels' cases: 72 and 256 experts over 4, 8, 12 or 16 groups (where they divide), top-1/2 sums, 2/4 groups.
# One test each: every case compiles its own TileKernels kernel, so a time limit keeps the ones that ran.
TK_CASES = [(e, g, ks, kg) for e in (72, 256) for g in (4, 8, 12, 16) if e % g == 0 for ks in (1, 2) for kg in (2, 4)]


@pytest.mark.parametrize("e,g,ks,kg", TK_CASES)
def test_against_tile_kernels(e, g, ks, kg):
    tk = pytest.importorskip("tile_kernels")
    from tile_kernels.torch import topk_sum_and_topk_group_idx as tk_ref

    x = torch.randn(4001, g, e // g, device="cuda")
    got = tkjit.ops.topk_sum_and_topk_group_idx(x, ks, kg)
    assert torch.equal(got, tk.moe.topk_sum_and_topk_group_idx(x, ks, kg))
    assert torch.equal(got, tk_ref(x, ks, kg))


def test_op_opcheck_compile_and_cuda_graph():
    x = torch.randn(4001, 8, 32, device="cuda")
    torch.library.opcheck(torch.ops.tkjit.topk_sum_and_topk_group_idx.default, (x, 2, 4))
    fn = lambda s: tkjit.ops.topk_sum_and_topk_group_idx(s, 2, 4)  # noqa: E731
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn(x))


def test_compat_and_bad_input():
    from tkjit.compat.tile_kernels import moe
    from tkjit.errors import ShapeError, TensorError

    x = torch.randn(4001, 8, 32, device="cuda")
    assert torch.equal(moe.topk_sum_and_topk_group_idx(x, 2, 4), tkjit.ops.topk_sum_and_topk_group_idx(x, 2, 4))
    with pytest.raises(TensorError, match="contiguous"):
        moe.topk_sum_and_topk_group_idx(x.transpose(1, 2), 2, 4)
    with pytest.raises(ShapeError, match="num_topk_sum"):
        moe.topk_sum_and_topk_group_idx(x, 3, 4)
