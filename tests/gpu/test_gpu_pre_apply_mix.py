"""pre_apply_mix / pre_apply_mix_bwd / pre_apply_mix_bwd_acc on the GPU: the default config at TileKernels' test
shapes and odd ones, every config of the space at two shapes, against the spec references (out and x_grad
bit-exact, mix_grad rtol 1e-5) and against TileKernels' mhc_pre_apply_mix as its own test runs it (forward and
x_grad bit-exact, mix_grad within float32 summation error and TileKernels' tolerance), float64 autograd at
TileKernels' tolerance; the op under torch.compile, opcheck and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat.tile_kernels.modeling.mhc import ops as compat
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAMES = ("pre_apply_mix", "pre_apply_mix_bwd", "pre_apply_mix_bwd_acc")
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
TOKENS = (1024, 2048, 4096, 8192)  # n0 in (1, 2) x n1 in (1024, 4096)
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


def _tile_kernels_data(n0, n1, m, h, seed):
    """TileKernels' generate_pre_apply_mix_test_data (sigmoid bf16 streams, softmax mixes, randn grad)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n0, n1, m, h, generator=g, device="cuda").bfloat16().sigmoid()
    mix = torch.randn(n0, n1, m, 1, generator=g, device="cuda").softmax(-2)
    o_grad = torch.randn(n0, n1, h, generator=g, device="cuda").bfloat16()
    return x, mix, o_grad


def _run(impl, x, mix, o_grad, residual_grad):
    """TileKernels' _tester: forward, then backward with grad_from_mhc_post set (x's gradient read off it)."""
    x_, mix_ = x.clone().requires_grad_(), mix.clone().requires_grad_()
    o = impl(x_, mix_)
    x_.untyped_storage().grad_from_mhc_post = residual_grad.clone()
    torch.autograd.backward([o], [o_grad])
    return o.detach(), x_.untyped_storage().grad_from_mhc_post if x_.grad is None else x_.grad, mix_.grad


@pytest.mark.parametrize("n0", [1, 2])
@pytest.mark.parametrize("n1", [1024, 4096])
@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("h", [1280, 2560, 7680])
@pytest.mark.parametrize("zero_residual", [True, False])
def test_against_tile_kernels(n0, n1, m, h, zero_residual):
    tk = pytest.importorskip("tile_kernels.modeling.mhc.ops")
    x, mix, o_grad = _tile_kernels_data(n0, n1, m, h, seed=n0 * n1 + m * h)
    residual = torch.zeros_like(x) if zero_residual else torch.randn_like(x, dtype=torch.float32).bfloat16()
    want = _run(tk.mhc_pre_apply_mix, x, mix, o_grad, residual)
    got = _run(compat.mhc_pre_apply_mix, x, mix, o_grad, residual)
    for w, g in zip(want, got):
        assert w.shape == g.shape and w.dtype == g.dtype and w.stride() == g.stride()
    assert torch.equal(got[0], want[0]), "forward: the same fma chain as TileKernels' kernel"
    assert torch.equal(got[1], want[1]), "x_grad: one fma into the residual gradient, as TileKernels"
    # mix_grad: a float32 sum over hidden in each kernel's own order.
    assert float((got[2] - want[2]).norm() / want[2].norm()) < 1e-5
    torch.testing.assert_close(got[2], want[2], atol=1e-2, rtol=1e-3)
    # float64 autograd of TileKernels' torch reference, at its test's tolerance
    xd, md = x.double().requires_grad_(True), mix.double().requires_grad_(True)
    (xd * md).sum(-2).backward(o_grad.double())
    torch.testing.assert_close(got[0].double(), (x.double() * mix.double()).sum(-2), atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(got[1].double(), xd.grad + residual.double(), atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(got[2].double(), md.grad, atol=1e-2, rtol=1e-3)


def test_out_and_no_residual_gradient_against_tile_kernels():
    tk = pytest.importorskip("tile_kernels.modeling.mhc.ops")
    x, mix, o_grad = _tile_kernels_data(2, 4096, 4, 7168, seed=3)
    outs = [torch.full((2, 4096, 7168), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    tk.mhc_pre_apply_mix(x, mix, outs[0])
    compat.mhc_pre_apply_mix(x, mix, outs[1])
    assert torch.equal(outs[0], outs[1])
    grads = []
    for impl in (tk.mhc_pre_apply_mix, compat.mhc_pre_apply_mix):  # no grad_from_mhc_post: x.grad from zeros
        x_, mix_ = x.clone().requires_grad_(), mix.clone().requires_grad_()
        impl(x_, mix_).backward(o_grad)
        grads.append((x_.grad, mix_.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert float((grads[0][1] - grads[1][1]).norm() / grads[0][1].norm()) < 1e-5


def test_zero_tokens_and_bad_tensors():
    x = torch.empty(0, 4, 7168, dtype=torch.bfloat16, device="cuda")
    mix = torch.empty(0, 4, 1, device="cuda")
    assert tkjit.ops.mhc_pre_apply_mix(x, mix).shape == (0, 7168)
    xg, mg = tkjit.ops.mhc_pre_apply_mix_bwd(torch.empty(0, 7168, dtype=torch.bfloat16, device="cuda"), x, mix)
    assert xg.shape == x.shape and mg.shape == mix.shape
    kern = tkjit.get("pre_apply_mix", {"num_tokens": 64, "mhc_mult": 4, "hidden": 7168})
    x = torch.randn(64, 4, 7168, device="cuda").bfloat16()
    mix = torch.rand(64, 4, device="cuda")
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x, mix.double())
    with pytest.raises(tkjit.TensorError, match="compiled in"):
        kern(x[:, :3].contiguous(), mix[:, :3].contiguous())
    with pytest.raises(tkjit.TensorError, match="num_tokens"):
        kern(x, mix[1:])


def test_op_compile_opcheck_and_cuda_graph():
    x, mix, o_grad = _tile_kernels_data(2, 1024, 4, 2560, seed=4)
    xc, mc = x.clone().requires_grad_(True), mix.clone().requires_grad_(True)
    f = torch.compile(lambda a, b: tkjit.ops.mhc_pre_apply_mix(a, b * 1), fullgraph=True)
    y = f(xc, mc)
    y.backward(o_grad)
    xe, me = x.clone().requires_grad_(True), mix.clone().requires_grad_(True)
    ye = tkjit.ops.mhc_pre_apply_mix(xe, me * 1)
    ye.backward(o_grad)
    assert torch.equal(y, ye) and torch.equal(xc.grad, xe.grad) and torch.equal(mc.grad, me.grad)
    xf, mf, gf = x.view(-1, 4, 2560), mix.view(-1, 4), o_grad.view(-1, 2560)
    for op, args in ((torch.ops.tkjit.pre_apply_mix.default, (xf, mf)),
                     (torch.ops.tkjit.pre_apply_mix_bwd.default, (gf, xf, mf)),
                     (torch.ops.tkjit.pre_apply_mix_bwd_acc.default, (gf, xf, mf, torch.zeros_like(xf)))):
        r = torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)
        assert r == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), (op, r)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tkjit.ops.mhc_pre_apply_mix(x, mix)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tkjit.ops.mhc_pre_apply_mix(x, mix))
