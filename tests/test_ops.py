"""tkjit.ops on a CPU host: the op forms (autograd, transpose shapes) and targets that cannot lower a kernel."""

from __future__ import annotations

import pytest
import torch

import tkjit


@pytest.mark.slow
def test_ops_forms_on_cpu(cache_dir):
    x = torch.randn(6, 4, 4, requires_grad=True)
    tkjit.ops.sinkhorn(x).sum().backward()
    assert x.grad.shape == (6, 4, 4) and torch.isfinite(x.grad).all()
    t = torch.randn(3, 5)
    assert torch.equal(tkjit.ops.transpose(t), t.t())
    with pytest.raises(tkjit.TensorError, match="2-D or 3-D"):
        tkjit.ops.transpose(torch.randn(2, 2, 2, 2))


def test_targets_that_cannot_lower_a_kernel_say_why(cache_dir):
    with pytest.raises(tkjit.ConfigError, match="C target has no bfloat16"):
        tkjit.ops.transpose(torch.randn(3, 5).bfloat16())
    with pytest.raises(tkjit.ConfigError, match="CUDA targets only"):
        tkjit.get("topk_gate", {"num_tokens": 4, "num_experts": 64, "k": 2}, arch="cpu")


def test_torch_ops_keep_their_autograd_behaviour_on_the_lean_dispatch_path(cache_dir):
    # tkjit.torch_ops.dispatch.lean_dispatch skips custom_op's Python layers when no gradient is needed; with one, the
    # op behaves as custom_op made it: a registered backward runs, an op without one refuses to backprop.
    import tkjit.ops  # noqa: F401  (registers torch.ops.tkjit: this test alone must not rely on another's import)

    x = torch.randn(6, 4, 4, requires_grad=True)
    y = torch.ops.tkjit.sinkhorn_fwd(x)
    y.sum().backward()
    assert x.grad.shape == (6, 4, 4) and torch.isfinite(x.grad).all()
    t = torch.randn(3, 5, requires_grad=True)
    out = torch.ops.tkjit.transpose(t)
    assert out.requires_grad and torch.equal(out.detach(), t.detach().t())
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()
    with torch.no_grad():
        assert not torch.ops.tkjit.transpose(t).requires_grad


def test_every_op_takes_the_lean_dispatch_on_this_torch():
    # tools/hostcost.py reports the count on a GPU host, whose torch may differ; the CI's torch takes it for all.
    from tkjit import torch_ops

    assert len(torch_ops.OPS) >= 50
    assert torch_ops.LEAN_OPS == {op._name for op in torch_ops.OPS} and not torch_ops.LEAN_SKIPPED


def test_an_op_kept_off_the_lean_dispatch_says_why(monkeypatch):
    # a torch that names custom_op's internals otherwise keeps its own kernels; hostcost prints the reason
    from types import SimpleNamespace

    from tkjit import torch_ops

    monkeypatch.setattr(torch_ops.dispatch, "LEAN_SKIPPED", {})
    torch_ops.dispatch.lean_dispatch(SimpleNamespace(_name="renamed"))
    assert list(torch_ops.dispatch.LEAN_SKIPPED.values()) == ["renamed"]
    assert next(iter(torch_ops.dispatch.LEAN_SKIPPED)).startswith("AttributeError:")


def test_repeat_calls_reuse_the_served_kernel_and_new_signatures_are_checked(cache_dir, monkeypatch):
    # torch_ops.serve.kernel_for: one get() per call signature (shape, dtype, device, scalars and their types,
    # config); an equal value of another type (10.0, True for repeat=10) is checked again and refused.
    from tkjit import torch_ops

    gets = []
    real_get = torch_ops.serve.get
    monkeypatch.setattr(torch_ops.serve, "get", lambda *a, **kw: (gets.append(a[0]), real_get(*a, **kw))[1])
    for seed in range(3):
        x = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(tkjit.ops.sinkhorn_fwd(x), tkjit.get_spec("sinkhorn_fwd").reference(
            {"num_tokens": 5, "n": 4, "repeat": 10, "eps": 1e-6}, x))
    assert gets == ["sinkhorn_fwd"]
    for bad in (10.0, True):
        with pytest.raises(tkjit.ShapeError, match="'repeat' must be an int"):
            tkjit.ops.sinkhorn_fwd(x, bad)
    tkjit.ops.sinkhorn_fwd(torch.randn(7, 4, 4))  # another size: its own lookup
    t = torch.randn(3, 5)
    assert torch.equal(tkjit.ops.transpose(t), t.t()) and torch.equal(tkjit.ops.transpose(t[None]), t.t()[None])
    with pytest.raises(tkjit.TensorError, match="expected a 2-D or 3-D tensor"):
        tkjit.ops.transpose(torch.randn(5))
    assert gets == ["sinkhorn_fwd", "sinkhorn_fwd", "sinkhorn_fwd", "sinkhorn_fwd", "transpose", "batched_transpose"]
    tkjit.reset()
    tkjit.ops.sinkhorn_fwd(x)
    assert gets[-1] == "sinkhorn_fwd" and len(gets) == 7


def test_the_lean_dispatch_on_a_torch_without_allow_override(cache_dir):
    """torch 2.11's Library.impl has no `allow_override` and refuses a second Python kernel for a key custom_op
    registered: every op stayed off the lean dispatch there (found on the GPU host). Its impl is emulated in a
    fresh process (the ops register once per process); the ops must take the lean dispatch and keep working."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, torch, torch.library as L
        real = L.Library.impl
        def impl(self, op_name, fn, dispatch_key="", *, with_keyset=False, **kw):
            if sys._getframe(1).f_globals.get("__name__") == "tkjit.torch_ops.dispatch":  # (torch keeps its own)
                if kw:
                    raise TypeError("impl() got an unexpected keyword argument 'allow_override'")
                if f"{self.ns}/{op_name.split('::')[-1]}/{dispatch_key}" in L._impls:
                    raise RuntimeError("This is not allowed since there's already a kernel registered from python")
            return real(self, op_name, fn, dispatch_key, with_keyset=with_keyset, **kw)
        L.Library.impl = impl
        import tkjit.ops
        from tkjit import torch_ops
        assert torch_ops.LEAN_OPS == {op._name for op in torch_ops.OPS}, torch_ops.LEAN_SKIPPED
        t = torch.randn(3, 5, requires_grad=True)
        out = torch.ops.tkjit.transpose(t)
        assert out.requires_grad and torch.equal(out.detach(), t.detach().t())
        with torch.no_grad():
            assert not torch.ops.tkjit.transpose(t).requires_grad
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
