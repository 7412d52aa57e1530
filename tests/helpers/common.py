"""Shared by the CPU tests: the repo root, a sinkhorn shape, a subprocess environment and a toy spec."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tkjit.spec import KernelSpec, Runtime, Static, TensorArg

ROOT = Path(__file__).resolve().parent.parent.parent
SINK = {"num_tokens": 4001, "n": 4}


def subprocess_env(cache_dir) -> dict:
    """The environment for a child `python`: this checkout importable, `cache_dir` as its cache."""
    env = dict(os.environ)
    env["TKJIT_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def toy_spec(**over) -> KernelSpec:
    """A small valid spec (a copy of an (n, w) float32 tensor); `over` replaces any field."""
    base = dict(
        name="toy_copy", family="test", doc="copy", params=(Runtime("n"), Static("w", values=(4, 8), default=4)),
        space={"block": (32, 64)}, default=lambda s: {"block": 32}, build=lambda s, c: None,
        inputs=(TensorArg("x", "float32", ("n", "w")),), outputs=(TensorArg("y", "float32", ("n", "w")),),
        make_inputs=lambda s, device="cpu", seed=0: (torch.randn(s["n"], s["w"]),),
        reference=lambda s, x: x, bytes_moved=lambda s: 8 * s["n"] * s["w"], examples=({"n": 10},),
    )
    base.update(over)
    return KernelSpec(**base)


def launches_cooperatively(entry: Path) -> bool:
    """Whether a cached CUDA entry's launcher runs its kernel as a cooperative grid (grid-wide barriers):
    tvm_ffi's host module carries TileLang's tag for it, the cudart launcher calls cudaLaunchCooperativeKernel."""
    if (entry / "launcher.cu").exists():
        return "cudaLaunchCooperativeKernel(" in (entry / "launcher.cu").read_text()
    return b"tirx.use_cooperative_launch" in (entry / "kernel.so").read_bytes()
