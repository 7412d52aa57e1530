"""Fake evaluators and timers: search-logic tests, `benchmarks/h200/scripts/sampler_eval.py` on a timing table.

TableEvaluator answers from a table (config id -> µs) without compiling or running anything, and
records what it was asked to compile and bench, so tests can check the search logic: what ran
first, that invalid configs never reached the compiler, that a wrong config never wins.
FakeTimer runs inside the real bench worker (named by import path) and reports table times.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tkjit.tuning.space import config_id


class TableEvaluator:
    def __init__(
        self,
        times: Mapping[str, float] | Callable[[dict], float],
        *,
        wrong: Iterable[str] = (),
        crash: Iterable[str] = (),
        compile_fail: Iterable[str] = (),
        log_path: str | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.times = times
        self.wrong, self.crash, self.compile_fail = set(wrong), set(crash), set(compile_fail)
        self.compiled: list[str] = []
        self.benched: list[str] = []
        self.retimed: list[list[str]] = []
        self.stops: list[float | None] = []  # the stop_above_us each bench was given
        self.log_path, self.delay_s = log_path, delay_s

    def _time(self, cfg: dict) -> float:
        return float(self.times(cfg) if callable(self.times) else self.times[config_id(cfg)])

    def device_info(self) -> dict[str, Any]:
        return {}

    def compile(self, spec, static, configs, arch):
        out = []
        for c in configs:
            cid = config_id(c)
            self.compiled.append(cid)
            out.append("planted compile failure" if cid in self.compile_fail else None)
        return out

    def compile_iter(self, spec, static, configs, arch):
        yield from self.compile(spec, static, configs, arch)

    def bench(self, spec, full, config, arch, seed, stop_above_us=None):
        cid = config_id(config)
        self.benched.append(cid)
        self.stops.append(stop_above_us)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(cid + "\n")
        if cid in self.crash:
            return {"ok": False, "kind": "crash", "error": "planted crash"}
        if cid in self.wrong:
            return {"ok": False, "kind": "wrong", "error": "planted wrong output"}
        return {"ok": True, "us": self._time(config), "spread": 0.0}

    def retime(self, spec, full, configs, arch):
        self.retimed.append([config_id(c) for c in configs])
        out = []
        for c in configs:
            cid = config_id(c)
            if cid in self.wrong or cid in self.crash:
                out.append({"ok": False, "kind": "wrong", "error": "planted"})
            else:
                out.append({"ok": True, "us": self._time(c), "spread": 0.0})
        return out

    def close(self) -> None:
        pass


class FakeTimer:
    """A timer for the real worker: µs from a table keyed by config id (JSON), default `base_us`.

    hang: config ids for which `measure` sleeps `hang_s` (to test the worker's timeout).
    """

    def __init__(self, table: Mapping[str, float] | None = None, base_us: float = 100.0,
                 hang: Iterable[str] = (), hang_s: float = 3600.0, real: bool = True) -> None:
        self.table = dict(table or {})
        self.base_us, self.hang, self.hang_s, self.real = base_us, set(hang), hang_s, real

    def measure(self, run, *, budget_s, context):
        cid = config_id(context["config"])
        if cid in self.hang:
            time.sleep(self.hang_s)
        if self.real:
            run()  # the launch still happens: a crash still crashes
        return [float(self.table.get(cid, self.base_us))] * 5


def synthetic_table(space_dims: Mapping[str, tuple], seed: int = 0, noise: float = 0.01) -> dict[str, float]:
    """A smooth, structured timing landscape over the product of space_dims (for sampler tests).

    Each ordinal dim has a preferred position; the time grows with the log-distance from it,
    with an interaction term and a little noise, roughly like tile-size landscapes.
    """
    import itertools

    rng = random.Random(seed)
    keys = list(space_dims)
    pref = {k: rng.randrange(len(v)) for k, v in space_dims.items()}
    weight = {k: rng.uniform(0.05, 0.4) for k in keys}
    table = {}
    for combo in itertools.product(*(range(len(space_dims[k])) for k in keys)):
        cost = 0.0
        for k, i in zip(keys, combo):
            cost += weight[k] * abs(i - pref[k]) ** 1.3
        cost += 0.05 * abs((combo[0] - pref[keys[0]]) * (combo[-1] - pref[keys[-1]]))
        cfg = {k: space_dims[k][i] for k, i in zip(keys, combo)}
        table[config_id(cfg)] = round(100.0 * math.exp(cost) * (1 + rng.uniform(-noise, noise)), 4)
    return table


def load_table(path: str) -> dict[str, float]:
    """A timing table file: {"config id": µs} or [{"config": {...}, "us": ...}]."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        return {config_id(json.loads(k)): float(v) for k, v in data.items()}
    return {config_id(r["config"]): float(r["us"]) for r in data if r.get("us") is not None}


def fake_spec(
    space: Mapping[str, tuple],
    *,
    name: str = "fake_kernel",
    default: Mapping[str, Any] | None = None,
    constraint: Callable[[dict, dict], str | None] | None = None,
):
    """A KernelSpec that is never built (search-logic tests and sampler evaluations)."""
    from tkjit.spec import KernelSpec, Runtime, TensorArg, validate

    first = {k: v[0] for k, v in space.items()}
    spec = KernelSpec(
        name=name, family="fake", doc="fake kernel for search tests",
        params=(Runtime("num_tokens", hi=1 << 24),),
        space={k: tuple(v) for k, v in space.items()},
        default=lambda s: dict(default or first),
        constraint=constraint or (lambda s, c: None),
        build=lambda s, c: None,
        inputs=(TensorArg("x", "float32", ("num_tokens",)),),
        outputs=(TensorArg("y", "float32", ("num_tokens",)),),
        make_inputs=lambda s, device="cpu", seed=0: (),
        reference=lambda s, *a: None,
        bytes_moved=lambda s: 8 * s["num_tokens"],
        examples=({"num_tokens": 4096},),
        source_hash="fake",
    )
    validate(spec)
    return spec
