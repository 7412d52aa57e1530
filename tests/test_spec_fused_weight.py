"""fused_weight on a CPU host: the spec, its reference against numpy's float32 product, an sm_90a
cross-compile (bf16 kernels do not lower on TileLang's C target), the torch op and the TileKernels
compat entry with the kernel replaced by one writing the reference (the GPU tests run the real one)."""

import inspect
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.testing import bit_equal

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
NAME = "fused_weight"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def spec():
    return tkjit.get_spec(NAME)


def _model(wh: torch.Tensor, we: torch.Tensor) -> torch.Tensor:
    """numpy's float32 product of the widened bf16 values (an independent computation)."""
    a = wh.float().numpy().astype(np.float32)
    b = we.float().numpy().astype(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        return torch.from_numpy(np.multiply(a, b, dtype=np.float32))


def test_registered_and_valid():
    s = spec()
    assert s.family == "engram" and s.tolerance.exact and not s.runtime_params
    for ex in s.examples:
        full = s.canonical_shape(ex)
        assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
        assert s.configs(full, "cpu") == []  # bf16: CUDA targets only
    full = s.canonical_shape({"hidden_size": 7168})
    assert full["hc_mult"] == 4
    assert s.default_config(full) == {"block_elems": 1024, "threads": 128, "vec": 8}
    assert len(s.configs(full)) > 50
    for h in (1, 2, 6, 256, 2560, 7168, 1 << 20):
        f = s.canonical_shape({"hidden_size": h})
        assert s.constraint(f, s.default_config(f)) is None, h
    assert s.default_config(s.canonical_shape({"hidden_size": 1 << 20}))["block_elems"] == 4096
    assert s.default_config(s.canonical_shape({"hidden_size": 6}))["vec"] == 2


@pytest.mark.parametrize("shape, match", [
    ({"hc_mult": 0, "hidden_size": 256}, "hc_mult"),
    ({"hc_mult": 65, "hidden_size": 256}, "hc_mult"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"hidden_size": (1 << 20) + 1}, "hidden_size"),
    ({"hc_mult": 4}, "hidden_size"),
])
def test_bad_shapes(shape, match):
    with pytest.raises(ShapeError, match=match):
        spec().canonical_shape(shape)


def test_bad_configs():
    s = spec()
    full = s.canonical_shape({"hidden_size": 260})
    with pytest.raises(ConfigError, match="multiple of 8"):
        s.check_config(full, {"block_elems": 1024, "threads": 128, "vec": 8})
    with pytest.raises(ConfigError, match="multiple of threads"):
        s.check_config(full, {"block_elems": 256, "threads": 128, "vec": 4})
    with pytest.raises(ConfigError, match="16 vector steps"):
        s.check_config(full, {"block_elems": 8192, "threads": 32, "vec": 4})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        s.check_config(full, {"block_elems": 1024, "threads": 128, "vec": 4}, arch="cpu")


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_reference_is_the_float32_product(seed):
    s = spec()
    full = s.canonical_shape({"hc_mult": 4, "hidden_size": 512})
    wh, we = s.make_inputs(full, seed=seed)
    assert wh.dtype == we.dtype == torch.bfloat16 and wh.shape == (4, 512)
    ref = s.reference(full, wh, we)
    assert ref.dtype == torch.float32 and bit_equal(ref, _model(wh, we))
    # Exact wherever the product stays normal: float64 rounds to the same float32.
    exact = wh.double() * we.double()
    normal = exact.abs().ge(2.0**-126) & exact.abs().le(3.4e38)
    assert torch.equal(ref[normal], exact[normal].float())
    if seed % 2:
        tiny = (ref != 0) & (ref.abs() < 2.0**-126)
        assert bool(tiny.any()) and bool(ref.isinf().any()) and not bool(ref.isnan().any())
        assert bool(((wh.float() != 0) & (wh.float().abs() < 2.0**-126)).any())  # subnormal inputs
        assert bool((ref == 0).any() & ((wh != 0) & (we != 0) & (ref == 0)).any())  # underflow to zero


def test_reference_hand_checked():
    wh = torch.tensor([[1.5, -2.0, 0.0, 3e38]], dtype=torch.bfloat16)
    we = torch.tensor([[1.5, 0.5, -1.0, 2.0]], dtype=torch.bfloat16)
    out = spec().reference({"hc_mult": 1, "hidden_size": 4}, wh, we)
    assert out[0, :3].tolist() == [2.25, -1.0, 0.0] and bool(out[0, 2].signbit()) and out[0, 3] == float("inf")
    assert spec().bytes_moved({"hc_mult": 4, "hidden_size": 7168}) == 4 * 7168 * 8


def test_cross_compiles_for_sm90a_without_fast_math():
    kern = tkjit.get(NAME, {"hc_mult": 4, "hidden_size": 7168}, arch="sm_90a")
    src = (kern.path / "kernel.cu").read_text()
    assert kern.config == {"block_elems": 1024, "threads": 128, "vec": 8}
    assert "__bfloat1622float2" in src and "*(float4*)(weight_fused" in src
    for fast in ("__fmul_", "ftz", "__fmaf"):
        assert fast not in src
    assert tkjit.get_spec(NAME).pass_configs(kern.config)["tl.enable_fast_math"] is False


def test_odd_hidden_sizes_cross_compile():
    for h in (6, 300):
        kern = tkjit.get(NAME, {"hc_mult": 3, "hidden_size": h}, arch="sm_90a")
        assert "if (" in (kern.path / "kernel.cu").read_text()  # the row-end guard


# -- torch op (the kernel replaced by one writing the reference) --------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    serve_references(monkeypatch, (NAME,))


def _args(hc=4, h=512, seed=0):
    s = spec()
    return s.make_inputs(s.canonical_shape({"hc_mult": hc, "hidden_size": h}), seed=seed)


def test_op_opcheck_and_fake_shapes(reference_kernels):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.fused_weight.default
    assert "(Tensor weight_hidden, Tensor weight_embed, str? config=None) -> Tensor" in str(op._schema)
    assert torch.library.opcheck(op, _args(), test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode(allow_non_fake_inputs=True) as m:
        out = op(*(m.from_tensor(a) for a in _args(hc=3, h=256)))
        assert out.shape == (3, 256) and out.dtype == torch.float32 and out.is_contiguous()
    wh, we = (a.to("meta") for a in _args())
    assert op(wh, we).is_meta
    with pytest.raises(TensorError, match="weight_embed has dtype torch.float32"):
        op(wh, we.float())
    with pytest.raises(TensorError, match="weight_embed has shape"):
        op(wh, we[:, :256])
    with pytest.raises(TensorError, match="fused_weight: weight_hidden: expected a 2-D"):
        op(wh[0], we)


def test_op_eager_and_compiled_are_bit_exact(reference_kernels):
    wh, we = _args(seed=1)
    want = _model(wh, we)
    assert bit_equal(tkjit.ops.fused_weight(wh, we), want)
    assert bit_equal(torch.ops.tkjit.fused_weight(wh, we), want)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(a, b):
        return tkjit.ops.fused_weight(a, b) * 1.0

    assert bit_equal(f(wh, we), want)


# -- compat ------------------------------------------------------------------------------------------

def test_compat_signature_is_tile_kernels():
    params = inspect.signature(tk.engram.fused_weight).parameters.values()
    assert [(p.name, p.kind, p.default) for p in params] == [
        (name, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty)
        for name in ("weight_hidden", "weight_embed")]


def test_compat_matches_the_product(reference_kernels):
    for hc, h, seed in ((4, 7168, 0), (4, 4096, 1), (1, 256, 2), (8, 2560, 3)):
        wh, we = _args(hc, h, seed)
        out = tk.engram.fused_weight(wh, we)
        assert bit_equal(out, _model(wh, we)) and out.is_contiguous()
    out = tk.engram.fused_weight(torch.empty(0, 512, dtype=torch.bfloat16), torch.empty(0, 512, dtype=torch.bfloat16))
    assert out.shape == (0, 512) and out.dtype == torch.float32
    # A transposed view and one that starts off the 16-byte alignment are read from copies.
    wh, we = _args(4, 256, 1)
    buf = torch.zeros(wh.numel() + 1, dtype=torch.bfloat16)
    buf[1:] = wh.view(-1)
    got = tk.engram.fused_weight(buf[1:].view(4, 256), we.t().contiguous().t())
    assert bit_equal(got, _model(wh, we))


@pytest.mark.parametrize("args, err, match", [
    (lambda wh, we: (wh.float(), we), TensorError, "weight_hidden must be torch.bfloat16"),
    (lambda wh, we: (wh, we.half()), TensorError, "weight_embed must be torch.bfloat16"),
    (lambda wh, we: (wh[0], we), TensorError, "weight_hidden must be 2-D"),
    (lambda wh, we: (wh, [[1.0]]), TensorError, "weight_embed must be a torch.Tensor"),
    (lambda wh, we: (wh, we[:2]), TensorError, r"weight_embed has shape \(2, 512\), weight_hidden \(4, 512\)"),
    (lambda wh, we: (wh[:, :200], we[:, :200]), ShapeError, r"hidden_size \(weight_hidden.shape\[1\] = 200\) must be"),
])
def test_compat_argument_errors(args, err, match):
    with pytest.raises(err, match=match):
        tk.engram.fused_weight(*args(*_args()))


def test_compat_sizes_tkjit_lacks_are_not_implemented():
    w = torch.ones(65, 256, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"fused_weight: hc_mult \(weight_hidden.shape\[0\]\)=65"):
        tk.engram.fused_weight(w, w)
