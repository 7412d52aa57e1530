"""tools/bench.py --isolate: each kernel runs in a child process, so a kernel whose child dies (a CUDA fault
poisons the context; here, on a host without a GPU, the child cannot run at all) or hangs costs its own rows
only, and the next kernel is still measured."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tool", ROOT / "tools" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"reps": 1, "no_compile": True, "shape": [], "kernel_timeout": 120.0, **kw})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the children die for want of a GPU only on a host without one")
def test_a_dead_child_costs_its_own_kernel_only(monkeypatch):
    bench = _bench()
    calls = []
    real = subprocess.run
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real(cmd, **kw))
    rows = bench.bench_isolated(["sinkhorn_fwd", "transpose"], _args(), 4000.0)
    assert [r["kernel"] for r in rows] == ["sinkhorn_fwd", "transpose"]  # the second kernel still ran
    # (the child's last line of stderr says why: here, no GPU; on a GPU host, e.g. an illegal address)
    assert all(r["note"].startswith("failed: exit ") and r["us"] is None for r in rows), rows
    assert all("--ceiling" in c and c[c.index("--ceiling") + 1] == "4000.0" for c in calls)


def test_a_hung_child_is_stopped_at_the_kernel_timeout(monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench.sys, "executable", sys.executable)
    rows = bench.bench_isolated(["sinkhorn_fwd"], _args(kernel_timeout=0.01), 4000.0)
    assert len(rows) == 1 and rows[0]["note"] == "failed: timed out after 0.01 s"
