"""The lean launch path on a CUDA GPU: kernels loaded and called through the tvm-ffi C ABI (tkjit.ffi),
per-signature plans in CompiledKernel, CUDA streams and graphs, no tvm_ffi Python import when serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tkjit
from tkjit import envs, ffi, loader

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]

# What only the tvm-ffi launcher has (its Python module, its own argument checks past tkjit's): skipped where
# TKJIT_LAUNCHER picks the cudart one, whose launches every other GPU test file then runs.
tvm_ffi_only = pytest.mark.skipif(envs.launcher() != "tvm_ffi", reason="TKJIT_LAUNCHER is not tvm_ffi")

TOPK = {"num_tokens": 64, "num_experts": 256, "k": 8}


def _ref_topk(scores, k):
    spec = tkjit.get_spec("topk_gate")
    return spec.reference(spec.canonical_shape({**TOPK, "num_tokens": scores.shape[0], "k": k}), scores)


@tvm_ffi_only
def test_the_c_abi_launch_equals_tvm_ffis_and_the_reference():
    k = tkjit.get("topk_gate", TOPK)
    assert isinstance(k._launch, ffi.FfiKernel)
    meta = json.loads((k.path / "manifest.json").read_text())["meta"]
    py = loader._load_tvm_ffi_py(k.path / meta["lib"], meta)
    for seed in range(3):
        torch.manual_seed(seed)
        scores = torch.randn(64, 256, device="cuda")
        ours = k(scores)
        theirs = torch.empty_like(ours)
        py(scores, theirs)
        torch.cuda.synchronize()
        assert torch.equal(ours, theirs)
        assert torch.equal(ours, _ref_topk(scores, 8))
    assert len(k._plans) == 1


def test_repeat_calls_on_fresh_data_through_the_plan():
    """The planned call (checks once) and the fully checked one (out=) give the same bits on fresh data."""
    k = tkjit.get("sinkhorn_fwd", {"num_tokens": 4096, "n": 4})
    for seed in range(5):
        torch.manual_seed(seed)
        x = torch.randn(4096, 4, 4, device="cuda")
        y = k(x)
        full = k(x, out=torch.full_like(x, float("nan")))
        torch.cuda.synchronize()
        assert torch.equal(y, full) and bool(torch.isfinite(y).all())
    assert len(k._plans) == 1


def test_a_side_stream_launch_runs_on_it_and_the_env_stream_is_restored():
    k = tkjit.get("topk_gate", TOPK)
    scores = torch.randn(64, 256, device="cuda")
    want = _ref_topk(scores, 8)
    k(scores)  # the plan exists before the stream changes
    s = torch.cuda.Stream()
    env = ffi.lib().TVMFFIEnvGetStream
    before = env(ffi.KDL_CUDA, torch.cuda.current_device())
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # the side stream is busy: a launch on another stream would run first
        big = scores * 1  # written on s after the sleep
        got = k(big)
    assert env(ffi.KDL_CUDA, torch.cuda.current_device()) == before
    s.synchronize()
    assert torch.equal(got, want)


def test_cuda_graph_capture_and_replay():
    k = tkjit.get("topk_gate", TOPK)
    static_in = torch.randn(64, 256, device="cuda")
    k(static_in)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k(static_in)  # warm-up on the capture stream
        with torch.cuda.graph(g, stream=s):
            static_out = k(static_in)
    torch.cuda.current_stream().wait_stream(s)
    for seed in range(3):
        torch.manual_seed(seed)
        static_in.copy_(torch.randn(64, 256, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, _ref_topk(static_in, 8))


@tvm_ffi_only
def test_a_wrong_argument_reaching_the_kernel_is_a_launch_error():
    k = tkjit.get("topk_gate", TOPK)
    with pytest.raises(tkjit.LaunchError, match="dtype mismatch"):
        k._launch(torch.randn(64, 256, device="cuda", dtype=torch.float64),
                  torch.empty(64, 8, dtype=torch.int64, device="cuda"))
    scores = torch.randn(64, 256, device="cuda")
    assert torch.equal(k(scores), _ref_topk(scores, 8))


def test_serving_in_a_fresh_process_imports_no_tvm_ffi_package():
    tkjit.get("topk_gate", TOPK)  # cached
    code = (
        "import sys, torch, tkjit\n"
        "x = torch.randn(64, 256, device='cuda')\n"
        f"k = tkjit.get('topk_gate', {TOPK!r})\n"
        "y = k(x); torch.cuda.synchronize()\n"
        "assert y.shape == (64, 8) and y.dtype == torch.int64\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tvm_ffi', 'tilelang', 'tvm')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env=dict(os.environ)).stdout
    assert out.strip().splitlines()[-1] == "[]"
