"""engram_gate_bwd and grad_w_reduce on the GPU: every config of the spaces against the float64 references,
the defaults at every shape, TileKernels as the oracle (its own float32 sums: close, not bit for bit), the
full gate (tkjit.ops.engram_gate, compat EngramGateFn) against float64 autograd, torch.compile (fullgraph)
and opcheck on CUDA."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
BWD, RED = "engram_gate_bwd", "grad_w_reduce"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
SHAPES = [(4096, 4, 7168), (4096, 4, 4096), (1, 4, 7168), (1000, 4, 2560), (333, 4, 1024), (64, 8, 1024),
          (7, 3, 300), (5, 1, 6), (129, 2, 1000)]


def _shape(t, m, h, **kw):
    return {"num_tokens": t, "hc_mult": m, "hidden_size": h, **kw}


def test_every_config_in_the_space():
    shapes = [_shape(1, 4, 7168), _shape(1, 3, 300, num_partials=7)]
    failures = check_configs(BWD, shapes, [{"num_tokens": 1}, {"num_tokens": 517}], seeds=(0, 1))
    red = [{"hc_mult": 4, "hidden_size": 7168}, {"hc_mult": 3, "hidden_size": 300, "num_partials": 13}]
    failures += check_configs(RED, red, [{}], seeds=(0, 1))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("t, m, h", SHAPES)
def test_default_config(t, m, h):
    kern = tkjit.get(BWD, _shape(t, m, h))
    for seed in range(4):
        assert check(kern, _shape(t, m, h), seed=seed) is None, seed
    red = {"hc_mult": m, "hidden_size": h}
    assert check(tkjit.get(RED, red), red, seed=0) is None


def test_clamp_and_partials():
    shape = _shape(300, 4, 7168, clamp_value=0.5, num_partials=264)  # a clamp many scores fall under
    kern = tkjit.get(BWD, shape)
    for seed in range(2):
        assert check(kern, shape, seed=seed) is None


def _close(got, want, rtol):
    err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    assert err < rtol, err


@pytest.mark.parametrize("t, m, h", [(4096, 4, 7168), (4096, 4, 4096), (1, 4, 7168), (333, 4, 1024)])
def test_tile_kernels_is_the_oracle(t, m, h):
    tk = pytest.importorskip("tile_kernels")
    spec = tkjit.get_spec(BWD)
    sms = tk.config.get_num_sms()
    full = spec.canonical_shape(_shape(t, m, h, num_partials=sms))
    for seed in range(2):
        ins = spec.make_inputs(full, device="cuda", seed=seed)
        want = tk.engram.engram_gate_bwd(*ins, 1e-6)
        got = compat.engram.engram_gate_bwd(*ins, 1e-6)
        assert got[3].shape == want[3].shape == (sms, m, h)
        for a, b in zip(got, want):
            _close(a, b, 2e-3 if a.dtype == torch.bfloat16 else 1e-5)
        wh = (1 + 0.1 * torch.randn(m, h, device="cuda")).bfloat16()
        we = (1 + 0.1 * torch.randn(m, h, device="cuda")).bfloat16()
        gh, ge = torch.randn(m, h, device="cuda"), torch.randn(m, h, device="cuda")
        gh2, ge2 = gh.clone(), ge.clone()
        tk.engram.grad_w_reduce(want[3], wh, we, gh, ge)
        compat.engram.grad_w_reduce(want[3], wh, we, gh2, ge2)
        _close(gh2, gh, 1e-6)
        _close(ge2, ge, 1e-6)


def _autograd64(x, k, v, wh, we, go):
    from tkjit_kernels.engram._gate import forward64

    leaves = [t.double().requires_grad_() for t in (x, k, v, wh, we)]
    out, *_ = forward64(*leaves[:3], leaves[3] * leaves[4], 1e-6, 1e-6)
    return (out, *torch.autograd.grad(out, leaves, go.double()))


@pytest.mark.parametrize("fn", ["tkjit", "compat", "compiled"])
def test_full_gate_against_float64_autograd(fn):
    from tkjit_kernels.engram._gate import gate_inputs

    t, m, h = 515, 4, 7168
    go, x, k, v, _ = gate_inputs(_shape(t, m, h), device="cuda", seed=1, grad=True)
    wh = (1 + 0.1 * torch.randn(m, h, device="cuda")).bfloat16()
    we = (1 + 0.1 * torch.randn(m, h, device="cuda")).bfloat16()
    leaves = [a.clone().requires_grad_() for a in (x, k, v, wh, we)]
    f = {"tkjit": tkjit.ops.engram_gate, "compat": compat.modeling.engram.engram_gate,
         "compiled": torch.compile(tkjit.ops.engram_gate, fullgraph=True)}[fn]
    out = f(*leaves, 1e-6, 1e-6)
    out.backward(go)
    want = _autograd64(x, k, v, wh, we, go)
    _close(out, want[0].bfloat16(), 1e-3)
    for leaf, w in zip(leaves, want[1:]):
        _close(leaf.grad, w.to(leaf.dtype), 2e-3)


def test_ops_opcheck_on_cuda():
    spec = tkjit.get_spec(BWD)
    ins = spec.make_inputs(spec.canonical_shape(_shape(64, 4, 7168)), device="cuda", seed=1)
    op = torch.ops.tkjit.engram_gate_bwd.default
    assert torch.library.opcheck(op, (*ins, 1e-6), test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    r = tkjit.get_spec(RED)
    rins = r.make_inputs(r.canonical_shape({"hc_mult": 4, "hidden_size": 7168}), device="cuda", seed=0)
    op = torch.ops.tkjit.grad_w_reduce.default
    assert torch.library.opcheck(op, rins, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
