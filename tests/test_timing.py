"""tkjit.timing on the host: the perf_counter timer, timer loading by import path, the statistics.
(The CUDA-event path runs in the GPU tests.)"""

import pytest

from tkjit import timing


def test_default_timer_per_device():
    assert isinstance(timing.default_timer("cpu"), timing.PerfCounterTimer)
    t = timing.default_timer("cuda", max_reps=7)
    assert isinstance(t, timing.CudaEventTimer) and t.max_reps == 7


def test_load_timer_by_import_path_with_kwargs():
    assert isinstance(timing.load_timer(None, "cpu"), timing.PerfCounterTimer)
    t = timing.load_timer("tkjit.timing:PerfCounterTimer", "cuda", {"min_reps": 3, "max_reps": 4})
    assert isinstance(t, timing.PerfCounterTimer) and (t.min_reps, t.max_reps) == (3, 4)
    with pytest.raises(AttributeError):
        timing.load_timer("tkjit.timing:NoSuchTimer", "cpu")


def test_perf_counter_timer_counts_runs_within_bounds():
    calls = []
    t = timing.PerfCounterTimer(warmup=2, min_reps=5, max_reps=9)
    xs = t.measure(lambda: calls.append(1), budget_s=0.0, context={})
    assert len(xs) == 5 and len(calls) == 7  # budget spent: the minimum, after the warm-up
    calls.clear()
    xs = t.measure(lambda: calls.append(1), budget_s=60.0, context={})
    assert len(xs) == 9 and len(calls) == 11 and all(x >= 0 for x in xs)


def test_median_and_relative_spread():
    assert timing.median([3.0, 1.0, 2.0]) == 2.0
    assert timing.rel_spread([5.0]) == 0.0
    assert timing.rel_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 3.0)
    assert timing.rel_spread([0.0, 0.0]) == 0.0
