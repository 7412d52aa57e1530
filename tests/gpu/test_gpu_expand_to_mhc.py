"""expand_to_mhc / expand_to_mhc_bwd on the GPU: the default config at TileKernels' test shapes and odd ones,
every config of the space at two shapes, bit-exact against the spec references and against TileKernels'
kernels (forward and autograd), 0 tokens, bad tensors; the op under torch.compile, opcheck and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat.tile_kernels.modeling.mhc import ops as compat
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAMES = ("expand_to_mhc", "expand_to_mhc_bwd")
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# TileKernels' parametrisations: n0 in (1, 2) x n1 in (1024, 4096) tokens, mhc 2 / 4 / 8, hidden 1280 .. 7680.
TOKENS = (1024, 2048, 4096, 8192)
STATIC = [(m, h) for m in (2, 4, 8) for h in (1280, 2560, 4096, 7168, 7680)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m,h", STATIC, ids=str)
def test_default_config_at_tile_kernels_shapes(name, m, h):
    kern = tkjit.get(name, {"num_tokens": 4096, "mhc_mult": m, "hidden": h})
    for i, n in enumerate((*TOKENS, 1, 7, 4001)):
        assert check(kern, {"num_tokens": n, "mhc_mult": m, "hidden": h}, seed=i) is None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m,h", [(1, 7), (3, 100), (4, 1284), (16, 576), (2, 65536)], ids=str)
def test_default_config_odd_shapes(name, m, h):
    kern = tkjit.get(name, {"num_tokens": 64, "mhc_mult": m, "hidden": h})
    for seed, n in enumerate((1, 33, 4001)):
        assert check(kern, {"num_tokens": n, "mhc_mult": m, "hidden": h}, seed=seed) is None


@pytest.mark.parametrize("name", NAMES)
def test_every_config_in_the_space(name):
    # The whole space (162 configs) at DeepSeek's shape; an even spread of it at a small hidden with 8 streams.
    sizes = [{"num_tokens": n} for n in (1, 7, 4001)]
    failures = check_configs(name, [{"num_tokens": 4001, "mhc_mult": 4, "hidden": 7168}], sizes)
    failures += check_configs(name, [{"num_tokens": 4001, "mhc_mult": 8, "hidden": 1280}], sizes, most=32)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("n0", [1, 2])
@pytest.mark.parametrize("n1", [1024, 4096])
@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("h", [1280, 2560, 7168])
def test_against_tile_kernels(n0, n1, m, h):
    """Forward, autograd backward and out= of the compat op bit-exact with TileKernels' expand_to_mhc."""
    tk = pytest.importorskip("tile_kernels.modeling.mhc.ops")
    g = torch.Generator(device="cuda").manual_seed(n0 * n1 + m * h)
    x = torch.randn(n0, n1, h, generator=g, device="cuda").bfloat16()
    grad = torch.randn(n0, n1, m, h, generator=g, device="cuda").bfloat16()
    results = []
    for impl in (tk.expand_to_mhc, compat.expand_to_mhc):
        xr = x.clone().requires_grad_(True)
        y = impl(xr, m)
        y.backward(grad)
        out = torch.full((n0, n1, m, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        impl(x, m, out)
        results.append((y.detach(), xr.grad, out))
    for want, got in zip(*results):
        assert want.shape == got.shape and want.stride() == got.stride() and want.dtype == got.dtype
        assert torch.equal(want, got)
    fwd, bwd = tkjit.get_spec("expand_to_mhc"), tkjit.get_spec("expand_to_mhc_bwd")
    assert torch.equal(results[1][0].cpu(), fwd.reference({"mhc_mult": m}, x.view(-1, h).cpu()).view(n0, n1, m, h))
    assert torch.equal(results[1][1].cpu(), bwd.reference({"mhc_mult": m}, grad.view(-1, m, h).cpu()).view(n0, n1, h))


def test_zero_tokens_and_bad_tensors():
    x = torch.empty(0, 7168, dtype=torch.bfloat16, device="cuda")
    assert tkjit.ops.expand_to_mhc(x, 4).shape == (0, 4, 7168)
    assert tkjit.ops.expand_to_mhc_bwd(torch.empty(0, 4, 7168, dtype=torch.bfloat16, device="cuda")).shape == (0, 7168)
    kern = tkjit.get("expand_to_mhc", {"num_tokens": 64, "mhc_mult": 4, "hidden": 7168})
    x = torch.randn(64, 7168, device="cuda").bfloat16()
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.float())
    with pytest.raises(tkjit.TensorError, match="compiled in"):
        kern(x[:, :7000].contiguous())
    with pytest.raises(tkjit.TensorError, match="aligned"):
        kern(x.view(-1)[1:1 + 63 * 7168].view(63, 7168))


def test_op_compile_opcheck_and_cuda_graph():
    x = torch.randn(2, 4001, 2560, device="cuda").bfloat16().requires_grad_(True)
    g = torch.randn(2, 4001, 4, 2560, device="cuda").bfloat16()
    f = torch.compile(lambda t: tkjit.ops.expand_to_mhc(t * 2, 4), fullgraph=True)
    y = f(x)
    y.backward(g)
    xe = x.detach().clone().requires_grad_(True)
    ye = tkjit.ops.expand_to_mhc(xe * 2, 4)
    ye.backward(g)
    assert torch.equal(y, ye) and torch.equal(x.grad, xe.grad)
    flat = x.detach().view(-1, 2560)
    for op, args in ((torch.ops.tkjit.expand_to_mhc.default, (flat, 4)),
                     (torch.ops.tkjit.expand_to_mhc_bwd.default, (g.view(-1, 4, 2560),))):
        r = torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)
        assert r == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), (op, r)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tkjit.ops.expand_to_mhc(flat, 4)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tkjit.ops.expand_to_mhc(flat, 4))
