"""The autotuner: Optuna studies over a spec's space, isolated benchmarking, a correctness gate.

    from tkjit.tuning import tune
    r = tune("sinkhorn_fwd", {"num_tokens": 65536, "n": 4}, arch="sm_90a")
    print(r.config, r.speedup)

Importing this package imports neither Optuna nor TileLang; `tune` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tune", "TuneResult", "LocalEvaluator", "Space", "config_id", "study_name", "open_storage"]


def __getattr__(name: str) -> Any:
    if name in ("tune", "TuneResult", "LocalEvaluator", "study_name", "open_storage", "tuning_shape"):
        from tkjit.tuning import tuner

        return getattr(tuner, name)
    if name in ("Space", "config_id"):
        from tkjit.tuning import space

        return getattr(space, name)
    raise AttributeError(f"module 'tkjit.tuning' has no attribute {name!r}")
