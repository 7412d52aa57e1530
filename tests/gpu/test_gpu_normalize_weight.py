"""normalize_weight on the GPU: every config of the space bit-exact against the spec reference, the
TileKernels package as oracle on its parametrisations, the op under torch.compile and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import bit_equal, check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
MOST = 24  # configs checked per shape: an even spread of the space, the default among them
NAME = "normalize_weight"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _shape(k, t=4001):
    return {"num_tokens": t, "num_topk": k}


@pytest.mark.parametrize("k", [8, 9])
def test_every_config_in_the_space(k):
    failures = check_configs(NAME, [_shape(k)], [{"num_tokens": t} for t in (1, 7, 4001, 65537)], most=MOST)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("k", [1, 2, 6, 8, 9, 16])
def test_default_config_and_empty_batch(k):
    kern = tkjit.get(NAME, _shape(k))
    for t in (1, 4001, 1 << 20):
        assert check(kern, _shape(k, t), seed=t) is None
    den, out = kern(torch.empty(0, k, device="cuda"))
    assert den.shape == (0,) and out.shape == (0, k)


@pytest.mark.parametrize("k", [2, 6, 8, 9])
def test_tile_kernels_is_the_oracle(k):
    tk = pytest.importorskip("tile_kernels")
    w = torch.rand(4001, k, device="cuda")
    w[::7] *= 1e-30  # tiny sums: 1e-20 matters
    w[3] = 0.0
    assert bit_equal(compat.moe.normalize_weight(w), tk.moe.normalize_weight(w))
    assert bit_equal(tkjit.ops.normalize_weight(w), tk.torch.normalize_weight(w))


def test_bad_tensors_raise():
    kern = tkjit.get(NAME, _shape(8, 64))
    x = torch.rand(64, 8, device="cuda")
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.double())
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 8"):
        kern(torch.rand(64, 6, device="cuda"))
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        kern(torch.rand(8, 64, device="cuda").t())
    with pytest.raises(tkjit.TensorError, match="needs cuda"):
        kern(x.cpu())
    with pytest.raises(tkjit.TensorError, match="topk_weights must be torch.float32"):
        compat.moe.normalize_weight(x.half())


def test_op_opcheck_compile_and_cuda_graph():
    op = torch.ops.tkjit.normalize_weight.default
    w = torch.rand(333, 8, device="cuda")
    assert torch.library.opcheck(op, (w,), test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    eager = tkjit.ops.normalize_weight(w)
    f = torch.compile(lambda x: tkjit.ops.normalize_weight(x), fullgraph=True)
    assert bit_equal(f(w), eager)
    g = torch.cuda.CUDAGraph()
    tkjit.ops.normalize_weight(w)  # compiled and planned before capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        got = tkjit.ops.normalize_weight(w)
    w.copy_(torch.rand(333, 8, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert bit_equal(tuple(t.cpu() for t in got), tkjit.get_spec(NAME).reference({}, w.cpu()))
