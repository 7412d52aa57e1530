"""mask_indices_by_tp on the GPU: every config bit-exact against the spec reference, one binary for every
rank, the TileKernels package as oracle, the op under torch.compile and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
MOST = 24  # configs checked per shape: an even spread of the space, the default among them
NAME = "mask_indices_by_tp"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
LAYOUTS = [(256, 8, 2), (256, 8, 1), (72, 4, 3), (256, 32, 4), (100, 7, 3)]


def _shape(k, dtype, t=4001):
    return {"num_tokens": t, "num_topk": k, "dtype": dtype}


def test_every_config_in_the_space():
    shapes = [_shape(k, dt) for k, dt in ((8, "int64"), (8, "int32"), (9, "int32"))]
    failures = check_configs(NAME, shapes, [{"num_tokens": t} for t in (1, 7, 4001, 65537)], most=MOST)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k", [2, 6, 8, 9])
def test_tile_kernels_is_the_oracle(dtype, k):
    tk = pytest.importorskip("tile_kernels")
    for n, ep, tps in LAYOUTS:
        x = torch.randint(-1, n, (4001, k), dtype=dtype, device="cuda")
        for tp in range(tps):
            # TileKernels' kernel does not build for int32 indices (its select mixes an int64 -1 with the
            # int32 value): there its torch reference is the oracle.
            want = (tk.moe.mask_indices_by_tp(x, n, ep, tp, tps) if dtype == torch.int64
                    else tk.torch.mask_indices_by_tp(x, n, ep, tp, tps))
            assert torch.equal(compat.moe.mask_indices_by_tp(x, n, ep, tp, tps), want), (n, ep, tps, tp)
            assert torch.equal(want.cpu(), tk.torch.mask_indices_by_tp(x, n, ep, tp, tps).cpu())


def test_one_binary_every_rank_and_edge_scalars():
    kern = tkjit.get(NAME, _shape(8, "int64"))
    x = torch.randint(-2, 400, (4001, 8), device="cuda")
    spec = tkjit.get_spec(NAME)
    for n, ep, tps in LAYOUTS:
        for tp in range(tps):
            assert torch.equal(kern(x, n // ep, tp, tps).cpu(), spec.reference({}, x.cpu(), n // ep, tp, tps))
    for bad in ((0, 0, 2), (4, 0, 0), (4, 5, 2)):
        assert bool((kern(x, *bad) == -1).all()), bad
    assert kern(torch.empty(0, 8, dtype=torch.int64, device="cuda"), 4, 0, 2).shape == (0, 8)


def test_bad_inputs_raise():
    kern = tkjit.get(NAME, _shape(8, "int64", 64))
    x = torch.zeros(64, 8, dtype=torch.int64, device="cuda")
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.int(), 4, 0, 2)
    with pytest.raises(tkjit.TensorError, match="per_gpu"):
        kern(x, 1.5, 0, 2)
    with pytest.raises(tkjit.ShapeError, match="tp_rank"):
        compat.moe.mask_indices_by_tp(x, 256, 8, 2, 2)


def test_op_opcheck_compile_and_cuda_graph():
    op = torch.ops.tkjit.mask_indices_by_tp.default
    x = torch.randint(-1, 256, (333, 8), device="cuda")
    assert torch.library.opcheck(op, (x, 256, 8, 1, 2), test_utils=OPCHECK_TESTS) == dict.fromkeys(
        OPCHECK_TESTS, "SUCCESS")
    eager = tkjit.ops.mask_indices_by_tp(x, 256, 8, 1, 2)
    f = torch.compile(lambda x: tkjit.ops.mask_indices_by_tp(x, 256, 8, 1, 2), fullgraph=True)
    assert torch.equal(f(x), eager)
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        got = tkjit.ops.mask_indices_by_tp(x, 256, 8, 1, 2)
    x.copy_(torch.randint(-1, 256, (333, 8), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), tkjit.get_spec(NAME).reference({}, x.cpu(), 32, 1, 2))
