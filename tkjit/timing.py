"""GPU timing the way METHOD.md says: CUDA events, L2 flushed between runs, median of many."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

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


def time_cuda(fn: Callable[[], object], *, reps: int = 50, warmup: int = 5, flush: bool = True) -> list[float]:
    """Per-run times in microseconds (warm-up excluded), each run after an L2 flush."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i, (s, e) in enumerate(zip(starts, ends)):
        if flush:
            flush_l2(i % 127 + 1)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


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
