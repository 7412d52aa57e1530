"""tkjit.get (tkjit.api): the whole path on the C target, a cross-compile on a CPU host, the memo, and bad
shapes, configs, arches and kernel names failing with a clear tkjit error."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from common import ROOT, SINK  # noqa: E402
from common import subprocess_env as _env  # noqa: E402

import tkjit  # noqa: E402
from tkjit import api, envs  # noqa: E402
from tkjit.errors import ConfigError, ShapeError, TkjitError, UnknownKernelError  # noqa: E402
from tkjit.registry import get_spec  # noqa: E402

SPEC = get_spec("sinkhorn_fwd")
FULL = SPEC.canonical_shape({"num_tokens": 64})
OK_CFG = SPEC.default_config(FULL, "cpu")


@pytest.mark.slow
def test_cpu_end_to_end_compile_run_and_reload(cache_dir):
    """The whole path on the C target: compile, publish, load through ctypes, run, check."""
    from tkjit.testing import check

    k = tkjit.get("sinkhorn_fwd", SINK, arch="cpu")
    assert k.config_source == "default" and k.arch == "cpu"
    for t in (1, 7, 4001):
        assert check(k, {**SINK, "num_tokens": t}, device="cpu", seed=t) is None
    y = tkjit.ops.sinkhorn_fwd(torch.randn(33, 4, 4))
    assert y.shape == (33, 4, 4) and torch.isfinite(y).all()
    assert tkjit.ops.sinkhorn_fwd(torch.randn(0, 4, 4)).shape == (0, 4, 4)  # empty batch: no launch
    # Memo: the same call returns the same object, fast.
    assert tkjit.get("sinkhorn_fwd", SINK, arch="cpu") is k
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        tkjit.get("sinkhorn_fwd", SINK, arch="cpu")
    assert (time.perf_counter() - t0) / n < 50e-6  # generous: CI machines are slow; README has the figure
    # A second process gets it from disk without compiling (no TileLang import), nor importing what serving a
    # cached kernel does not need (each of these costs a fresh process milliseconds).
    code = (
        "import sys, torch, tkjit; k = tkjit.get('sinkhorn_fwd', {'num_tokens': 9, 'n': 4}, arch='cpu');"
        "y = k(torch.randn(9, 4, 4)); print(k.key, 'tilelang' in sys.modules, bool(torch.isfinite(y).all()),"
        "[m for m in ('optuna', 'tvm_ffi', 'decimal') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(cache_dir), capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [k.key, "False", "True", "[]"]


@pytest.mark.slow
def test_cross_compile_sm90a_on_a_cpu_host(cache_dir):
    k = tkjit.get("sinkhorn_fwd", SINK, arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert "sinkhorn_thread_kernel" in src
    meta = json.loads((k.path / "manifest.json").read_text())["meta"]
    assert meta["arch"] == "sm_90a" and meta["abi"]["loader"] == envs.launcher()
    with pytest.raises(tkjit.TensorError, match="needs cuda tensors"):
        k(torch.randn(4, 4, 4))


def test_explicit_config_and_arch_errors(cache_dir):
    with pytest.raises(tkjit.ConfigError):
        tkjit.get("sinkhorn_fwd", SINK, arch="cpu", config={"layout": "smem"})
    with pytest.raises(tkjit.TkjitError, match="invalid arch"):
        tkjit.get("sinkhorn_fwd", SINK, arch="sm_90a; rm -rf /")


def test_memo_key_ignores_nothing(cache_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(api, "_resolve", lambda *a: calls.append(a) or object())
    a = tkjit.get("k", {"num_tokens": 1})
    assert tkjit.get("k", {"num_tokens": 1}) is a and len(calls) == 1
    tkjit.get("k", {"num_tokens": 2})
    tkjit.get("k", {"num_tokens": 1}, arch="cpu")
    tkjit.get("k", {"num_tokens": 1}, config={"a": 1})
    assert len(calls) == 4


# -- bad input ----------------------------------------------------------------------------------
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
