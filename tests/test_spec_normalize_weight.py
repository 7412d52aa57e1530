"""normalize_weight on a CPU host: the spec, its reference against a float32 model of the sum, real
runs on TileLang's C target, an sm_90a cross-compile, the torch op and the TileKernels compat entry."""

import numpy as np
import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.testing import bit_equal, check

pytestmark = pytest.mark.usefixtures("module_cache")
NAME = "normalize_weight"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def spec():
    return tkjit.get_spec(NAME)


def test_registered_and_valid():
    s = spec()
    assert s.family == "moe" and s.tolerance.exact
    assert [p.name for p in s.runtime_params] == ["num_tokens"]
    for ex in s.examples:
        full = s.canonical_shape(ex)
        assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
        assert s.default_config(full, "cpu") in s.configs(full, "cpu")
    full = s.canonical_shape({"num_tokens": 8192, "num_topk": 8})
    assert s.default_config(full) == {"block_rows": 128, "threads": 128, "vec": 4}
    assert len(s.configs(full)) > 30
    for k in (1, 2, 3, 6, 8, 9, 16, 256):
        f = s.canonical_shape({"num_tokens": 7, "num_topk": k})
        assert s.constraint(f, s.default_config(f)) is None, k


@pytest.mark.parametrize("shape, match", [
    ({"num_tokens": 8, "num_topk": 0}, "num_topk"),
    ({"num_tokens": 8, "num_topk": 257}, "num_topk"),
    ({"num_tokens": 0, "num_topk": 8}, "num_tokens"),
    ({"num_topk": 8}, "num_tokens"),
])
def test_bad_shapes(shape, match):
    with pytest.raises(ShapeError, match=match):
        spec().canonical_shape(shape)


def test_bad_configs():
    s = spec()
    full = s.canonical_shape({"num_tokens": 8, "num_topk": 6})
    good = s.default_config(full)
    with pytest.raises(ConfigError, match="multiple of 4"):
        s.check_config(full, {**good, "vec": 4})
    with pytest.raises(ConfigError, match="multiple of threads"):
        s.check_config(full, {**good, "block_rows": 64, "threads": 128})
    with pytest.raises(ConfigError, match="8 rows"):
        s.check_config(full, {**good, "block_rows": 1024, "threads": 64})


def _model(w: torch.Tensor):
    """The sum and quotients one float32 operation at a time, in numpy (an independent computation)."""
    a = w.numpy()
    den = np.empty(a.shape[0], dtype=np.float32)
    out = np.empty_like(a)
    for r in range(a.shape[0]):
        s = np.float32(1e-20)
        for v in a[r]:
            s = np.float32(s + v)
        den[r] = s
        out[r] = a[r] / s
    return torch.from_numpy(den), torch.from_numpy(out)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_reference_is_the_in_order_float32_sum(seed):
    s = spec()
    full = s.canonical_shape({"num_tokens": 64, "num_topk": 9})
    (w,) = s.make_inputs(full, seed=seed)
    assert bit_equal(s.reference(full, w), _model(w))
    # The order matters: a tree sum differs somewhere on these inputs (else the test would prove nothing).
    if seed % 2:
        tree = (w[:, :4].sum(1) + w[:, 4:].sum(1)) + 1e-20
        assert not torch.equal(tree, s.reference(full, w)[0])


def test_reference_edge_rows():
    s = spec()
    w = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 1.0], [1e-40, 0.0, 3e-41]])
    den, out = s.reference({"num_tokens": 3, "num_topk": 3}, w)
    assert den[0] == torch.tensor(1e-20, dtype=torch.float32) and out[0].tolist() == [0.0, 0.0, 0.0]
    assert out[1].tolist() == [0.25, 0.5, 0.25]
    assert bool((out[2] > 0).any())  # subnormal weights are not flushed to zero


def test_make_inputs_are_fresh_and_cover_edge_rows():
    s = spec()
    full = s.canonical_shape({"num_tokens": 64, "num_topk": 8})
    (a,), (b,) = s.make_inputs(full, seed=0), s.make_inputs(full, seed=1)
    assert a.dtype == torch.float32 and a.shape == (64, 8) and bool((a > 0).all())
    assert bool((b[0] == 0).all()) and bool(((b[1] > 0) & (b[1] < 1.2e-38)).any())
    assert s.bytes_moved(full) == 64 * 17 * 4


@pytest.mark.parametrize("k", [1, 2, 6, 8, 9])
def test_c_target_runs_match_the_reference(k):
    s = spec()
    full = s.canonical_shape({"num_tokens": 100, "num_topk": k})
    configs = [s.default_config(full, "cpu")]
    configs += [c for c in s.configs(full, "cpu") if c["block_rows"] == 512 and c["threads"] == 64][:2]
    for cfg in configs:
        kern = tkjit.get(NAME, full, arch="cpu", config=cfg)
        for t in (1, 7, 4001):
            for seed in (0, 1):
                assert check(kern, {"num_tokens": t, "num_topk": k}, device="cpu", seed=seed) is None, (cfg, t)
        den, out = kern(torch.empty(0, k))
        assert den.shape == (0,) and out.shape == (0, k)


def test_cross_compiles_for_sm90a_with_ieee_division():
    kern = tkjit.get(NAME, {"num_tokens": 8192, "num_topk": 8}, arch="sm_90a")
    src = (kern.path / "kernel.cu").read_text()
    assert kern.config["vec"] == 4 and "float4" in src
    for fast in ("__fdividef", "__frcp", "__fdiv_", "div.approx"):
        assert fast not in src


# -- torch op ----------------------------------------------------------------------------------------

def test_op_opcheck_and_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.normalize_weight.default
    assert "(Tensor topk_weights, str? config=None) -> (Tensor, Tensor)" in str(op._schema)
    for t in (37, 0):
        w = torch.rand(t, 8)
        assert torch.library.opcheck(op, (w,), test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode():
        den, out = op(torch.empty(13, 6))
        assert den.shape == (13,) and out.shape == (13, 6) and out.dtype == torch.float32
    den, out = op(torch.empty(5, 6, device="meta"))
    assert den.shape == (5,) and out.is_meta
    with pytest.raises(TensorError, match="dtype"):
        op(torch.empty(5, 6, device="meta", dtype=torch.float64))


def test_op_eager_and_compiled_are_bit_exact():
    s = spec()
    full = s.canonical_shape({"num_tokens": 333, "num_topk": 8})
    (w,) = s.make_inputs(full, seed=1)
    want = s.reference(full, w)
    assert bit_equal(tkjit.ops.normalize_weight(w), want)
    assert bit_equal(torch.ops.tkjit.normalize_weight(w), want)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        den, out = tkjit.ops.normalize_weight(x)
        return den * 1.0, out + 0.0

    assert bit_equal(f(w), want)


# -- compat ------------------------------------------------------------------------------------------

def test_compat_matches_tile_kernels_reference():
    s = spec()
    for k in (2, 6, 8, 9):
        full = s.canonical_shape({"num_tokens": 401, "num_topk": k})
        (w,) = s.make_inputs(full, seed=k)
        den, out = tk.moe.normalize_weight(w)
        assert bit_equal((den, out), _model(w))
        assert den.is_contiguous() and out.is_contiguous()
    den, out = tk.moe.normalize_weight(torch.empty(0, 8))
    assert den.shape == (0,) and out.shape == (0, 8) and den.dtype == out.dtype == torch.float32
    # A view that starts off the kernel's 16-byte alignment is read from an aligned copy.
    w = torch.rand(33 * 8 + 1)[1:].view(33, 8)
    assert bit_equal(tk.moe.normalize_weight(w), _model(w.clone()))


@pytest.mark.parametrize("x, err, match", [
    (torch.rand(4, 8, dtype=torch.float64), TensorError, "topk_weights must be torch.float32"),
    (torch.rand(4, 8, 2), TensorError, "topk_weights must be 2-D"),
    (torch.rand(8, 4).t(), TensorError, "topk_weights must be contiguous"),
    ([[1.0]], TensorError, "topk_weights must be a torch.Tensor"),
])
def test_compat_argument_errors(x, err, match):
    with pytest.raises(err, match=match):
        tk.moe.normalize_weight(x)


def test_compat_too_many_weights_is_not_implemented():
    with pytest.raises(NotImplementedError, match="num_topk"):
        tk.moe.normalize_weight(torch.rand(4, 300))
