"""The kernel ABI beyond plain tensors, on the C target with the test specs of helpers/abi_specs.py:
run-time scalars (one binary for every value), inout inputs updated in place and returned, zeroed
outputs, caller-sized outputs, optional inputs (a static flag selects the variant; an optional inout one
returned only by the variant taking it), and empty
batches (no launch, right-shaped outputs) for every kernel that runs on the C target. The same specs
cross-compile for sm_90a with the ABI recorded; tests/gpu/test_gpu_abi.py runs them on a GPU."""

import json
import sys
from pathlib import Path

import pytest
import torch

import tkjit
from tkjit import envs, loader
from tkjit.errors import LaunchError, ShapeError, TensorError
from tkjit.spec import ScalarArg, TensorArg

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import abi_specs  # noqa: E402  (registers axpy_inplace, scale_traced and bincount_scaled)

pytestmark = pytest.mark.usefixtures("module_cache")  # one cache: each kernel compiles once


def _meta(k):
    return json.loads((k.path / "manifest.json").read_text())["meta"]


def _axpy(n=37, has_bias=False):
    return tkjit.get("axpy_inplace", {"n": n, "has_bias": has_bias}, arch="cpu")


def _bincount(n=64, num_bins=8):
    return tkjit.get("bincount_scaled", {"n": n, "num_bins": num_bins}, arch="cpu")


# -- scalars and in place --------------------------------------------------------------------------


def test_scalar_reaches_the_kernel_one_binary_for_every_value():
    k1, k2 = _axpy(37), _axpy(1000)
    assert k1.key == k2.key  # alpha is not compiled in (neither is n)
    assert _meta(k1)["abi"]["scalars"] == [{"name": "alpha", "dtype": "float32"}]
    for k, n in ((k1, 37), (k2, 1000)):
        for alpha in (2.0, -0.5):
            x, y = torch.randn(n), torch.randn(n)
            want = y + alpha * x
            got = k(x, y, alpha)
            torch.testing.assert_close(got, want)
    x, y = torch.randn(37), torch.randn(37)
    want = y + 3 * x
    torch.testing.assert_close(k1(x, y, alpha=3), want)  # an int for a float scalar, by keyword


def test_inout_is_mutated_and_returned():
    k = _axpy()
    x, y = torch.randn(37), torch.randn(37)
    y0 = y.clone()
    got = k(x, y, 1.5)
    assert got is y
    torch.testing.assert_close(y, y0 + 1.5 * x)


def test_int_and_bool_scalars_and_zeroed_output():
    k = _bincount()
    idx = torch.tensor([0, 1, 1, -1, 9, 3, 7, -5], dtype=torch.int32)
    w = torch.randn(8)
    for scale in (1, 3, -2):
        for skip in (True, False):
            want = abi_specs.bincount_reference(idx, w, 8, scale, skip)
            torch.testing.assert_close(k(idx, w, scale, skip, num_bins=8), want)
    assert _meta(k)["abi"]["scalars"] == [{"name": "scale", "dtype": "int32"}, {"name": "skip_negative",
                                                                                 "dtype": "bool"}]


def test_zeroed_out_is_zero_filled_even_when_poisoned():
    k = _bincount()
    idx, w = torch.tensor([2, 2, 5], dtype=torch.int32), torch.ones(3)
    out = torch.full((8,), float("nan"))
    got = k(idx, w, scale=1, skip_negative=True, out=out)
    assert got is out
    assert out.tolist() == [0, 0, 2, 0, 0, 1, 0, 0]


def test_caller_sized_output_from_the_size_or_out():
    k = _bincount()
    idx, w = torch.tensor([0, 4, 12], dtype=torch.int32), torch.ones(3)
    assert k(idx, w, 1, True, num_bins=5).tolist() == [1, 0, 0, 0, 1]
    assert k(idx, w, 1, True, num_bins=13).shape == (13,)  # one binary for every num_bins
    assert k(idx, w, 1, True, out=torch.empty(13))[12] == 1
    assert k(idx, w, 1, True, num_bins=2, out=torch.empty(2)).tolist() == [1, 0]


def test_optional_input_selects_a_variant():
    off, on = _axpy(has_bias=False), _axpy(has_bias=True)
    assert off.key != on.key
    x, y, b = torch.randn(37), torch.randn(37), torch.randn(37)
    want = y + 2 * x + b
    torch.testing.assert_close(on(x, y, b, 2.0), want)
    y = torch.randn(37)
    want = y + 2 * x + b
    torch.testing.assert_close(on(x, y, bias=b, alpha=2.0), want)
    y = torch.randn(37)
    want = y + 2 * x
    torch.testing.assert_close(off(x, y, 2.0), want)
    y = torch.randn(37)
    want = y + 2 * x
    torch.testing.assert_close(off(x, y, bias=None, alpha=2.0), want)
    assert [d["arg"] for d in _meta(on)["abi"]["dynamic"]] == [0]
    with pytest.raises(TensorError, match="has_bias=False.*has_bias=True"):
        off(x, y, bias=b, alpha=2.0)
    with pytest.raises(TensorError, match="missing input tensor bias"):
        on(x, y, alpha=2.0)
    with pytest.raises(TensorError, match="bias is None but this kernel was built with has_bias=True"):
        on(x, y, None, 2.0)


def _traced(has_trace: bool, n: int = 37):
    return tkjit.get("scale_traced", {"n": n, "has_trace": has_trace}, arch="cpu")


def test_optional_inout_is_returned_only_where_present():
    off, on = _traced(False), _traced(True)
    x, trace = torch.randn(37), torch.randn(37)
    t0 = trace.clone()
    for _ in range(2):  # the full checks, then the plan they left
        got = off(x, 2.0)
        assert isinstance(got, torch.Tensor)
        torch.testing.assert_close(got, 2.0 * x)
    assert off(x, trace=None, alpha=2.0).shape == (37,)
    for i in range(2):
        got = on(x, trace, 2.0)
        assert isinstance(got, tuple) and len(got) == 2 and got[0] is trace
        torch.testing.assert_close(got[1], 2.0 * x)
        torch.testing.assert_close(trace, t0 + 2.0 * x * (i + 1))
    assert len(on._plans) == 1
    out = torch.full((37,), float("nan"))
    for _ in range(2):  # into out=: its own plan
        got = on(x, trace, 1.0, out=out)
        assert got[0] is trace and got[1] is out
    torch.testing.assert_close(out, x)
    torch.testing.assert_close(trace, t0 + 6.0 * x)
    got = on(x, trace=trace, alpha=1.0)  # by name
    assert got[0] is trace
    with pytest.raises(TensorError, match="trace is None but this kernel was built with has_trace=True"):
        on(x, None, 2.0)
    with pytest.raises(TensorError, match="has_trace=False.*has_trace=True"):
        off(x, trace=trace, alpha=2.0)


def test_optional_inout_against_the_reference():
    from tkjit.testing import check

    for has_trace in (False, True):
        k = _traced(has_trace)
        assert check(k, {"n": 37, "has_trace": has_trace}, device="cpu") is None


def test_optional_inout_empty_batch():
    k = _traced(True)
    k._launch = _no_launch
    x, trace = torch.empty(0), torch.empty(0)
    got = k(x, trace, 2.0)
    assert got[0] is trace and got[1].shape == (0,)


# -- misuse ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda k, x, y: k(x, y), TensorError, "missing scalar alpha"),
        (lambda k, x, y: k(x, y, "2"), TensorError, "scalar alpha must be a float, got '2'"),
        (lambda k, x, y: k(x, y, None), TensorError, "scalar alpha must be a float, got None"),
        (lambda k, x, y: k(x, y, 1.0, 2.0), TensorError, "at most 3 arguments"),
        (lambda k, x, y: k(x, y, 1.0, alpha=2.0), TensorError, "'alpha' given twice"),
        (lambda k, x, y: k(x, y, beta=2.0), TensorError, "unknown argument 'beta'"),
        (lambda k, x, y: k(x, y[:5], 2.0), TensorError, "other tensors say"),
        (lambda k, x, y: k(x, y.double(), 2.0), TensorError, "input y has dtype"),
    ],
)
def test_axpy_misuse(call, err, match):
    k = _axpy()
    with pytest.raises(err, match=match):
        call(k, torch.randn(37), torch.randn(37))


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda k, i, w: k(i, w, 1, True), ShapeError, r"num_bins is not read off any input.*num_bins=\.\.\."),
        (lambda k, i, w: k(i, w, 1.5, True, num_bins=4), TensorError, "scale must be a int, got 1.5"),
        (lambda k, i, w: k(i, w, True, True, num_bins=4), TensorError, "scale must be a int, got True"),
        (lambda k, i, w: k(i, w, 2**31, True, num_bins=4), TensorError, "does not fit int32"),
        (lambda k, i, w: k(i, w, 1, 1, num_bins=4), TensorError, "skip_negative must be a bool, got 1"),
        (lambda k, i, w: k(i, w, 1, True, num_bins="4"), ShapeError, "num_bins"),
        (lambda k, i, w: k(i, w, 1, True, num_bins=-1), ShapeError, "below its minimum"),
        (lambda k, i, w: k(i, w, 1, True, num_bins=4, out=torch.empty(5)), TensorError, "counts axis 0"),
        (lambda k, i, w: k(i, w, 1, True, out=torch.empty(2, 2)), TensorError, "output counts has 2 dims"),
        (lambda k, i, w: k(i, w, 1, True, out=torch.empty(4, dtype=torch.float64)), TensorError, "dtype"),
    ],
)
def test_bincount_misuse(call, err, match):
    k = _bincount()
    with pytest.raises(err, match=match):
        call(k, torch.zeros(3, dtype=torch.int32), torch.ones(3))


def test_check_abi_refuses_other_scalars():
    k = _axpy()
    meta, spec = _meta(k), k.spec
    tensors, runtime = spec.abi_tensors(k.shape), [p.name for p in spec.runtime_params]
    loader.check_abi(meta, "cpu", tensors, runtime, spec.abi_scalars())
    bad = [
        [],
        [{"name": "alpha", "dtype": "float64"}],
        [{"name": "beta", "dtype": "float32"}],
        [{"name": "alpha", "dtype": "float32"}] * 2,
    ]
    for scalars in bad:
        with pytest.raises(LaunchError, match="scalar args"):
            loader.check_abi({**meta, "abi": {**meta["abi"], "scalars": scalars}}, "cpu", tensors, runtime,
                             spec.abi_scalars())
    # and an entry of a spec without scalars that records some
    kb = _bincount()
    with pytest.raises(LaunchError, match="scalar args"):
        loader.check_abi(_meta(kb), "cpu", kb.spec.abi_tensors(kb.shape),
                         [p.name for p in kb.spec.runtime_params], [])


# -- empty batches: no launch, right-shaped outputs -----------------------------------------------------


def _no_launch(*a):
    raise AssertionError("an empty batch launched the kernel")


def test_empty_batches_of_the_test_specs():
    k = _axpy()
    k._launch = _no_launch
    x, y = torch.empty(0), torch.empty(0)
    assert k(x, y, 2.0) is y
    kb = _bincount()
    kb._launch = _no_launch
    idx, w = torch.empty(0, dtype=torch.int32), torch.empty(0)
    assert kb(idx, w, 1, True, num_bins=6).tolist() == [0.0] * 6  # zeroed, no launch
    assert kb(idx, w, 1, True, out=torch.full((3,), 7.0)).tolist() == [0.0] * 3
    assert kb(torch.tensor([1], dtype=torch.int32), torch.ones(1), 1, True, num_bins=0).shape == (0,)


@pytest.mark.parametrize(
    "name, shape, empty",
    [
        ("sinkhorn_fwd", {"num_tokens": 8, "n": 4}, {"num_tokens": 0}),
        ("sinkhorn_bwd", {"num_tokens": 8, "n": 4}, {"num_tokens": 0}),
        ("transpose", {"dtype": "float32", "cols": 8, "rows": 8}, {"rows": 0}),
        ("batched_transpose", {"dtype": "float32", "cols": 8, "rows": 8, "batch": 2}, {"rows": 0}),
        ("batched_transpose", {"dtype": "float32", "cols": 8, "rows": 8, "batch": 2}, {"batch": 0}),
    ],
)
def test_empty_batches_of_the_c_target_kernels(name, shape, empty):
    k = tkjit.get(name, shape, arch="cpu")
    k._launch = _no_launch
    sizes = {**shape, **empty}
    inputs = [torch.empty(t.resolve(sizes)[1], dtype=getattr(torch, t.resolve(sizes)[0])) for t in k.spec.inputs]
    got = k(*inputs)
    outs = got if isinstance(got, tuple) else (got,)
    assert [tuple(o.shape) for o in outs] == [t.resolve(sizes)[1] for t in k.spec.outputs]
    assert [o.dtype for o in outs] == [getattr(torch, t.resolve(sizes)[0]) for t in k.spec.outputs]


# -- sm_90a: cross-compiled, ABI recorded -----------------------------------------------------------


@pytest.mark.parametrize("name, shape, scalars", [
    ("axpy_inplace", {"n": 64, "has_bias": True}, [{"name": "alpha", "dtype": "float32"}]),
    ("bincount_scaled", {"n": 64, "num_bins": 8},
     [{"name": "scale", "dtype": "int32"}, {"name": "skip_negative", "dtype": "bool"}]),
    ("scale_traced", {"n": 64, "has_trace": True}, [{"name": "alpha", "dtype": "float32"}]),
])
def test_sm90a_cross_compile_records_the_scalars(name, shape, scalars):
    k = tkjit.get(name, shape, arch="sm_90a")
    abi = _meta(k)["abi"]
    assert abi["loader"] == envs.launcher() and abi["scalars"] == scalars  # (TKJIT_LAUNCHER: the CUDA launcher)
    spec = k.spec
    loader.check_abi(_meta(k), "sm_90a", spec.abi_tensors(k.shape), [p.name for p in spec.runtime_params],
                     spec.abi_scalars())


# -- declarations: registration and build checks ----------------------------------------------------


def _variant(**kw):
    import dataclasses

    return dataclasses.replace(abi_specs.AXPY, source_hash="", **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"scalars": (ScalarArg("alpha", str),)}, "scalar 'alpha' must be int, float or bool"),
        ({"scalars": (ScalarArg("alpha", int, "float32"),)}, "scalar 'alpha'"),
        ({"scalars": (ScalarArg("x", float),)}, "names must be unique"),
        ({"scalars": (ScalarArg("n", float),)}, "differ from the shape params"),
        ({"inputs": (TensorArg("x", "float32", ("n",)),)}, "there must be an output or an inout input"),
        ({"inputs": (TensorArg("x", "float32", ("n",)),
                     TensorArg("y", "float32", ("n",), inout=True, optional="has_bias"))},
         "an inout input that is not optional"),
        ({"inputs": (TensorArg("y", "float32", ("n",), inout=True),
                     TensorArg("b", "float32", ("n",), optional="n"))}, "optional input b must name a static bool"),
        ({"inputs": (TensorArg("y", "float32", ("n",), inout=True, zeroed=True),)}, "outputs only"),
        ({"outputs": (TensorArg("o", "float32", ("n",), inout=True),)}, "cannot be inout or optional"),
    ],
)
def test_validate_refuses_bad_declarations(kw, match):
    from tkjit.errors import SpecError
    from tkjit.spec import validate

    with pytest.raises(SpecError, match=match):
        validate(_variant(**kw))


@pytest.mark.parametrize(
    "scalars, match",
    [
        ((ScalarArg("alpha", float, "float64"),), "scalar params .* are not the spec's"),
        ((ScalarArg("beta", float),), "scalar params .* are not the spec's"),
        ((), "builder made 3 params, spec declares 2"),
    ],
)
def test_compile_refuses_a_builder_whose_scalars_differ(tmp_path, scalars, match):
    from tkjit.compiler import compile_to_dir
    from tkjit.errors import CompileError

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CompileError, match=match):
        compile_to_dir(_variant(scalars=scalars), {"has_bias": False}, {"unused": 0}, "cpu", out)


def test_compile_refuses_scalars_before_tensors(tmp_path):
    from tkjit.compiler import compile_to_dir
    from tkjit.errors import CompileError

    def build(shape, c):
        from tilelang import language as T

        n = T.dynamic("n")

        @T.prim_func
        def axpy(alpha: T.float32, x: T.Tensor[(n,), T.float32], y: T.Tensor[(n,), T.float32]):
            with T.Kernel(1, threads=1) as _:
                for i in T.serial(n):
                    y[i] = y[i] + alpha * x[i]

        return axpy

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CompileError, match="tensors first, then the scalars"):
        compile_to_dir(_variant(build=build), {"has_bias": False}, {"unused": 0}, "cpu", out)
