"""The kernel ABI's scalars, inout, zeroed, caller-sized and optional arguments on a GPU (tvm_ffi
launcher), with the test specs of tests/helpers/abi_specs.py: the same checks as tests/test_abi.py."""

import json
import sys
from pathlib import Path

import pytest
import torch

import tkjit
from tkjit.errors import ShapeError, TensorError
from tkjit.loader import loader_for

sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
import abi_specs  # noqa: E402  (registers axpy_inplace, scale_traced and bincount_scaled)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]


def _axpy(n=4097, has_bias=False):
    return tkjit.get("axpy_inplace", {"n": n, "has_bias": has_bias})


def _bincount(n=1000, num_bins=8):
    return tkjit.get("bincount_scaled", {"n": n, "num_bins": num_bins})


def test_scalars_inout_and_optional_on_cuda():
    off, on = _axpy(), _axpy(has_bias=True)
    assert off.key != on.key and off.key == _axpy(33).key
    abi = json.loads((on.path / "manifest.json").read_text())["meta"]["abi"]
    assert abi["loader"] == loader_for("sm_90a") and abi["scalars"] == [{"name": "alpha", "dtype": "float32"}]
    for n in (4097, 33, 1):
        x, y, b = (torch.randn(n, device="cuda") for _ in range(3))
        for alpha in (2.0, -0.5):
            want = y + alpha * x
            assert off(x, y, alpha) is y
            torch.testing.assert_close(y, want)
            want = y + alpha * x + b
            assert on(x, y, b, alpha=alpha) is y
            torch.testing.assert_close(y, want)
    with pytest.raises(TensorError, match="missing scalar alpha"):
        off(x, y)
    with pytest.raises(TensorError, match="has_bias=False"):
        off(x, y, bias=b, alpha=1.0)


def test_optional_inout_on_cuda():
    off = tkjit.get("scale_traced", {"n": 1000, "has_trace": False})
    on = tkjit.get("scale_traced", {"n": 1000, "has_trace": True})
    x, trace = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    want = trace + 2.0 * x
    torch.testing.assert_close(off(x, 2.0), 2.0 * x)
    got = on(x, trace, 2.0)
    assert got[0] is trace
    torch.testing.assert_close(got[1], 2.0 * x)
    torch.testing.assert_close(trace, want)


def test_zeroed_caller_sized_output_on_cuda():
    k = _bincount()
    idx = torch.randint(-3, 12, (1000,), dtype=torch.int32, device="cuda")
    w = torch.randn(1000, device="cuda")
    for scale, skip in ((1, True), (3, False), (-2, True)):
        want = abi_specs.bincount_reference(idx.cpu(), w.cpu(), 8, scale, skip)
        torch.testing.assert_close(k(idx, w, scale, skip, num_bins=8).cpu(), want)
        out = torch.full((8,), float("nan"), device="cuda")
        assert k(idx, w, scale, skip, out=out) is out
        torch.testing.assert_close(out.cpu(), want)
    assert k(idx, w, 1, True, num_bins=13).shape == (13,)
    with pytest.raises(ShapeError, match="num_bins"):
        k(idx, w, 1, True)


def test_empty_batches_on_cuda():
    k = _axpy()
    x, y = torch.empty(0, device="cuda"), torch.empty(0, device="cuda")
    assert k(x, y, 2.0) is y
    kb = _bincount()
    idx, w = torch.empty(0, dtype=torch.int32, device="cuda"), torch.empty(0, device="cuda")
    assert kb(idx, w, 1, True, num_bins=6).cpu().tolist() == [0.0] * 6
