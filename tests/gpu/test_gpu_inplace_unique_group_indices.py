"""inplace_unique_group_indices on the GPU: every config (both algorithms, persistent grid) bit-exact
against the spec reference, out-of-range ids left alone, the TileKernels package as oracle, the op
under torch.compile and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
MOST = 24  # configs checked per shape: an even spread of the space, the default among them
NAME = "inplace_unique_group_indices"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _shape(k, groups, t=4001):
    return {"num_tokens": t, "num_topk": k, "num_groups": groups}


def test_every_config_in_the_space():
    shapes = [_shape(k, groups) for k, groups in ((8, 8), (9, 128))]
    # seeds 0 and 1: odd seeds hold out-of-range ids
    failures = check_configs(NAME, shapes, [{"num_tokens": t} for t in (1, 7, 4001, 65537)], most=MOST)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("k,groups", [(1, 4), (6, 72), (16, 256), (33, 200), (8, 1000), (64, 8)])
def test_default_config_other_shapes(k, groups):
    kern = tkjit.get(NAME, _shape(k, groups))
    for t in (1, 4001, 1 << 20):
        for seed in (0, 1):
            assert check(kern, _shape(k, groups, t), seed=seed) is None, (kern.config, t)
    empty = torch.empty(0, k, dtype=torch.int64, device="cuda")
    assert kern(empty) is empty


@pytest.mark.parametrize("k", [2, 6, 8, 9])
@pytest.mark.parametrize("groups", [8, 72, 128])
def test_tile_kernels_is_the_oracle(k, groups):
    tk = pytest.importorskip("tile_kernels")
    x = torch.randint(-1, groups, (4001, k), device="cuda")
    x[::2] = torch.randint(0, 3, (2001, k), device="cuda") % groups  # many repeats
    want = x.clone()
    tk.moe.inplace_unique_group_indices(want, groups)
    got = x.clone()
    assert compat.moe.inplace_unique_group_indices(got, groups) is None
    assert torch.equal(got, want)
    ref = x.clone()
    tk.torch.inplace_unique_group_indices(ref, groups)
    assert torch.equal(got, ref)


def test_bad_inputs_raise():
    kern = tkjit.get(NAME, _shape(8, 8, 64))
    x = torch.zeros(64, 8, dtype=torch.int64, device="cuda")
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.int())
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        kern(torch.zeros(8, 64, dtype=torch.int64, device="cuda").t())
    with pytest.raises(tkjit.ShapeError, match="num_groups"):
        compat.moe.inplace_unique_group_indices(x, 129)


def test_op_opcheck_compile_and_cuda_graph():
    op = torch.ops.tkjit.inplace_unique_group_indices.default
    x = torch.randint(-1, 8, (333, 8), device="cuda")
    assert torch.library.opcheck(op, (x.clone(), 8), test_utils=OPCHECK_TESTS) == dict.fromkeys(
        OPCHECK_TESTS, "SUCCESS")
    want = tkjit.get_spec(NAME).reference({"num_groups": 8}, x.cpu())

    @torch.compile(fullgraph=True)
    def f(g):
        tkjit.ops.inplace_unique_group_indices(g, 8)
        return g * 1

    y = x.clone()
    assert torch.equal(f(y).cpu(), want) and torch.equal(y.cpu(), want)
    y = x.clone()
    tkjit.ops.inplace_unique_group_indices(y.clone(), 8)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        tkjit.ops.inplace_unique_group_indices(y, 8)
    y.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), want)
