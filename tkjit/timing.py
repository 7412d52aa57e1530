"""Timing, the way METHOD.md says: CUDA events, L2 flushed between runs, median of many.

One implementation for the benchmarks, the GPU tests and the tuner's bench worker:
  - `time_cuda`: a fixed number of runs (benchmarks, tests);
  - timers (`CudaEventTimer`, `PerfCounterTimer` for the C target, which runs on the host) size
    their sample count from a time budget; the bench worker builds one from an import path
    ("module:attr", see `load_timer`) so the spawned worker can build it and tests can inject a fake.
Every function returns raw per-run samples in microseconds; callers take the median.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

L2_FLUSH_BYTES = 256 << 20  # larger than any current L2 (H200: 50 MB; B200: 126 MB)
_flush_buf: dict = {}


def flush_l2(value: int = 1) -> None:
    """Overwrite a buffer larger than L2 so no run starts with warm inputs.

    Never zeros (no zero-page or compression shortcuts); vary `value` between runs.
    """
    import torch

    idx = torch.cuda.current_device()
    buf = _flush_buf.get(idx)
    if buf is None:
        buf = _flush_buf[idx] = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=f"cuda:{idx}")
    buf.fill_(value)


def _event_runs(fn: Callable[[], object], reps: int, flush: bool) -> list[float]:
    """`reps` runs of fn, each between two CUDA events (µs), each after an L2 flush."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i, (s, e) in enumerate(zip(starts, ends)):
        if flush:
            # Queued before the start event, so the launch overhead hides behind it; a different
            # value each run, so no run sees the previous fill.
            flush_l2(i % 127 + 1)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def time_cuda(fn: Callable[[], object], *, reps: int = 50, warmup: int = 5, flush: bool = True) -> list[float]:
    """Per-run times in microseconds (warm-up excluded), each run after an L2 flush."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _event_runs(fn, reps, flush)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def rel_spread(xs: Sequence[float]) -> float:
    """Inter-quartile range over the median: how much one measurement of this kind moves."""
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(sorted(xs), n=4, method="inclusive")
    m = median(xs)
    return float((q[2] - q[0]) / m) if m > 0 else 0.0


def copy_ceiling_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = median(time_cuda(lambda: dst.copy_(src), reps=20, flush=False))
    return 2 * nbytes / (t * 1e-6) / 1e9


# ----------------------------------------------------------------------------------------------
# budgeted timers (the tuner's bench worker)
# ----------------------------------------------------------------------------------------------
EARLY_RUNS = 3  # runs a timer takes before it may stop early (context["stop_above_us"])


class Timer(Protocol):
    def measure(self, run: Callable[[], None], *, budget_s: float, context: Mapping[str, Any]) -> list[float]:
        """Per-run times in µs of `run()`, warm-up excluded. context: kernel, config, shape, device, and
        optionally stop_above_us: when the first few runs' median is above it, the timer may return those
        (the tuner's "clearly slower than the best so far": not worth the full budget)."""


def stops_early(xs: list[float], context: Mapping[str, Any]) -> bool:
    """Whether the first EARLY_RUNS samples `xs` are over the context's stop_above_us (the early-stop rule)."""
    stop = context.get("stop_above_us")
    return stop is not None and median(xs) > stop


class CudaEventTimer:
    """`time_cuda`'s method, with the warm-up and the sample count sized from a time budget."""

    def __init__(self, warmup_s: float = 0.01, min_reps: int = 10, max_reps: int = 400, flush: bool = True):
        self.warmup_s, self.min_reps, self.max_reps, self.flush = warmup_s, min_reps, max_reps, flush

    def measure(self, run: Callable[[], None], *, budget_s: float, context: Mapping[str, Any]) -> list[float]:
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
        first = _event_runs(run, EARLY_RUNS, self.flush)
        if stops_early(first, context):
            return first
        n = max(self.min_reps, min(self.max_reps, int(budget_s / est_s)))
        return first + _event_runs(run, max(1, n - EARLY_RUNS), self.flush)


class PerfCounterTimer:
    """Wall clock around each call (the C target runs synchronously on the CPU)."""

    def __init__(self, warmup: int = 2, min_reps: int = 5, max_reps: int = 200):
        self.warmup, self.min_reps, self.max_reps = warmup, min_reps, max_reps

    def measure(self, run: Callable[[], None], *, budget_s: float, context: Mapping[str, Any]) -> list[float]:
        for _ in range(self.warmup):
            run()
        out: list[float] = []
        t_end = time.perf_counter() + budget_s
        while len(out) < self.max_reps and (len(out) < self.min_reps or time.perf_counter() < t_end):
            t0 = time.perf_counter()
            run()
            out.append((time.perf_counter() - t0) * 1e6)
            if len(out) == EARLY_RUNS and stops_early(out, context):
                break
        return out


def default_timer(device: str = "cuda", **kw: Any) -> Timer:
    return PerfCounterTimer(**kw) if device == "cpu" else CudaEventTimer(**kw)


def load_timer(path: str | None, device: str, kwargs: Mapping[str, Any] | None = None) -> Timer:
    """Build the timer named by "module:attr" (a class or factory taking keyword arguments);
    None: the default for the device."""
    if not path:
        return default_timer(device, **dict(kwargs or {}))
    mod, _, attr = path.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj(**dict(kwargs or {}))
