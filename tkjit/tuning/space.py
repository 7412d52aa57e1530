"""The tunable space of one study: allowed configs, and how a config maps to Optuna params.

Parameters are recorded with their real values (`block_tokens=128`, readable in optuna-dashboard),
except where a sampler learns from them: in a TPE study (`ordinal=True`) a numeric dim with more
than two candidates is suggested as an *index* into its sorted values, an int param named
`<dim>_index`, so TPE's Parzen estimator sees that 64 lies between 32 and 128. Categoricals of the
real values lose that order, and it costs: replaying the synthetic 376-config landscape of
benchmarks/h200/scripts/sampler_eval.py at 15% of the trials, 2/5 seeds came within 2% of the best
with categoricals against 4/5 with indices (3/5 against 5/5 at 30%). An exhaustive study enqueues every config, so
nothing learns from its params and they are the real values. The trial's `config` user attribute
always holds the real config. A suggested combination the constraints reject is never compiled:
the tuner prunes it without counting it.
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
        device: Mapping[str, int] | None = None,
    ) -> None:
        self.spec = spec
        self.shape = dict(shape)
        self.arch = arch
        allowed = spec.configs(self.shape, arch)
        self.default = spec.default_config(self.shape, arch)
        if device is not None and spec.device_constraint is not None:
            # The bench GPU's limits (a cooperative grid must be resident at once): what it cannot launch
            # is not a candidate, and the baseline is the config `tkjit.get` serves there.
            from tkjit.tuning_db import nearest_fitting

            allowed = [c for c in allowed if not spec.device_constraint(self.shape, c, device)]
            if spec.device_constraint(self.shape, self.default, device):
                self.default = nearest_fitting(spec, self.shape, arch, self.default, device)
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
        self.ordinal = True  # the tuner sets False for an exhaustive study (see the module doc)

    def __len__(self) -> int:
        return len(self.allowed)

    def nearest_first(self, configs: Sequence[Config]) -> list[Config]:
        """configs by how many parameters differ from the default, fewest first (ties keep their order): the
        order an exhaustive study measures them in, so one that its time budget cuts short has measured the
        default's neighbourhood, where its winners are, not the space's first layout only."""
        default = self.default
        return sorted(configs, key=lambda c: sum(c.get(k) != v for k, v in default.items()))

    def is_allowed(self, config: Mapping[str, Any]) -> bool:
        return config_id(config) in self.allowed_ids

    def why_not(self, config: Mapping[str, Any]) -> str:
        reason = self.spec.constraint(dict(self.shape), dict(config))
        if not reason and self.arch:
            reason = self.spec.arch_constraint(self.arch, dict(config), dict(self.shape))
        return reason or "outside the slice of the space being tuned"

    # -- Optuna encoding ----------------------------------------------------------------
    def _indexed(self, k: str) -> bool:
        return self.ordinal and _ordinal(self.spec.space[k])

    def param_name(self, k: str) -> str:
        """The Optuna param of dim k: its own name, `<k>_index` where the sampler sees an index."""
        return f"{k}_index" if self._indexed(k) else k

    def to_params(self, config: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for k, vals in self.dims.items():
            v = config[k]
            out[self.param_name(k)] = self._index(vals, v) if self._indexed(k) else v
        return out

    @staticmethod
    def _index(vals: list, v: Any) -> int:
        i = exact_index(vals, v)
        if i is None:
            raise ValueError(f"{v!r} not in {vals}")
        return i

    def distributions(self) -> dict[str, Any]:
        """The Optuna distribution of each param, as `suggest` asks for it."""
        import optuna

        out: dict[str, Any] = {}
        for k in self.spec.space:
            vals = self.dims[k]
            out[self.param_name(k)] = (optuna.distributions.IntDistribution(0, len(vals) - 1) if self._indexed(k)
                                       else optuna.distributions.CategoricalDistribution(vals))
        return out

    def suggest(self, trial: Any) -> Config:
        cfg = {}
        for k in self.spec.space:  # the spec's order: configs compare equal as dicts anyway
            vals = self.dims[k]
            if self._indexed(k):
                cfg[k] = vals[trial.suggest_int(self.param_name(k), 0, len(vals) - 1)]
            else:
                cfg[k] = trial.suggest_categorical(k, vals)
        return cfg
