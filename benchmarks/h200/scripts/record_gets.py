"""A pytest plugin for the CPU build host: run GPU test files without a GPU, recording every kernel they ask
`tkjit.get` for (name, static shape, the config get would serve on sm_90a), so that prebuild.py can cross-compile
them before a GPU run, whose minutes then go to the tests rather than to nvcc:

    PYTHONPATH=benchmarks/h200/scripts:$PYTHONPATH python -m pytest -p record_gets --record-out gets.json \\
        tests/gpu/test_gpu_per_block_cast.py -k "not every_config" -q
    python benchmarks/h200/scripts/prebuild.py --from-json gets.json

Nothing runs or compiles: the GPU marker's skip is lifted, `tkjit.get` returns a stand-in that records,
`tkjit.pool.compile_many` records its jobs (and reports each as not built), `tkjit.testing.check` passes and
`check_configs` does nothing, and a test stops where it first needs CUDA (its later kernels go unrecorded; most
tests ask for theirs first). Every-config tests would record whole spaces: leave them out with
-k "not every_config" ("not every" would also drop the default-config tests named ..._every_size).
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

_JOBS: list[tuple] = []  # every job asked for, repeats included (tkjit.pool.unique_jobs drops them at the end)


class _Recorded:
    """What a test gets instead of a kernel: enough to read, nothing to launch."""

    def __init__(self, spec, full, config):
        self.spec, self.shape, self.config, self.caller_sized = spec, full, config, ()

    def __call__(self, *args, **kwargs):
        pytest.skip("recorded (no GPU here)")


def _record(name, shape, arch, config):
    from tkjit.registry import get_spec
    from tkjit.tuning_db import choose_config

    spec = get_spec(name)
    full = spec.canonical_shape(shape)
    cfg, source = choose_config(spec, full, "sm_90a", config)
    _JOBS.append((spec.name, spec.static_shape(full), cfg, "sm_90a", source))
    return _Recorded(spec, full, cfg)


def pytest_addoption(parser):
    parser.addoption("--record-out", default=os.path.join(tempfile.gettempdir(), "tkjit-gets.json"),
                     help="where the recorded kernels go (JSON)")


def _record_jobs(jobs, *args, **kwargs):
    from tkjit.pool import Result

    _JOBS.extend(jobs)
    return [Result(None, "recorded, not built (no GPU here)") for _ in jobs]


def pytest_configure(config):
    import tkjit.api
    import tkjit.pool
    import tkjit.testing

    tkjit.api._resolve = _record
    tkjit.pool.compile_many = _record_jobs
    tkjit.testing.check = lambda *args, **kwargs: None
    tkjit.testing.check_configs = lambda *args, **kwargs: None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:  # lift the "needs a CUDA GPU" skip the test suite adds on a host without one
        item.own_markers = [m for m in item.own_markers
                            if not (m.name == "skip" and "CUDA" in str(m.kwargs.get("reason", "")))]


def pytest_sessionfinish(session):
    from tkjit.pool import unique_jobs

    jobs = unique_jobs(_JOBS)
    path = session.config.getoption("--record-out")
    with open(path, "w") as f:
        json.dump(jobs, f, indent=0)
    print(f"\nrecorded {len(jobs)} kernel(s) into {path}")
