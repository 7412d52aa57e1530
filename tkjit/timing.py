"""GPU timing the way METHOD.md says: CUDA events, L2 flushed between runs, median of many."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

_flush_buf: dict[int, torch.Tensor] = {}


def flush_l2(device: torch.device | None = None) -> None:
    """Overwrite a buffer larger than L2 (60 MB on the H200) so no run starts with warm inputs."""
    idx = torch.cuda.current_device() if device is None else device.index or 0
    buf = _flush_buf.get(idx)
    if buf is None:
        buf = _flush_buf[idx] = torch.empty(256 << 20, dtype=torch.uint8, device=f"cuda:{idx}")
    buf.random_(0, 255)  # never zeros: zero-page tricks should not apply to the flush either


def time_cuda(fn: Callable[[], object], *, reps: int = 50, warmup: int = 5, flush: bool = True) -> list[float]:
    """Per-run times in microseconds (warm-up excluded), each run after an L2 flush."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if flush:
            flush_l2()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> float:
    """Interquartile range over the median: the run-to-run noise of one measurement."""
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def copy_ceiling_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = median(time_cuda(lambda: dst.copy_(src), reps=20, flush=False))
    return 2 * nbytes / (t * 1e-6) / 1e9
