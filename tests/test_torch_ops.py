"""torch.ops.tkjit.*: the kernels as torch custom ops, on a CPU host.

sinkhorn_fwd/bwd and transpose run for real on TileLang's C target. topk_gate and per_token_cast are
CUDA-only kernels: here they run as CompiledKernels whose launch writes the spec's reference, so the
ops' schemas, fake implementations, tensor checks and compile paths are exercised all the same
(tests/gpu/test_gpu_torch_ops.py runs the real kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.autograd
import tkjit.ops
import tkjit.torch_ops
from tkjit.testing import bit_equal
from tkjit_kernels.mhc.sinkhorn import reference as sinkhorn_reference

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OPS = ("sinkhorn_fwd", "sinkhorn_bwd", "topk_gate", "per_token_cast", "per_token_cast_colmajor", "transpose")
CUDA_ONLY = ("topk_gate", "per_token_cast", "per_token_cast_colmajor")
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(scope="module", autouse=True)
def shared_cache(tmp_path_factory):
    """One cache for the module: each C-target kernel compiles once (seconds) and serves every test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TKJIT_CACHE_DIR", str(tmp_path_factory.mktemp("torch-ops-cache")))
        tkjit.reset()
        yield os.environ["TKJIT_CACHE_DIR"]
    tkjit.reset()


@pytest.fixture
def reference_kernels(monkeypatch):
    """The CUDA-only kernels as CPU CompiledKernels that write their reference (real shape checks and
    output allocation; the launch is torch)."""
    serve_references(monkeypatch, CUDA_ONLY)


def _inputs(name, tokens=37, *, seed=0, dtype=None, batched=False):
    """(op, args): fresh random inputs (never zeros), small shapes. batched: a 3-D transpose."""
    g = torch.Generator().manual_seed(seed)
    op = getattr(torch.ops.tkjit, name).default
    if name == "sinkhorn_fwd":
        return op, (torch.randn(tokens, 4, 4, generator=g), 10, 1e-6)
    if name == "sinkhorn_bwd":
        return op, (torch.randn(tokens, 4, 4, generator=g), torch.randn(tokens, 4, 4, generator=g), 10, 1e-6)
    if name == "topk_gate":
        return op, (torch.randn(tokens, 64, generator=g), 6)
    if name in ("per_token_cast", "per_token_cast_colmajor"):
        x = torch.randn(tokens, 256, generator=g) * torch.exp(torch.randn(tokens, 1, generator=g))
        return op, (x.to(dtype or torch.bfloat16), 64, False)
    if name == "transpose":
        shape = (3, tokens, 24) if batched else (tokens, 40)
        return op, (torch.randn(*shape, generator=g).to(dtype or torch.float32),)
    raise AssertionError(name)


_same = bit_equal


# -- registration ---------------------------------------------------------------------------------

def test_registered_by_tkjit_ops_not_by_tkjit():
    code = textwrap.dedent(f"""
        import sys, torch, tkjit
        print(hasattr(torch.ops.tkjit, "sinkhorn_fwd"), "tkjit.torch_ops" in sys.modules)
        import tkjit.ops
        print(*(hasattr(torch.ops.tkjit, n) for n in {OPS!r}), "tilelang" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", *["True"] * len(OPS), "False"]


def test_schemas_type_every_scalar():
    schemas = {n: str(getattr(torch.ops.tkjit, n).default._schema) for n in OPS}
    assert schemas["sinkhorn_fwd"].startswith(
        "tkjit::sinkhorn_fwd(Tensor x, int repeat=10, float eps=")
    assert schemas["sinkhorn_fwd"].endswith("str? config=None, str? bwd_config=None) -> Tensor")
    assert "(Tensor scores, int k, str? config=None) -> Tensor" in schemas["topk_gate"]
    for n in ("per_token_cast", "per_token_cast_colmajor"):
        assert "(Tensor x, int group=128, bool round_scale=False, str? config=None) -> (Tensor, Tensor)" in schemas[n]
    assert "(Tensor grad_out, Tensor x, int repeat=10, float eps=" in schemas["sinkhorn_bwd"]
    assert "(Tensor x, str? config=None) -> Tensor" in schemas["transpose"]


# -- opcheck ----------------------------------------------------------------------------------------

OPCHECK_CASES = [
    ("sinkhorn_fwd", {}),
    ("sinkhorn_fwd", {"grad": True}),
    ("sinkhorn_fwd", {"tokens": 0}),
    ("sinkhorn_bwd", {}),
    ("transpose", {}),
    ("transpose", {"tokens": 0}),
    ("transpose", {"dtype": torch.float16}),
    ("transpose", {"batched": True}),
    ("transpose", {"batched": True, "dtype": torch.float16}),
    ("topk_gate", {}),
    ("per_token_cast", {}),
    ("per_token_cast", {"dtype": torch.float32, "round_scale": True}),
    ("per_token_cast_colmajor", {"tokens": 37}),
    ("per_token_cast_colmajor", {"tokens": 0}),
]


@pytest.mark.parametrize("name, kw", OPCHECK_CASES, ids=lambda v: str(v) if isinstance(v, dict) else v)
def test_opcheck(reference_kernels, name, kw):
    op, args = _inputs(name, kw.get("tokens", 37), dtype=kw.get("dtype"), batched=kw.get("batched", False))
    if kw.get("round_scale"):
        args = (*args[:2], True)
    if kw.get("grad"):
        args = (args[0].requires_grad_(True), *args[1:])
    result = torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


# -- fake implementations: what torch.compile sees is what the kernel returns -------------------------

@pytest.mark.parametrize("tokens", [0, 1, 5, 8, 13])
def test_fake_outputs_match_real_ones(reference_kernels, tokens):
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = [_inputs(n, tokens) for n in OPS] + [_inputs("transpose", tokens, batched=True)]
    for op, args in cases:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
        for r, f in zip(real, fake):
            assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device), op
            if r.numel():
                assert f.stride() == r.stride() and r.is_contiguous(), op


@pytest.mark.parametrize("tokens", [0, 1, 5, 8, 13])
def test_col_major_scales_view(reference_kernels, tokens):
    """tkjit.ops slices the op's padded storage: (num_tokens, groups), strides (1, align(num_tokens, 4))."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(tokens, 256) * 3
    q, s = tkjit.ops.per_token_cast(x, 64, col_major_scales=True)
    q_row, s_row = tkjit.ops.per_token_cast(x, 64)
    padded = -(-tokens // 4) * 4
    assert s.shape == (tokens, 4) and torch.equal(s, s_row) and _same(q, q_row)
    if tokens:
        assert s.stride() == (1, padded) and s.untyped_storage().nbytes() == 4 * padded * 4
    with FakeTensorMode() as mode:
        fq, fs = tkjit.ops.per_token_cast(mode.from_tensor(x), 64, col_major_scales=True)
    assert (fq.shape, fs.shape, fs.dtype) == (q.shape, s.shape, s.dtype)
    if tokens:
        assert fs.stride() == s.stride()


def test_fake_impls_refuse_what_the_kernels_refuse():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(tkjit.TensorError, match="float32"):
            torch.ops.tkjit.sinkhorn_fwd(torch.randn(5, 4, 4, dtype=torch.float64))
        with pytest.raises(tkjit.TensorError, match="axis 2 must be 4"):
            torch.ops.tkjit.sinkhorn_fwd(torch.randn(5, 4, 3))
        with pytest.raises(tkjit.TensorError, match="3-D"):
            torch.ops.tkjit.sinkhorn_fwd(torch.randn(5, 16))
        with pytest.raises(tkjit.ShapeError, match="multiple of 16"):
            torch.ops.tkjit.per_token_cast(torch.randn(5, 584, dtype=torch.bfloat16), 128)
        with pytest.raises(tkjit.ShapeError, match="num_experts"):
            torch.ops.tkjit.topk_gate(torch.randn(5, 64), 65)
        with pytest.raises(tkjit.TensorError, match="2-D or 3-D"):
            torch.ops.tkjit.transpose(torch.randn(2, 2, 2, 2))


# -- FakeTensor / meta inputs never reach a launcher -----------------------------------------------

def test_fake_and_meta_tensors_never_reach_a_launcher(shared_cache):
    """In a subprocess: a launcher handed a FakeTensor's data_ptr() would crash the process."""
    tkjit.get("sinkhorn_fwd", {"num_tokens": 8, "n": 4}, arch="cpu")  # compiled here, served from disk there
    code = textwrap.dedent("""
        import torch, tkjit, tkjit.ops
        from torch._subclasses.fake_tensor import FakeTensorMode
        k = tkjit.get("sinkhorn_fwd", {"num_tokens": 8, "n": 4}, arch="cpu")
        real = torch.randn(8, 4, 4)

        def refused(*args, **kw):
            try:
                k(*args, **kw)
            except tkjit.TensorError as e:
                return "fake/meta tensor: it has no data" in str(e)
            return False

        with FakeTensorMode() as mode:
            fx = mode.from_tensor(real)
            y = torch.ops.tkjit.sinkhorn_fwd(fx)
            print("op", type(y).__name__, tuple(y.shape), y.stride())
            print("kernel", refused(fx))
            print("out", refused(real, out=torch.empty(8, 4, 4)))  # a real input, a fake output
        with FakeTensorMode(allow_non_fake_inputs=True):
            print("alloc", refused(real))  # a real input, outputs allocated by the mode
        print("meta", refused(torch.empty(8, 4, 4, device="meta")))
        print("meta-op", tuple(torch.ops.tkjit.sinkhorn_fwd(torch.empty(8, 4, 4, device="meta")).shape))
        print("real", bool(torch.equal(k(real), torch.ops.tkjit.sinkhorn_fwd(real))))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TKJIT_CACHE_DIR": shared_cache})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [
        "op FakeTensor (8, 4, 4) (16, 4, 1)",
        "kernel True",
        "out True",
        "alloc True",
        "meta True",
        "meta-op (8, 4, 4)",
        "real True",
    ], r.stdout


# -- torch.compile ------------------------------------------------------------------------------------

def _model(name):
    """f(x) = op(x * 2) + 1 through the documented tkjit.ops entry point."""
    if name == "sinkhorn_fwd":
        return lambda x: tkjit.ops.sinkhorn_fwd(x * 2) + 1
    if name == "sinkhorn":
        return lambda x: tkjit.ops.sinkhorn(x * 2) + 1
    if name == "sinkhorn_bwd":
        return lambda g, x: tkjit.ops.sinkhorn_bwd(g * 2, x) + 1
    if name == "topk_gate":
        return lambda x: tkjit.ops.topk_gate(x * 2, 6) + 1
    if name in ("per_token_cast", "per_token_cast_colmajor"):
        def f(x):
            q, s = tkjit.ops.per_token_cast(x * 2, 64, col_major_scales=name.endswith("colmajor"))
            return q.view(torch.uint8).int() + 1, s + 1
        return f
    if name == "transpose":
        return lambda x: tkjit.ops.transpose(x * 2) + 1
    raise AssertionError(name)


def _compile_and_compare(name, args_list, backend="aot_eager"):
    torch._dynamo.reset()
    f = _model(name)
    explained = torch._dynamo.explain(f)(*args_list[0])
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend=backend)
    for args in args_list:
        assert _same(cf(*args), f(*args)), (name, [tuple(a.shape) for a in args])


COMPILE_CASES = [
    ("sinkhorn_fwd", {}), ("sinkhorn_bwd", {}), ("transpose", {}), ("transpose", {"batched": True}),
    ("topk_gate", {}), ("per_token_cast", {}), ("per_token_cast_colmajor", {}),
]


@pytest.mark.parametrize("name, kw", COMPILE_CASES, ids=lambda v: str(v) if isinstance(v, dict) else v)
def test_compile_fullgraph_no_graph_break(reference_kernels, name, kw):
    """Three token counts (the second recompiles with a dynamic size, the empty one specialises)."""
    args_list = []
    for tokens in (37, 21, 0):
        _, args = _inputs(name, tokens, seed=tokens, batched=kw.get("batched", False))
        args_list.append([a for a in args if isinstance(a, torch.Tensor)])
    _compile_and_compare(name, args_list)


@pytest.mark.slow
def test_compile_inductor_forward_and_backward():
    """Inductor (C++ codegen on this CPU, ~20 s) around the differentiable op: bit-exact with eager."""
    torch._dynamo.reset()
    f = _model("sinkhorn")
    cf = torch.compile(f, fullgraph=True, backend="inductor")
    x = torch.randn(2, 19, 4, 4, generator=torch.Generator().manual_seed(3))
    g = torch.randn(2, 19, 4, 4, generator=torch.Generator().manual_seed(4))
    grads = []
    for fn in (cf, f):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(g)
        grads.append((y.detach(), xi.grad))
    assert _same(grads[0][0], grads[1][0]) and _same(grads[0][1], grads[1][1])


def test_compile_with_config_and_grad_no_graph_break():
    """A pinned config (a dict, passed to the ops as text) and autograd through the compiled graph."""
    spec = tkjit.get_spec("sinkhorn_fwd")
    cfg = spec.default_config(spec.canonical_shape({"num_tokens": 8}), "cpu")
    bspec = tkjit.get_spec("sinkhorn_bwd")
    bcfg = bspec.default_config(bspec.canonical_shape({"num_tokens": 8}), "cpu")

    def f(x):
        return tkjit.autograd.sinkhorn(x * 2, fwd_config=cfg, bwd_config=bcfg).sum(-1) + 1

    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(torch.randn(5, 4, 4))
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 11, 4, 4)
    gy = torch.randn(3, 11, 4)
    outs = []
    for fn in (cf, f):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(gy)
        outs.append((y.detach(), xi.grad))
    assert _same(outs[0][0], outs[1][0]) and _same(outs[0][1], outs[1][1])


# -- autograd ---------------------------------------------------------------------------------------

def test_sinkhorn_grad_through_the_op_matches_float64():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 33, 4, 4, generator=g)
    grad_y = torch.randn(3, 33, 4, 4, generator=g)
    xd = x.double().requires_grad_(True)
    yr = sinkhorn_reference({"repeat": 10, "eps": 1e-6}, xd.view(-1, 4, 4)).view(xd.shape)
    yr.backward(grad_y.double())
    for fn in (lambda t: torch.ops.tkjit.sinkhorn_fwd(t.view(-1, 4, 4)).view(t.shape), tkjit.ops.sinkhorn,
               lambda t: tkjit.ops.sinkhorn_fwd(t.view(-1, 4, 4)).view(t.shape)):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(grad_y)
        assert float((y.detach().double() - yr.detach()).norm() / yr.detach().norm()) < 1e-5
        assert float((xi.grad.double() - xd.grad).norm() / xd.grad.norm()) < 1e-5
    # A non-contiguous upstream gradient (a transpose after the op) and an empty batch.
    xi = x.clone().requires_grad_(True)
    (tkjit.ops.sinkhorn(xi).transpose(-1, -2) * grad_y).sum().backward()
    xd.grad = None
    (sinkhorn_reference({"repeat": 10, "eps": 1e-6}, xd).transpose(-1, -2) * grad_y.double()).sum().backward()
    assert float((xi.grad.double() - xd.grad).norm() / xd.grad.norm()) < 1e-5
    e = torch.randn(0, 4, 4, requires_grad=True)
    tkjit.ops.sinkhorn(e).sum().backward()
    assert e.grad.shape == (0, 4, 4)


def test_sinkhorn_double_backward_says_it_is_not_supported():
    x = torch.randn(6, 4, 4, requires_grad=True)
    y = tkjit.ops.sinkhorn(x)
    (gx,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        gx.sum().backward()


def test_config_reaches_the_kernel():
    spec = tkjit.get_spec("sinkhorn_fwd")
    cfg = spec.default_config(spec.canonical_shape({"num_tokens": 8}), "cpu")
    x = torch.randn(9, 4, 4)
    y = tkjit.ops.sinkhorn_fwd(x)
    assert torch.equal(tkjit.ops.sinkhorn_fwd(x, config=cfg), y)
    assert torch.equal(torch.ops.tkjit.sinkhorn_fwd(x, 10, 1e-6, repr(cfg)), y)
    with pytest.raises(tkjit.ConfigError, match="not in the space"):
        tkjit.ops.sinkhorn_fwd(x, config={**cfg, "threads": 3})
    with pytest.raises(tkjit.ConfigError, match="text of a dict"):
        torch.ops.tkjit.sinkhorn_fwd(x, 10, 1e-6, "threads=32")


def test_empty_inputs_give_empty_outputs(reference_kernels):
    assert tkjit.ops.sinkhorn_fwd(torch.randn(0, 4, 4)).shape == (0, 4, 4)
    assert tkjit.ops.sinkhorn_bwd(torch.randn(0, 4, 4), torch.randn(0, 4, 4)).shape == (0, 4, 4)
    assert tkjit.ops.transpose(torch.randn(0, 40)).shape == (40, 0)
    assert tkjit.ops.transpose(torch.randn(0, 5, 24)).shape == (0, 24, 5)
    assert tkjit.ops.transpose(torch.randn(3, 0, 24)).shape == (3, 24, 0)
    topk = tkjit.ops.topk_gate(torch.randn(0, 64), 6)
    assert topk.shape == (0, 6) and topk.dtype == torch.int64
    for col_major in (False, True):
        q, s = tkjit.ops.per_token_cast(torch.randn(0, 256, dtype=torch.bfloat16), 64, col_major_scales=col_major)
        assert q.shape == (0, 256) and q.dtype == torch.float8_e4m3fn and s.shape == (0, 4)


def test_real_kernels_match_their_references():
    """The ops on the C target against the specs' references (exact for transpose)."""
    _, (x, _, _) = _inputs("sinkhorn_fwd", 37)
    y = tkjit.ops.sinkhorn_fwd(x)
    ref = sinkhorn_reference({"repeat": 10, "eps": 1e-6}, x)
    assert float((y.double() - ref.double()).norm() / ref.double().norm()) < 1e-5
    for dtype, batched in ((None, False), (torch.float16, False), (None, True), (torch.float16, True)):
        _, (t,) = _inputs("transpose", 37, dtype=dtype, batched=batched)
        assert _same(tkjit.ops.transpose(t), t.transpose(-1, -2).contiguous())


def test_eager_calls_skip_the_dispatcher_and_traced_ones_do_not(reference_kernels):
    """Plain eager calls of tkjit.ops run the op's implementation directly (no dispatcher host cost),
    under an autograd.Function when a gradient is wanted; a fake or meta tensor takes the custom op.
    Either way the result is the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(9, 4, 4)
    want = torch.ops.tkjit.sinkhorn_fwd(x)
    with Seen() as seen:
        got = tkjit.ops.sinkhorn_fwd(x)
        tkjit.ops.transpose(torch.randn(5, 8))
        tkjit.ops.topk_gate(torch.randn(5, 64), 4)
    assert not [o for o in seen.ops if o.startswith("tkjit.")]
    assert _same(got, want)
    xg = x.clone().requires_grad_()
    with Seen() as seen:  # eager with a gradient: the autograd.Function over the same implementations
        y = tkjit.ops.sinkhorn_fwd(xg)
    assert not [o for o in seen.ops if o.startswith("tkjit.")] and "SinkhornFunction" in type(y.grad_fn).__name__
    assert _same(y.detach(), want)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, xg, g)
    xo = x.clone().requires_grad_()
    (go,) = torch.autograd.grad(torch.ops.tkjit.sinkhorn_fwd(xo), xo, g)  # the custom op's formula
    assert _same(gx, go)
    with torch.no_grad(), Seen() as seen:
        tkjit.ops.sinkhorn_fwd(xg)
    assert not [o for o in seen.ops if o.startswith("tkjit.")]
    out = tkjit.ops.transpose(torch.empty(5, 8, device="meta"))  # meta: the fake implementation answers
    assert out.shape == (8, 5) and out.is_meta


def test_eager_sinkhorn_of_any_batch_shape_is_one_autograd_node():
    """tkjit.ops.sinkhorn on (..., n, n): the Function flattens the batch itself, so the backward pass walks
    one node, not the two views a reshape around it would add (each costs host time like a kernel's)."""
    x = torch.randn(2, 3, 4, 4).requires_grad_()
    y = tkjit.ops.sinkhorn(x)
    assert "SinkhornFunction" in type(y.grad_fn).__name__ and y.shape == x.shape
    assert y.grad_fn.next_functions[0][0].variable is x  # straight from the leaf: no view node between
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    flat = x.detach().reshape(-1, 4, 4).requires_grad_()
    (want,) = torch.autograd.grad(torch.ops.tkjit.sinkhorn_fwd(flat), flat, g.reshape(-1, 4, 4))
    assert gx.shape == x.shape and _same(gx, want.view(x.shape))
    assert _same(y.detach(), torch.ops.tkjit.sinkhorn_fwd(flat.detach()).view(x.shape))
    xt = torch.randn(4, 4, 3).transpose(0, 2).requires_grad_()  # not contiguous: copied inside, same values
    (gt,) = torch.autograd.grad(tkjit.ops.sinkhorn(xt), xt, g[0, :3])
    ft = xt.detach().contiguous().requires_grad_()
    assert _same(gt, torch.autograd.grad(tkjit.ops.sinkhorn(ft), ft, g[0, :3])[0])


def test_eager_sinkhorn_without_a_gradient_skips_the_function(monkeypatch):
    """Inference (an input without requires_grad, or under no_grad): the forward kernel alone, no autograd
    Function (its apply and context cost several µs a call); the values are the differentiable path's."""
    x = torch.randn(2, 3, 4, 4)
    xg = x.clone().requires_grad_()
    want = tkjit.ops.sinkhorn(xg).detach()

    def refuse(*args):
        raise AssertionError("the autograd Function ran for a call without a gradient")

    monkeypatch.setattr(tkjit.autograd.SinkhornFunction, "apply", refuse)
    got = tkjit.ops.sinkhorn(x)
    assert got.grad_fn is None and got.shape == x.shape and _same(got, want)
    with torch.no_grad():
        got = tkjit.ops.sinkhorn(xg)
    assert got.grad_fn is None and not got.requires_grad and _same(got, want)
    xt = x[0].transpose(1, 2)  # not contiguous, and (3, 4, 4): copied inside, same values
    assert _same(tkjit.ops.sinkhorn(xt), tkjit.ops.sinkhorn(xt.contiguous()))
    assert _same(tkjit.ops.sinkhorn(x[0, 0]), want[0, 0])  # one (n, n) matrix
