"""torch.ops.tkjit.* on the GPU: opcheck, torch.compile(fullgraph=True) bit-exact with eager, CUDA-graph
capture and replay, launches on the current stream, FakeTensors refused before any launch.

Inputs are fresh random draws (never zeros); captured outputs are poisoned before each replay.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.testing import bit_equal
from tkjit_kernels.mhc.sinkhorn import reference as sinkhorn_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
ROOT = Path(__file__).resolve().parents[2]
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _x(seed, *shape, dtype=torch.float32, scale=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if scale:  # rows spanning magnitudes, as per_token_cast sees them
        x = x * torch.exp(2 * torch.randn(shape[0], 1, generator=g))
    return x.to(dtype).cuda()


# name -> (inputs(tokens, seed) -> tensors, (the op, its scalar args), f(*inputs) through tkjit.ops: the model)
CASES = {
    "sinkhorn_fwd": (
        lambda t, s: [_x(s, t, 4, 4)],
        (torch.ops.tkjit.sinkhorn_fwd.default, (10, 1e-6)),
        lambda x: tkjit.ops.sinkhorn_fwd(x * 2) + 1,
    ),
    "sinkhorn_bwd": (
        lambda t, s: [_x(s, t, 4, 4), _x(s + 1000, t, 4, 4)],
        (torch.ops.tkjit.sinkhorn_bwd.default, (10, 1e-6)),
        lambda g, x: tkjit.ops.sinkhorn_bwd(g * 2, x) + 1,
    ),
    "topk_gate": (
        lambda t, s: [_x(s, t, 256)],
        (torch.ops.tkjit.topk_gate.default, (8,)),
        lambda x: tkjit.ops.topk_gate(x * 2, 8) + 1,
    ),
    "per_token_cast": (
        lambda t, s: [_x(s, t, 7168, dtype=torch.bfloat16, scale=True)],
        (torch.ops.tkjit.per_token_cast.default, (128, False)),
        lambda x: _cast_model(x, 128, round_scale=False, col_major=False),
    ),
    "per_token_cast_f32_round": (
        lambda t, s: [_x(s, t, 1024, scale=True)],
        (torch.ops.tkjit.per_token_cast.default, (128, True)),
        lambda x: _cast_model(x, 128, round_scale=True, col_major=False),
    ),
    "per_token_cast_colmajor": (
        lambda t, s: [_x(s, t, 7168, dtype=torch.bfloat16, scale=True)],
        (torch.ops.tkjit.per_token_cast_colmajor.default, (128, False)),
        lambda x: _cast_model(x, 128, round_scale=False, col_major=True),
    ),
    "transpose": (
        lambda t, s: [_x(s, t, 7168, dtype=torch.bfloat16)],
        (torch.ops.tkjit.transpose.default, ()),
        lambda x: tkjit.ops.transpose(x * 2) + 1,
    ),
    "transpose_f32": (
        lambda t, s: [_x(s, t, 129)],
        (torch.ops.tkjit.transpose.default, ()),
        lambda x: tkjit.ops.transpose(x * 2) + 1,
    ),
    "batched_transpose": (
        lambda t, s: [_x(s, 4, t, 512, dtype=torch.bfloat16)],
        (torch.ops.tkjit.transpose.default, ()),
        lambda x: tkjit.ops.transpose(x * 2) + 1,
    ),
}
NAMES = list(CASES)


def _cast_model(x, group, *, round_scale, col_major):
    q, s = tkjit.ops.per_token_cast(x * 2, group, round_scale=round_scale, col_major_scales=col_major)
    return q.view(torch.uint8).int() + 1, s + 1


_same = bit_equal


def _call(op, tensors):
    overload, scalars = op
    return overload(*tensors, *scalars)


def _poison(out) -> None:
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if t.dtype.is_floating_point and t.element_size() > 1:
            t.fill_(float("nan"))
        elif t.dtype.is_floating_point:
            t.view(torch.uint8).fill_(0xFF)  # NaN in e4m3fn
        else:
            t.fill_(torch.iinfo(t.dtype).min)


@pytest.mark.parametrize("name", NAMES)
def test_opcheck(name):
    make, op, _ = CASES[name]
    args = make(517, 0)
    if name == "sinkhorn_fwd":  # its autograd formula too
        args[0].requires_grad_(True)
    result = torch.library.opcheck(op[0], (*args, *op[1]), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


@pytest.mark.parametrize("name", NAMES)
def test_compile_fullgraph_bit_exact(name):
    """Inductor, zero graph breaks; 4001 tokens, then 129 (a dynamic-size recompile), then 0."""
    make, _, model = CASES[name]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*make(4001, 0))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for t in (4001, 129, 0):
        args = make(t, t + 1)
        assert _same(compiled(*args), model(*args)), (name, t)


def test_compile_sinkhorn_forward_and_backward():
    """The differentiable op under inductor: bit-exact with eager, and within 1e-5 of float64 autograd."""
    def model(x):
        return tkjit.ops.sinkhorn(x * 2) + 1

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x = _x(3, 8, 512, 4, 4)
    g = _x(4, 8, 512, 4, 4)
    results = []
    for fn in (compiled, model):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(g)
        results.append((y.detach(), xi.grad))
    assert _same(results[0], results[1])
    xd = x.detach().cpu().double().requires_grad_(True)
    yr = sinkhorn_reference({"repeat": 10, "eps": 1e-6}, (xd * 2).view(-1, 4, 4)).view(xd.shape) + 1
    yr.backward(g.cpu().double())
    y, gx = results[0]
    assert float((y.cpu().double() - yr.detach()).norm() / yr.detach().norm()) < 1e-5
    assert float((gx.cpu().double() - xd.grad).norm() / xd.grad.norm()) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_cuda_graph_capture_and_replay(name):
    """Capture the op once; change the inputs in place, poison the outputs, replay: eager's answer."""
    make, op, _ = CASES[name]
    static = make(4001, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (memo, first launch) off the capture
        for _ in range(2):
            _call(op, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(op, static)
    for seed in (1, 2):
        fresh = make(4001, seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        _poison(out)
        graph.replay()
        torch.cuda.synchronize()
        assert _same(out, _call(op, fresh)), (name, seed)


@pytest.mark.parametrize("name", NAMES)
def test_launches_on_the_current_stream(name):
    """On a side stream that is busy (a sleep) before its input copy: a launch on any other stream would read
    the old input. Only the side stream is synchronised."""
    make, op, _ = CASES[name]
    fresh = make(4001, 7)
    expected = _call(op, fresh)
    bufs = make(4001, 8)  # other values: what a launch that does not wait for the copy would see
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time ahead of the copy
        for b, f in zip(bufs, fresh):
            b.copy_(f)
        out = _call(op, bufs)
    side.synchronize()
    assert _same(out, expected), name


def test_fake_tensors_never_reach_a_launcher():
    """In a subprocess (a launch on a FakeTensor's data_ptr() would crash it)."""
    tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 4})
    code = textwrap.dedent("""
        import torch, tkjit, tkjit.ops
        from torch._subclasses.fake_tensor import FakeTensorMode
        k = tkjit.get("sinkhorn_fwd", {"num_tokens": 64, "n": 4})
        real = torch.randn(64, 4, 4, device="cuda")
        with FakeTensorMode() as mode:
            fx = mode.from_tensor(real)
            y = torch.ops.tkjit.sinkhorn_fwd(fx)
            x = torch.randn(5, 7168, device="cuda", dtype=torch.bfloat16)  # fake: made under the mode
            q, s = tkjit.ops.per_token_cast(x, col_major_scales=True)
            print("op", type(y).__name__, y.device.type, tuple(y.shape), s.stride())
            try:
                k(fx)
                print("kernel launched")
            except tkjit.TensorError as e:
                print("kernel", "fake/meta tensor: it has no data" in str(e))
        print("real", bool(torch.equal(k(real), torch.ops.tkjit.sinkhorn_fwd(real))))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["op FakeTensor cuda (64, 4, 4) (1, 8)", "kernel True", "real True"], r.stdout
