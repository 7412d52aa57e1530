"""TKJIT_EXACT_MATH: kernels whose fast configs use fast math or reciprocals serve their IEEE variant."""

import pytest
import torch

import tkjit
from tkjit import api
from tkjit.errors import SpecError
from tkjit.spec import validate
from tkjit.tuning_db import choose_config


@pytest.fixture
def exact_math(monkeypatch):
    monkeypatch.setenv("TKJIT_EXACT_MATH", "1")
    api.reset()
    yield
    monkeypatch.delenv("TKJIT_EXACT_MATH")
    api.reset()


@pytest.mark.parametrize("name", ["sinkhorn_fwd", "sinkhorn_bwd"])
def test_the_served_config_gets_the_exact_overrides(name):
    spec = tkjit.get_spec(name)
    for shape in ({"num_tokens": 4096, "n": 4}, {"num_tokens": 1 << 20, "n": 4}):
        full = spec.canonical_shape(shape)
        fast, source = choose_config(spec, full, "sm_90a", None)
        cfg, exact_source = choose_config(spec, full, "sm_90a", None, exact=True)
        assert cfg["fast_math"] is False and cfg["recip"] is False
        if fast["fast_math"] or fast["recip"]:
            assert exact_source == source + "+exact"
            assert {k: v for k, v in cfg.items() if k not in spec.exact} == {
                k: v for k, v in fast.items() if k not in spec.exact}  # the rest of the tuned config kept
        explicit = {**fast, "fast_math": True}
        assert choose_config(spec, full, "sm_90a", explicit, exact=True)[1] == "explicit"


def test_env_flag_serves_the_exact_variant(exact_math, module_cache):
    """For the H200 (cross-compiled here): the shipped tuned config with fast math and reciprocals off, its
    own binary. On the C target the served config is exact already (no fast math there) and runs."""
    k = tkjit.get("sinkhorn_fwd", {"num_tokens": 4096, "n": 4}, arch="sm_90a")
    assert k.config["recip"] is False and k.config["fast_math"] is False
    assert k.config_source.endswith("+exact")
    kc = tkjit.get("sinkhorn_fwd", {"num_tokens": 33, "n": 4}, arch="cpu")
    assert kc.config["recip"] is False and kc.config["fast_math"] is False
    x = torch.randn(33, 4, 4)
    torch.testing.assert_close(kc(x), kc.spec.reference(kc.shape, x).float(), rtol=1e-6, atol=1e-7)


def test_an_exact_override_outside_the_space_is_refused():
    from dataclasses import replace

    spec = tkjit.get_spec("sinkhorn_fwd")
    with pytest.raises(SpecError, match="exact override fast_math='no'"):
        validate(replace(spec, exact={"fast_math": "no"}))
