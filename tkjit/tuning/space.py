"""The tunable space of one study: allowed configs, and how a config maps to Optuna params.

Numeric dims with more than two candidates are suggested as an *index* into their sorted values
(an ordinal int, so TPE's Parzen estimator sees that 64 lies between 32 and 128); strings and bools
are categoricals. A suggested combination the constraints reject is never compiled: the tuner
prunes it without counting it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tkjit.canon import canonical_json
from tkjit.match import exact_index
from tkjit.spec import Config, KernelSpec


def config_id(config: Mapping[str, Any]) -> str:
    """Canonical text of a config: the identity used by the study, the DB and the records."""
    return canonical_json(config)


def _ordinal(vals: Sequence) -> bool:
    return len(vals) > 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


class Space:
    def __init__(
        self,
        spec: KernelSpec,
        shape: Mapping[str, Any],
        arch: str | None,
        *,
        only: Sequence[Mapping[str, Any]] | None = None,
        max_configs: int | None = None,
    ) -> None:
        self.spec = spec
        self.shape = dict(shape)
        self.arch = arch
        allowed = spec.configs(self.shape, arch)
        self.default = spec.default_config(self.shape, arch)
        if only is not None:
            wanted = {config_id(spec.check_config(self.shape, c, arch)) for c in only}
            allowed = [c for c in allowed if config_id(c) in wanted]
        if max_configs is not None and len(allowed) > max_configs:
            # A deterministic, spread-out slice (CI keeps a few configs of a big space).
            step = len(allowed) / max_configs
            allowed = [allowed[int(i * step)] for i in range(max_configs)]
        did = config_id(self.default)
        if all(config_id(c) != did for c in allowed):
            allowed = [self.default, *allowed[: (max_configs - 1) if max_configs else None]]
        self.allowed: list[Config] = allowed
        self.allowed_ids = {config_id(c) for c in allowed}
        self.dims = {k: (sorted(v) if _ordinal(v) else list(v)) for k, v in spec.space.items()}

    def __len__(self) -> int:
        return len(self.allowed)

    def is_allowed(self, config: Mapping[str, Any]) -> bool:
        return config_id(config) in self.allowed_ids

    def why_not(self, config: Mapping[str, Any]) -> str:
        reason = self.spec.constraint(dict(self.shape), dict(config))
        if not reason and self.arch:
            reason = self.spec.arch_constraint(self.arch, dict(config), dict(self.shape))
        return reason or "outside the slice of the space being tuned"

    # -- Optuna encoding ----------------------------------------------------------------
    def to_params(self, config: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for k, vals in self.dims.items():
            v = config[k]
            out[k] = self._index(vals, v) if _ordinal(self.spec.space[k]) else v
        return out

    @staticmethod
    def _index(vals: list, v: Any) -> int:
        i = exact_index(vals, v)
        if i is None:
            raise ValueError(f"{v!r} not in {vals}")
        return i

    def suggest(self, trial) -> Config:
        cfg = {}
        for k in self.spec.space:  # the spec's order: configs compare equal as dicts anyway
            vals = self.dims[k]
            if _ordinal(self.spec.space[k]):
                cfg[k] = vals[trial.suggest_int(k, 0, len(vals) - 1)]
            else:
                cfg[k] = trial.suggest_categorical(k, vals)
        return cfg
