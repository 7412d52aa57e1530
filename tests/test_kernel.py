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
