"""A deterministic timer for multi-worker tuning tests: µs from a hash of the config, the kernel still
launched (the correctness gate and a crash stay real). TKJIT_TEST_BENCH_DELAY seconds of sleep per
measurement stretch a study so a test can kill a worker mid-run."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any


class HashTimer:
    def __init__(self, **_: Any) -> None:
        self.delay = float(os.environ.get("TKJIT_TEST_BENCH_DELAY", "0"))
        self.seen: set[str] = set()  # the delay once per config: the final re-timing stays quick

    @staticmethod
    def us(config_id: str) -> float:
        return 100.0 + int(hashlib.sha256(config_id.encode()).hexdigest()[:6], 16) % 1000 / 10.0

    def measure(self, run, *, budget_s, context):
        from tkjit.tuning import config_id

        cid = config_id(context["config"])
        if cid not in self.seen:
            self.seen.add(cid)
            time.sleep(self.delay)
        run()
        return [self.us(cid)] * 5
