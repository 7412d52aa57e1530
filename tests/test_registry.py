"""tkjit.registry: every built-in spec validates, and its default config is in its space for every example."""

import tkjit
from tkjit.spec import validate


def test_builtin_catalog_validates():
    specs = {s.name: s for s in tkjit.all_specs()}
    assert "sinkhorn_fwd" in specs
    for s in specs.values():
        validate(s)
        for ex in s.examples:
            full = s.canonical_shape(ex)
            assert s.default_config(full) in s.configs(full), s.name
