"""Bad input gives a clear tkjit error; fuzzed shapes and configs never escape as anything else."""

from __future__ import annotations

import pytest
import torch

import tkjit
from tkjit.errors import ConfigError, ShapeError, TensorError, TkjitError, UnknownKernelError
from tkjit.registry import get_spec

SPEC = get_spec("sinkhorn_fwd")
FULL = SPEC.canonical_shape({"num_tokens": 64})
OK_CFG = SPEC.default_config(FULL, "cpu")


def test_unknown_kernel():
    with pytest.raises(UnknownKernelError, match="unknown kernel 'nope'.*sinkhorn_fwd"):
        tkjit.get("nope", {"num_tokens": 1}, arch="cpu")
    with pytest.raises(TkjitError):
        tkjit.get("../../etc/passwd", arch="cpu")


@pytest.mark.parametrize(
    "shape, match",
    [
        ({"num_tokens": 0}, "below its minimum"),
        ({"num_tokens": -5}, "below"),
        ({"num_tokens": 1 << 40}, "above its maximum"),
        ({"num_tokens": "many"}, "must be an int"),
        ({"num_tokens": 3.5}, "must be an int"),
        ({"num_tokens": True}, "must be an int"),
        ({"num_tokens": 8, "n": 0}, "below"),
        ({"num_tokens": 8, "n": 17}, "above"),
        ({"num_tokens": 8, "eps": float("nan")}, "finite"),
        ({"num_tokens": 8, "eps": "small"}, "float"),
        ({"num_tokens": 8, "bogus": 1}, "unknown shape params"),
        ({}, "missing shape params"),
        ([1, 2], "mapping"),
    ],
)
def test_wrong_shape_params(shape, match):
    with pytest.raises(ShapeError, match=match):
        tkjit.get("sinkhorn_fwd", shape, arch="cpu")


@pytest.mark.parametrize(
    "config, match",
    [
        ({**OK_CFG, "block_tokens": 3}, "not in the space"),
        ({**OK_CFG, "block_tokens": 64.0}, "not in the space"),
        ({**OK_CFG, "fast_math": 0}, "not in the space"),
        ({**OK_CFG, "layout": "smem"}, "C target"),
        ({**OK_CFG, "unroll": 2}, "unknown"),
        ({k: v for k, v in OK_CFG.items() if k != "threads"}, "missing"),
        ({**OK_CFG, "block_tokens": 64, "threads": 128}, "multiple of threads"),
        ("fast", "mapping"),
    ],
)
def test_configs_outside_the_space(config, match):
    with pytest.raises(ConfigError, match=match):
        tkjit.get("sinkhorn_fwd", {"num_tokens": 64}, arch="cpu", config=config)


def test_bad_arch():
    for arch in ("sm_9", "gpu", "../cpu", "", 90, 0):
        with pytest.raises(TkjitError, match="invalid arch"):
            tkjit.get("sinkhorn_fwd", {"num_tokens": 64}, arch=arch)




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


# -- fuzzing ----------------------------------------------------------------------------------













