"""mhc_multilayer_recompute on the GPU: bit-exact against the spec's reference (the unfused ops' float32
orders, replayed on the CPU) with the default config at a handful of shapes and with every config of the
space at two; at TileKernels' test cases (8192 tokens, mhc 4, up to 10 layers) bit-exact against tkjit's own
unfused ops (mhc_pre_apply_mix, mhc_post_fwd) as TileKernels' test compares its kernel with its ops, and
against TileKernels' fused kernel and unfused ops; lists read and written in place; the op under opcheck
and torch.compile."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat.tile_kernels.modeling.mhc import ops as compat
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME = "mhc_multilayer_recompute"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# TileKernels' test_mhc_multilayer_recompute_correctness: (num_layers, num_post, hidden) at 1 x 8192 tokens, mhc 4.
TK_CASES = [(1, 1, 2560), (3, 2, 2560), (3, 3, 2560), (10, 9, 2560), (10, 10, 2560), (10, 9, 4096), (10, 10, 4096),
            (10, 9, 7168), (10, 10, 7168), (10, 9, 8192), (10, 10, 8192)]


def _shape(t, m, h, L, P):
    return {"num_tokens": t, "mhc_mult": m, "hidden": h, "num_layers": L, "num_post": P}


def _tk_data(bs, seq, m, h, L, P, seed=0):
    """TileKernels' generate_multilayer_recompute_test_data (standard normal), on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    ir = randn(bs, seq, m, h).bfloat16()
    pre = [randn(bs, seq, m, 1) for _ in range(L)]
    lo = [randn(bs, seq, h).bfloat16() for _ in range(P)]
    post = [randn(bs, seq, m, 1) for _ in range(P)]
    comb = [randn(bs, seq, m, m) for _ in range(P)]
    return ir, pre, lo, post, comb


def _outputs(bs, seq, m, h, L, P):
    li = [torch.full((bs, seq, h), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    res = [torch.full((bs, seq, m, h), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(P)]
    return li, res


def _unfused(ops, ir, pre, lo, post, comb):
    """TileKernels' _mhc_multilayer_recompute_ref over an ops module (tkjit's compat or TileKernels')."""
    inputs, residuals, res = [], [], ir
    for i in range(len(pre)):
        inputs.append(ops.mhc_pre_apply_mix(res, pre[i]))
        if i < len(lo):
            res = ops.mhc_post(lo[i], res, post[i], comb[i])
            residuals.append(res)
    return inputs, residuals


def _differ(a, b):
    return float((a.view(torch.int16) != b.view(torch.int16)).double().mean())


# -- against the reference ---------------------------------------------------------------------------

@pytest.mark.parametrize("m, h, L, P", [(4, 7168, 3, 2), (4, 2560, 2, 2), (2, 1280, 3, 3), (8, 4096, 2, 1),
                                        (1, 100, 2, 1), (16, 576, 1, 1), (3, 1000, 4, 3)], ids=str)
def test_default_config(m, h, L, P):
    kern = tkjit.get(NAME, _shape(256, m, h, L, P))
    for seed, n in enumerate((1, 7, 257)):
        assert check(kern, _shape(n, m, h, L, P), seed=seed) is None


def test_every_config_in_the_space():
    sizes = [{"num_tokens": n} for n in (1, 7, 129)]
    failures = check_configs(NAME, [_shape(129, 4, 7168, 3, 2)], sizes, seeds=(0, 1), most=64)
    failures += check_configs(NAME, [_shape(129, 3, 1000, 2, 2)], sizes, seeds=(1,), most=32)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


# -- TileKernels' cases: the fused op is the unfused ops ---------------------------------------------------

@pytest.mark.parametrize("L, P, h", TK_CASES, ids=str)
def test_tile_kernels_cases_equal_the_unfused_ops(L, P, h):
    data = _tk_data(1, 8192, 4, h, L, P, seed=L * 100 + P + h)
    li, res = _outputs(1, 8192, 4, h, L, P)
    assert compat.mhc_multilayer_recompute(*data, li, res) is None
    inputs, residuals = _unfused(compat, *data)
    for i, (a, b) in enumerate(zip(li + res, inputs + residuals)):
        assert a.shape == b.shape and torch.equal(a, b), f"output {i}: {_differ(a, b):.2e} of the elements differ"

    tk = pytest.importorskip("tile_kernels.modeling.mhc.ops")
    tli, tres = _outputs(1, 8192, 4, h, L, P)
    try:
        tk.mhc_multilayer_recompute(*data, tli, tres)
        torch.cuda.synchronize()
    except Exception as e:  # TileKernels' kernel may not compile with this host's TileLang: skip only this part
        pytest.skip(f"TileKernels' mhc_multilayer_recompute failed here: {type(e).__name__}: {e}"[:400])
    for i, (a, b) in enumerate(zip(li + res, tli + tres)):
        assert torch.equal(a, b), f"vs TileKernels' kernel, output {i}: {_differ(a, b):.2e} of the elements differ"
    try:
        tk_inputs, tk_residuals = _unfused(tk, *data)
    except Exception as e:
        pytest.skip(f"TileKernels' unfused ops failed here: {type(e).__name__}: {e}"[:400])
    for i, (a, b) in enumerate(zip(li + res, tk_inputs + tk_residuals)):
        assert torch.equal(a, b), f"vs TileKernels' ops, output {i}: {_differ(a, b):.2e} of the elements differ"


def test_one_layer_without_post_is_pre_apply_mix():
    ir, pre, *_ = _tk_data(2, 1000, 4, 7168, 1, 0, seed=3)
    li, res = _outputs(2, 1000, 4, 7168, 1, 0)
    compat.mhc_multilayer_recompute(ir, pre, [], [], [], li, res)
    assert torch.equal(li[0], compat.mhc_pre_apply_mix(ir, pre[0]))


def test_lists_in_one_buffer_are_used_in_place():
    L, P, m, h, n = 4, 3, 4, 2560, 777
    ir, pre, lo, post, comb = _tk_data(1, n, m, h, L, P, seed=4)
    bufs = [torch.stack(pre), torch.stack(lo), torch.stack(post), torch.stack(comb)]
    li_buf = torch.full((L, 1, n, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    res_buf = torch.full((P, 1, n, m, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    compat.mhc_multilayer_recompute(ir, *(list(b.unbind(0)) for b in bufs), list(li_buf.unbind(0)),
                                    list(res_buf.unbind(0)))
    inputs, residuals = _unfused(compat, ir, pre, lo, post, comb)
    assert torch.equal(li_buf, torch.stack(inputs)) and torch.equal(res_buf, torch.stack(residuals))
    # and the stacked op itself
    got = tkjit.ops.mhc_multilayer_recompute(ir, *bufs)
    assert torch.equal(got[0], li_buf) and torch.equal(got[1], res_buf)


def test_zero_tokens_and_bad_tensors():
    ir, pre, lo, post, comb = _tk_data(1, 0, 4, 1280, 3, 2)
    li, res = tkjit.ops.mhc_multilayer_recompute(ir, torch.stack(pre), torch.stack(lo), torch.stack(post),
                                                 torch.stack(comb))
    assert li.shape == (3, 1, 0, 1280) and res.shape == (2, 1, 0, 4, 1280)
    kern = tkjit.get(NAME, _shape(64, 4, 1280, 3, 2))
    args = [t.cuda() for t in kern.spec.make_inputs(kern.spec.canonical_shape(_shape(64, 4, 1280, 3, 2)))]
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(args[0].float(), *args[1:])
    with pytest.raises(tkjit.TensorError, match="axis"):
        kern(args[0], args[1][:2], *args[2:])
    with pytest.raises(tkjit.TensorError, match="cuda"):
        kern(*(t.cpu() for t in args))


# -- the op: opcheck, torch.compile -------------------------------------------------------------------

def test_op_opcheck_and_compile():
    full = _shape(300, 4, 2560, 3, 2)
    spec = tkjit.get_spec(NAME)
    args = [t.cuda() for t in spec.make_inputs(spec.canonical_shape(full), seed=5)]
    op = torch.ops.tkjit.mhc_multilayer_recompute.default
    assert torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    eager = tkjit.ops.mhc_multilayer_recompute(*args)
    f = torch.compile(lambda *a: tkjit.ops.mhc_multilayer_recompute(*a), fullgraph=True)
    got = f(*args)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    want = spec.reference(spec.canonical_shape(full), *(t.cpu() for t in args))
    assert torch.equal(eager[0].cpu(), want[0]) and torch.equal(eager[1].cpu(), want[1])
