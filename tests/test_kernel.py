"""tkjit.kernel.CompiledKernel: the tensor checks of a call, outputs allocated or checked, aligned runtime dims."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from common import SINK  # noqa: E402
from common import toy_spec as _toy_spec  # noqa: E402

import tkjit  # noqa: E402
from tkjit.errors import TensorError  # noqa: E402
from tkjit.spec import TensorArg, validate  # noqa: E402


def test_tensor_checks_on_cpu_kernel(cache_dir):
    k = tkjit.get("sinkhorn_fwd", SINK, arch="cpu")
    x = torch.randn(16, 4, 4)
    with pytest.raises(tkjit.TensorError, match="dtype torch.float64, expected torch.float32"):
        k(x.double())
    with pytest.raises(tkjit.TensorError, match="axis 2 must be 4"):
        k(torch.randn(16, 4, 5))
    with pytest.raises(tkjit.TensorError, match="has 2 dims .* expected 3"):
        k(torch.randn(16, 16))
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        k(x.transpose(1, 2))
    with pytest.raises(tkjit.TensorError, match="expected 1 input"):
        k(x, x)
    with pytest.raises(tkjit.TensorError, match="output y axis 0"):
        k(x, out=torch.empty(15, 4, 4))
    out = torch.full((16, 4, 4), float("nan"))
    assert k(x, out=out) is out and torch.isfinite(out).all()


def test_aligned_runtime_dims_are_checked_and_allocated():
    from tkjit.kernel import CompiledKernel
    from tkjit.spec import Align

    spec = _toy_spec(outputs=(TensorArg("y", "float32", ("n", "w")), TensorArg("s", "float32", (2, Align("n", 4)))))
    validate(spec)
    seen = []
    k = CompiledKernel(spec, spec.canonical_shape({"n": 5}), {"block": 32}, "cpu", "0" * 40, "explicit", Path("."),
                       lambda *ts: seen.append([tuple(t.shape) for t in ts]))
    y, s = k(torch.randn(5, 4))
    assert s.shape == (2, 8) and seen == [[(5, 4), (5, 4), (2, 8)]]
    with pytest.raises(tkjit.TensorError, match="rounded up to a multiple of 4"):
        k(torch.randn(5, 4), out=(torch.empty(5, 4), torch.empty(2, 5)))
    k(torch.randn(8, 4), out=(torch.empty(8, 4), torch.empty(2, 8)))


@pytest.mark.slow
def test_wrong_tensors(cache_dir):
    k = tkjit.get("sinkhorn_fwd", {"num_tokens": 64}, arch="cpu")
    x = torch.randn(64, 4, 4)
    cases = [
        (x.double(), "dtype"),
        (x.half(), "dtype"),
        (torch.randn(64, 4, 5), "shape"),
        (torch.randn(64, 16), "dims"),
        (torch.randn(64, 4, 4, device="meta"), "fake/meta tensor"),
        (torch.randn(4, 4, 64).permute(2, 0, 1), "contiguous"),
        (torch.randn(64, 8, 4)[:, ::2], "contiguous"),
        (x.numpy(), "torch.Tensor"),
        ([[1.0]], "torch.Tensor"),
    ]
    for t, match in cases:
        with pytest.raises(TensorError, match=match):
            k(t)
    with pytest.raises(TensorError, match="expected 1 input"):
        k(x, x)
    with pytest.raises(TensorError, match="output"):
        k(x, out=torch.empty(64, 4, 4, dtype=torch.float64))
    with pytest.raises(TensorError, match="other tensors say"):
        k(x, out=torch.empty(32, 4, 4))
    assert k(x).shape == x.shape  # and the kernel still works afterwards


# -- the per-signature fast path ----------------------------------------------------------------------


class _Binder:
    """A launcher like the loaders': called with tensors, or bound once per signature."""

    def __init__(self):
        self.binds, self.calls = 0, []

    def __call__(self, *tensors):
        self.calls.append(("call", [tuple(t.shape) for t in tensors]))
        tensors[-1].copy_(tensors[0])

    def bind(self, tensors, n_in):
        self.binds += 1
        shapes = [tuple(t.shape) for t in tensors]

        def go(ins, outs, scalars=()):
            assert [tuple(t.shape) for t in (*ins, *outs)] == shapes
            self.calls.append(("bound", shapes))
            outs[0].copy_(ins[0])

        return go


def _toy_kernel(launch):
    from tkjit.kernel import CompiledKernel

    spec = _toy_spec()
    validate(spec)
    return CompiledKernel(spec, spec.canonical_shape({"n": 5}), {"block": 32}, "cpu", "0" * 40, "explicit", Path("."),
                          launch)


def test_a_repeat_signature_runs_no_check_again(monkeypatch):
    from tkjit.kernel import CompiledKernel

    launch = _Binder()
    k = _toy_kernel(launch)
    x = torch.randn(5, 4)
    assert torch.equal(k(x), x) and launch.binds == 1
    real_check = CompiledKernel._check
    monkeypatch.setattr(CompiledKernel, "_check", lambda *a, **kw: pytest.fail("checked again"))
    for _ in range(3):
        x = torch.randn(5, 4)
        y = k(x)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    assert launch.binds == 1 and [c[0] for c in launch.calls] == ["call"] + ["bound"] * 3
    with pytest.raises(BaseException, match="checked again"):  # another signature: the full checks
        k(torch.randn(7, 4))
    monkeypatch.setattr(CompiledKernel, "_check", real_check)
    with pytest.raises(TensorError, match="contiguous"):
        k(x.T.contiguous().T)  # the same shape and dtype, other strides: checked (and refused)
    assert len(k._plans) == 1


def test_what_a_signature_does_not_fix_is_checked_at_every_call():
    from torch._subclasses.fake_tensor import FakeTensorMode

    launch = _Binder()
    k = _toy_kernel(launch)
    x = torch.randn(5, 4)
    k(x)
    assert len(k._plans) == 1
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    with pytest.raises(TensorError, match="fake/meta tensor"):
        k(fake)  # the same shape, strides, dtype and device as x
    with pytest.raises(TensorError, match="fake/meta tensor"):
        k(torch.empty(5, 4, device="meta"))
    shifted = torch.randn(21)[1:].view(5, 4)  # x's shape and strides, 4 bytes off a 16-byte boundary
    with pytest.raises(TensorError, match="not 16-byte aligned"):
        k(shifted)
    with pytest.raises(TensorError, match="dtype"):
        k(x.double())
    p = torch.nn.Parameter(torch.randn(5, 4))  # a subclass: the full checks, then it runs
    assert torch.equal(k(p), p.detach())
    g = torch.randn(5, 4, requires_grad=True)
    assert torch.equal(k(g), g.detach())
    n_calls = len(launch.calls)
    assert k(torch.empty(0, 4)).shape == (0, 4) and len(launch.calls) == n_calls  # an empty batch: no launch
    assert k(torch.empty(0, 4)).shape == (0, 4) and len(launch.calls) == n_calls  # planned, still no launch


def test_a_plain_function_launcher_is_checked_every_call_and_replacing_it_drops_the_plans(monkeypatch):
    seen = []
    k = _toy_kernel(lambda x, y: seen.append(1) or y.copy_(x))
    x = torch.randn(5, 4)
    k(x)
    k(x)
    assert not k._plans and len(seen) == 2
    k._launch = _Binder()
    k(x)
    assert len(k._plans) == 1
    k._launch = lambda x, y: y.fill_(7.0)
    assert not k._plans and bool((k(x) == 7.0).all())


def test_the_fast_path_on_a_real_c_target_kernel(cache_dir):
    """transpose (a row-strided input): views with one signature but other data come out right, each call."""
    k = tkjit.get("transpose", {"rows": 8, "cols": 32, "dtype": "float32"}, arch="cpu")
    for _ in range(4):
        buf = torch.randn(8, 40)
        x = buf[:, 8:40]  # rows of 40, 32-byte aligned start
        assert torch.equal(k(x), x.T)
    assert len(k._plans) == 1
    with pytest.raises(TensorError, match="rows are not .*-byte aligned"):
        k(torch.randn(8, 40)[:, 1:33])
