"""expand_to_mhc / expand_to_mhc_bwd on a CPU host: the specs, their references against hand-computed and
float64 autograd results, the ops (torch custom ops, autograd, torch.compile) and the TileKernels entry
point over reference-writing kernels (bf16 rows: the C target lowers neither kernel), and sm_90a
cross-compiles."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops as ops
from tkjit.compat.tile_kernels.modeling import mhc as tk_mhc
from tkjit.compat.tile_kernels.modeling.mhc import ops as tk

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

NAMES = ("expand_to_mhc", "expand_to_mhc_bwd")
SHAPE = {"num_tokens": 4096, "mhc_mult": 4, "hidden": 7168}
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, NAMES)


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# -- the specs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_specs(name):
    s = tkjit.get_spec(name)
    assert s.family == "mhc" and [p.name for p in s.params] == ["num_tokens", "mhc_mult", "hidden"]
    full = s.canonical_shape(SHAPE)
    assert s.default_config(full) == {"threads": 128, "rows": 1, "vec_bytes": 16, "unroll": 7}
    assert len(s.configs(full)) > 100
    assert s.configs(full, arch="cpu") == []  # bf16: CUDA only
    for h in (1, 7, 64, 576, 1280, 2560, 4096, 7168, 7680):
        for m in (1, 2, 4, 8, 16):
            f = s.canonical_shape({"num_tokens": 3, "mhc_mult": m, "hidden": h})
            assert s.constraint(f, s.default_config(f)) is None, (h, m)
    assert s.bytes_moved(s.canonical_shape({"num_tokens": 2, "mhc_mult": 4, "hidden": 8})) == 2 * 5 * 8 * 2


@pytest.mark.parametrize("shape, match", [
    ({"num_tokens": 8, "mhc_mult": 0, "hidden": 64}, "mhc_mult"),
    ({"num_tokens": 8, "mhc_mult": 17, "hidden": 64}, "mhc_mult"),
    ({"num_tokens": 8, "mhc_mult": 4, "hidden": 0}, "hidden"),
    ({"mhc_mult": 4, "hidden": 64}, "num_tokens"),
])
def test_bad_shapes(shape, match):
    with pytest.raises(tkjit.ShapeError, match=match):
        tkjit.get_spec("expand_to_mhc").canonical_shape(shape)


def test_bad_configs():
    s = tkjit.get_spec("expand_to_mhc")
    full = s.canonical_shape({"num_tokens": 8, "mhc_mult": 4, "hidden": 1284})  # 2568 bytes: 8-byte vectors
    with pytest.raises(tkjit.ConfigError, match="vec_bytes"):
        s.check_config(full, {"threads": 128, "rows": 1, "vec_bytes": 16, "unroll": 1})
    with pytest.raises(tkjit.ConfigError, match="C target"):
        s.check_config(full, s.default_config(full), arch="cpu")


def test_references_by_hand():
    fwd, bwd = tkjit.get_spec("expand_to_mhc"), tkjit.get_spec("expand_to_mhc_bwd")
    x = torch.tensor([[1.0, -2.0, 0.5]]).bfloat16()
    y = fwd.reference({"mhc_mult": 3}, x)
    assert y.shape == (1, 3, 3) and y.is_contiguous() and all(torch.equal(y[0, m], x[0]) for m in range(3))
    # In order from +0.0, in float32: 256 + 1 + 1 = 258 exactly; -0 + -0 + -0 -> +0 (the +0.0 start);
    # 1 + 2**-30 rounds to 1 before the -1 (float64 would keep 2**-30).
    g = torch.tensor([[[256.0, -0.0, 1.0], [1.0, -0.0, 2.0**-30], [1.0, -0.0, -1.0]]]).bfloat16()
    r = bwd.reference({"mhc_mult": 3}, g)
    assert r.dtype == torch.bfloat16 and r.tolist() == [[258.0, 0.0, 0.0]]
    assert not torch.signbit(r[0, 1])


@pytest.mark.parametrize("seed", [0, 1])
def test_references_match_float64_autograd(seed):
    """The backward reference is torch autograd of TileKernels' expand reference, rounded once to bf16
    (wherever float32 sums exactly, i.e. all of these)."""
    fwd, bwd = tkjit.get_spec("expand_to_mhc"), tkjit.get_spec("expand_to_mhc_bwd")
    full = fwd.canonical_shape({"num_tokens": 33, "mhc_mult": 4, "hidden": 40})
    (x,) = fwd.make_inputs(full, seed=seed)
    (g,) = bwd.make_inputs(full, seed=seed)
    xd = x.double().requires_grad_(True)
    y = xd.unsqueeze(-2).expand(33, 4, 40).contiguous()
    y.backward(g.double())
    assert torch.equal(fwd.reference(full, x), y.detach().bfloat16())
    assert torch.equal(bwd.reference(full, g), xd.grad.bfloat16())


def test_gradcheck_of_the_autograd_pair(reference_kernels):
    """torch.autograd.gradcheck-style: the op's gradient against finite differences of its forward (exact on
    bf16-representable values: the forward is a copy, the backward a sum rounded once)."""
    x = bf16(6, 16, seed=2)
    x[2, 5] = 0.0  # x + e exact in bf16 at the probed element
    x.requires_grad_(True)
    y = ops.expand_to_mhc(x, 3)
    v = bf16(6, 3, 16, seed=3)
    (gx,) = torch.autograd.grad(y, x, v)
    assert torch.equal(gx, v.float().sum(1).bfloat16())
    e = torch.zeros_like(x)
    e[2, 5] = 1.0
    fd = ((ops.expand_to_mhc(x.detach() + e, 3).float() - y.detach().float()) * v.float()).sum()
    assert torch.equal(fd.bfloat16(), gx[2, 5])  # the kernel's sum rounds once to bf16


# -- the ops -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lead", [(5,), (2, 7), (1, 1), (0,)])
def test_ops_forward_backward(reference_kernels, lead):
    x = bf16(*lead, 24, seed=1).requires_grad_(True)
    y = ops.expand_to_mhc(x, 4)
    assert y.shape == (*lead, 4, 24) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert y.grad_fn.next_functions[0][0].variable is x  # one autograd node: no views around the Function
    assert torch.equal(y, x.detach().unsqueeze(-2).expand(*lead, 4, 24))
    g = bf16(*lead, 4, 24, seed=2)
    y.backward(g)
    acc = torch.zeros(*lead, 24)
    for m in range(4):
        acc = acc + g[..., m, :].float()
    assert torch.equal(x.grad, acc.bfloat16())
    assert torch.equal(ops.expand_to_mhc_bwd(g), acc.bfloat16())


def test_ops_out(reference_kernels):
    x = bf16(3, 5, 16)
    out = torch.full((3, 5, 2, 16), float("nan"), dtype=torch.bfloat16)
    got = ops.expand_to_mhc(x, 2, out)
    assert got is out and torch.equal(out, x.unsqueeze(-2).expand(3, 5, 2, 16))
    xr = x.clone().requires_grad_(True)
    out2 = torch.empty_like(out)
    y = ops.expand_to_mhc(xr, 2, out2)
    assert torch.equal(out2, out) and y.data_ptr() == out2.data_ptr()
    y.sum().backward()
    assert torch.equal(xr.grad, torch.full_like(x, 2.0))


def test_ops_refuse_bad_inputs(reference_kernels):
    x = bf16(4, 16)
    with pytest.raises(tkjit.TensorError, match="hidden must be torch.bfloat16"):
        ops.expand_to_mhc(x.float(), 4)
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        ops.expand_to_mhc(bf16(16, 4).T, 4)
    with pytest.raises(tkjit.ShapeError, match="mhc_mult"):
        ops.expand_to_mhc(x, 0)
    with pytest.raises(tkjit.TensorError, match="out must be"):
        ops.expand_to_mhc(x, 4, torch.empty(4, 3, 16, dtype=torch.bfloat16))
    with pytest.raises(tkjit.TensorError, match="out must be"):
        ops.expand_to_mhc(x, 4, torch.empty(4, 4, 16))
    with pytest.raises(tkjit.TensorError, match="out_grad"):
        ops.expand_to_mhc_bwd(bf16(4, 4, 16).float())


def test_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(37, 96, dtype=torch.bfloat16)
        y = torch.ops.tkjit.expand_to_mhc(x, 4)
        assert y.shape == (37, 4, 96) and y.dtype == torch.bfloat16
        g = torch.ops.tkjit.expand_to_mhc_bwd(torch.empty(37, 4, 96, dtype=torch.bfloat16))
        assert g.shape == (37, 96) and g.dtype == torch.bfloat16
        with pytest.raises(tkjit.TensorError, match="dtype"):
            torch.ops.tkjit.expand_to_mhc(x.float(), 4)
        with pytest.raises(tkjit.ShapeError, match="mhc_mult"):
            torch.ops.tkjit.expand_to_mhc(x, 17)


@pytest.mark.parametrize("n", [37, 0])
def test_opcheck(reference_kernels, n):
    x = bf16(n, 64, seed=4)
    r = torch.library.opcheck(torch.ops.tkjit.expand_to_mhc.default, (x, 4), test_utils=OPCHECK_TESTS)
    assert r == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), r
    g = bf16(n, 4, 64, seed=5)
    r = torch.library.opcheck(torch.ops.tkjit.expand_to_mhc_bwd.default, (g,), test_utils=OPCHECK_TESTS)
    assert r == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), r


def test_compile_fullgraph_forward_and_backward(reference_kernels):
    x = bf16(2, 9, 32, seed=6).requires_grad_(True)
    f = torch.compile(lambda t: ops.expand_to_mhc(t, 4) * 2, fullgraph=True, backend="aot_eager")
    y = f(x)
    g = bf16(2, 9, 4, 32, seed=7)
    y.backward(g)
    xe = x.detach().clone().requires_grad_(True)
    (ops.expand_to_mhc(xe, 4) * 2).backward(g)
    assert torch.equal(y, ops.expand_to_mhc(x.detach(), 4) * 2) and torch.equal(x.grad, xe.grad)


def test_double_backward_says_it_is_not_supported(reference_kernels):
    x = bf16(3, 16).requires_grad_(True)
    y = ops.expand_to_mhc(x, 2)
    (gx,) = torch.autograd.grad(y.float().square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="expand_to_mhc is differentiable once"):
        gx.float().sum().backward()


# -- the TileKernels entry point -----------------------------------------------------------------------------

def params(f):
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(f).parameters.values()]


def test_compat_signature():
    """TileKernels' modeling/mhc/ops/expand.py and modeling/mhc/functional.py, hard-coded."""
    pk, empty = "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty
    assert params(tk.expand_to_mhc) == [("hidden", pk, empty), ("mhc_mult", pk, empty), ("out", pk, None)]
    assert params(tk_mhc.expand_from_embedding) == [("x", pk, empty), ("mhc_mult", pk, 4)]


def test_compat_round_trip(reference_kernels):
    x = bf16(2, 8, 48, seed=8).requires_grad_(True)
    y = tk.expand_to_mhc(x, 4)
    assert torch.equal(y, x.detach().unsqueeze(-2).expand(2, 8, 4, 48).contiguous())
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.full_like(x, 4.0))
    assert torch.equal(tk_mhc.expand_from_embedding(x.detach()), y.detach())
    out = torch.empty(2, 8, 4, 48, dtype=torch.bfloat16)
    assert tk.expand_to_mhc(x.detach(), 4, out=out) is out and torch.equal(out, y.detach())


@pytest.mark.parametrize("call, error, match", [
    (lambda: tk.expand_to_mhc(bf16(4, 16).float(), 4), tkjit.TensorError, "tile_kernels.*hidden"),
    (lambda: tk.expand_to_mhc(bf16(16, 4).T, 4), tkjit.TensorError, "hidden must be contiguous"),
    (lambda: tk.expand_to_mhc(bf16(4, 16), 4.0), tkjit.ShapeError, "mhc_mult must be an int"),
    (lambda: tk.expand_to_mhc(bf16(4, 16), 0), tkjit.ShapeError, "mhc_mult must be an int >= 1"),
    (lambda: tk.expand_to_mhc("x", 4), tkjit.TensorError, "hidden must be a torch.Tensor"),
    (lambda: tk.expand_to_mhc(bf16(4, 16), 4, torch.empty(4, 16)), tkjit.TensorError, "out must be"),
])
def test_compat_refuses_what_tile_kernels_refuses(reference_kernels, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_compat_missing_sizes(reference_kernels):
    with pytest.raises(NotImplementedError, match="mhc_mult=17"):
        tk.expand_to_mhc(bf16(4, 16), 17)


# -- sm_90a cross-compiles -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, shape, config", [
    ("expand_to_mhc", SHAPE, None),
    ("expand_to_mhc", {"num_tokens": 8, "mhc_mult": 8, "hidden": 1284},
     {"threads": 64, "rows": 4, "vec_bytes": 4, "unroll": 3}),
    ("expand_to_mhc_bwd", SHAPE, None),
    ("expand_to_mhc_bwd", {"num_tokens": 8, "mhc_mult": 2, "hidden": 1280},
     {"threads": 256, "rows": 2, "vec_bytes": 8, "unroll": 2}),
])
def test_compiles_for_sm90a(cache_dir, name, shape, config):
    k = tkjit.get(name, shape, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert src.count("__global__") >= 1
    if config is None:
        assert "*(uint4*)" in src  # 16-byte vectors
