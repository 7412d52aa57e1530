"""Core service on the CPU: spec validation, keys, cache publish/verify, memo, get, CLI, real compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tkjit
from tkjit import api
from tkjit.cache import Cache
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, validate

ROOT = Path(__file__).resolve().parent.parent
SINK = {"num_tokens": 4001, "n": 4}


def _env(cache_dir) -> dict:
    env = dict(os.environ)
    env["TKJIT_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _toy_spec(**over) -> KernelSpec:
    base = dict(
        name="toy_copy", family="test", doc="copy", params=(Runtime("n"), Static("w", values=(4, 8), default=4)),
        space={"block": (32, 64)}, default=lambda s: {"block": 32}, build=lambda s, c: None,
        inputs=(TensorArg("x", "float32", ("n", "w")),), outputs=(TensorArg("y", "float32", ("n", "w")),),
        make_inputs=lambda s, device="cpu", seed=0: (torch.randn(s["n"], s["w"]),),
        reference=lambda s, x: x, bytes_moved=lambda s: 8 * s["n"] * s["w"], examples=({"n": 10},),
    )
    base.update(over)
    return KernelSpec(**base)


# -- spec model -------------------------------------------------------------------------------










# -- keys -------------------------------------------------------------------------------------








# -- cache ------------------------------------------------------------------------------------
def _fake_build(tag: str):
    def build(staging: Path) -> dict:
        (staging / "kernel.so").write_bytes(tag.encode() * 100)
        return {"abi": {"loader": "none"}}

    return build


def test_publish_verify_and_quarantine(cache_dir):
    c = Cache()
    k = "a" * 40
    e = c.get_or_build(k, {"kernel": "toy"}, _fake_build("x"))
    assert (e.path / "kernel.so").read_bytes() == b"x" * 100
    assert oct(e.path.stat().st_mode & 0o777) == "0o700"
    assert oct((e.path / "kernel.so").stat().st_mode & 0o777) == "0o600"
    assert c.get_or_build(k, {}, _fake_build("never")).path == e.path  # hit: not rebuilt
    (e.path / "kernel.so").write_bytes(b"y" * 100)  # same size, different bytes
    e2 = c.get_or_build(k, {"kernel": "toy"}, _fake_build("z"))
    assert (e2.path / "kernel.so").read_bytes() == b"z" * 100
    q = list((c.base / "quarantine").iterdir())
    assert len(q) == 1 and "sha256" in (q[0] / "REASON").read_text()
    assert list((c.base / "staging").iterdir()) == []


def test_malformed_key_never_becomes_a_path(cache_dir):
    with pytest.raises(tkjit.CacheError):
        Cache().entry_path("../../etc")


# -- get, memo, real compiles -----------------------------------------------------------------
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
    # A second process gets it from disk without compiling (no TileLang import).
    code = (
        "import sys, torch, tkjit; k = tkjit.get('sinkhorn_fwd', {'num_tokens': 9, 'n': 4}, arch='cpu');"
        "y = k(torch.randn(9, 4, 4)); print(k.key, 'tilelang' in sys.modules, bool(torch.isfinite(y).all()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(cache_dir), capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [k.key, "False", "True"]


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


@pytest.mark.slow
def test_cross_compile_sm90a_on_a_cpu_host(cache_dir):
    k = tkjit.get("sinkhorn_fwd", SINK, arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert "sinkhorn_thread_kernel" in src
    meta = json.loads((k.path / "manifest.json").read_text())["meta"]
    assert meta["arch"] == "sm_90a" and meta["abi"]["loader"] == "tvm_ffi"
    with pytest.raises(tkjit.TensorError, match="needs cuda tensors"):
        k(torch.randn(4, 4, 4))


def test_explicit_config_and_arch_errors(cache_dir):
    with pytest.raises(tkjit.ConfigError):
        tkjit.get("sinkhorn_fwd", SINK, arch="cpu", config={"layout": "smem"})
    with pytest.raises(tkjit.TkjitError, match="invalid arch"):
        tkjit.get("sinkhorn_fwd", SINK, arch="sm_90a; rm -rf /")


# -- CLI --------------------------------------------------------------------------------------
def _cli(cache_dir, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tkjit.cli", *args], cwd=ROOT, env=_env(cache_dir),
                          capture_output=True, text=True)


@pytest.mark.slow
def test_cli_compile_list_show_clear_doctor(cache_dir):
    r = _cli(cache_dir, "compile", "sinkhorn_fwd", "--shape", "num_tokens=4096", "n=4", "--arch", "sm_90a")
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout
    r = _cli(cache_dir, "list")
    assert r.returncode == 0 and "sinkhorn_fwd" in r.stdout and "sm_90a" in r.stdout
    assert "tuned:shipped" in r.stdout  # tuning_db/sm_90a serves a CPU host that names the arch
    assert "sinkhorn_fwd" in _cli(cache_dir, "show", "sinkhorn_fwd").stdout
    assert "layout" in _cli(cache_dir, "specs").stdout
    r = _cli(cache_dir, "doctor")
    assert r.returncode == 0 and "nvcc" in r.stdout and str(cache_dir) in r.stdout
    r = _cli(cache_dir, "compile", "sinkhorn_fwd", "--shape", "num_tokens=4096", "bogus=1", "--arch", "sm_90a")
    assert r.returncode == 1 and "unknown shape params" in r.stderr
    assert "removed 1" in _cli(cache_dir, "clear").stdout
    assert "empty" in _cli(cache_dir, "list").stdout


def test_memo_key_ignores_nothing(cache_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(api, "_resolve", lambda *a: calls.append(a) or object())
    a = tkjit.get("k", {"num_tokens": 1})
    assert tkjit.get("k", {"num_tokens": 1}) is a and len(calls) == 1
    tkjit.get("k", {"num_tokens": 2})
    tkjit.get("k", {"num_tokens": 1}, arch="cpu")
    tkjit.get("k", {"num_tokens": 1}, config={"a": 1})
    assert len(calls) == 4


@pytest.mark.slow
def test_ops_forms_on_cpu(cache_dir):
    x = torch.randn(6, 4, 4, requires_grad=True)
    tkjit.ops.sinkhorn(x).sum().backward()
    assert x.grad.shape == (6, 4, 4) and torch.isfinite(x.grad).all()
    t = torch.randn(3, 5)
    assert torch.equal(tkjit.ops.transpose(t), t.t())
    with pytest.raises(tkjit.TensorError, match="2-D or 3-D"):
        tkjit.ops.transpose(torch.randn(2, 2, 2, 2))


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


def test_targets_that_cannot_lower_a_kernel_say_why(cache_dir):
    with pytest.raises(tkjit.ConfigError, match="C target has no bfloat16"):
        tkjit.ops.transpose(torch.randn(3, 5).bfloat16())
    with pytest.raises(tkjit.ConfigError, match="CUDA targets only"):
        tkjit.get("topk_gate", {"num_tokens": 4, "num_experts": 64, "k": 2}, arch="cpu")
