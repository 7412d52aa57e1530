"""Timers: run a launch closure many times and return per-run times in microseconds.

They run inside the bench worker. A timer is named by an import path ("module:attr", a class or
factory taking keyword arguments) so the spawned worker can build it, and tests can inject a fake.
Every timer returns raw samples; callers take the median.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from tkjit.timing import flush_l2, median, rel_spread  # noqa: F401  (median, rel_spread: re-exported)


class Timer(Protocol):
    def measure(self, run: Callable[[], None], *, budget_s: float, context: Mapping[str, Any]) -> list[float]:
        """Per-run times in µs of `run()`, warm-up excluded. context: kernel, config, shape, device."""


class CudaEventTimer:
    """CUDA events around each launch; L2 flushed before each (a 256 MB write), warm-up excluded.

    Same method as `tkjit.timing.time_cuda`; separate so the worker can size the sample count.
    """

    def __init__(self, warmup_s: float = 0.01, min_reps: int = 10, max_reps: int = 400, flush: bool = True):
        self.warmup_s, self.min_reps, self.max_reps, self.flush = warmup_s, min_reps, max_reps, flush

    def measure(self, run, *, budget_s, context):
        import torch

        run()
        torch.cuda.synchronize()
        # Estimate one run (with its flush) to size the warm-up and the sample count.
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            if self.flush:
                flush_l2(1)
            run()
        e.record()
        torch.cuda.synchronize()
        est_s = max(s.elapsed_time(e) / 5e3, 1e-6)
        for _ in range(int(self.warmup_s / est_s)):
            run()
        n = max(self.min_reps, min(self.max_reps, int(budget_s / est_s)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            if self.flush:
                # Queued before the start event, so the launch overhead hides behind it.
                flush_l2(i % 127 + 1)
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e3 for a, b in zip(starts, ends)]


class PerfCounterTimer:
    """Wall clock around each call (the C target runs synchronously on the CPU)."""

    def __init__(self, warmup: int = 2, min_reps: int = 5, max_reps: int = 200):
        self.warmup, self.min_reps, self.max_reps = warmup, min_reps, max_reps

    def measure(self, run, *, budget_s, context):
        for _ in range(self.warmup):
            run()
        out: list[float] = []
        t_end = time.perf_counter() + budget_s
        while len(out) < self.max_reps and (len(out) < self.min_reps or time.perf_counter() < t_end):
            t0 = time.perf_counter()
            run()
            out.append((time.perf_counter() - t0) * 1e6)
        return out


def default_timer(device: str = "cuda", **kw: Any) -> Timer:
    return PerfCounterTimer(**kw) if device == "cpu" else CudaEventTimer(**kw)


def load_timer(path: str | None, device: str, kwargs: Mapping[str, Any] | None = None) -> Timer:
    """Build the timer named by "module:attr" (None: the default for the device)."""
    if not path:
        return default_timer(device, **dict(kwargs or {}))
    mod, _, attr = path.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj(**dict(kwargs or {}))
