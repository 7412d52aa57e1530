"""topk_gate spec on the CPU: shapes, constraints, reference semantics, sm_90a cross-compiles."""

import pytest
import torch

import tkjit
from tkjit.errors import ConfigError, ShapeError
from tkjit.registry import get_spec
from tkjit.spec import validate

NAME = "topk_gate"


@pytest.fixture(scope="module")
def spec():
    return get_spec(NAME)


def test_spec_validates(spec):
    validate(spec)
    assert spec.family == "moe"
    assert spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.configs(full, "sm_90a"), ex
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")


def test_every_expert_count_has_configs_and_a_valid_default(spec):
    for e in (16, 32, 64, 128, 256, 384, 512):
        for k in sorted({1, 2, 6, 8, 16} & set(range(1, min(e, 16) + 1))):
            full = spec.canonical_shape({"num_tokens": 100, "num_experts": e, "k": k})
            cfg = spec.default_config(full, "sm_90a")
            assert spec.check_config(full, cfg, "sm_90a") == cfg


def test_bad_shapes(spec):
    # With today's domains (num_experts >= 16, k <= 16) the cross-param rule is a safety net.
    assert spec.check_shape({"num_tokens": 4, "num_experts": 16, "k": 17}) == "k=17 must be <= num_experts=16"
    with pytest.raises(ShapeError, match="'k'=17 above its maximum 16"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 16, "k": 17})
    with pytest.raises(ShapeError, match="'k'=20 above its maximum 16"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 256, "k": 20})
    with pytest.raises(ShapeError, match="num_experts.*not allowed"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 100, "k": 4})
    with pytest.raises(ShapeError, match="below its minimum"):
        spec.canonical_shape({"num_tokens": 0, "num_experts": 64, "k": 4})
    with pytest.raises(ShapeError, match="must be an int"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 64, "k": 2.5})


def test_bad_configs(spec):
    full = spec.canonical_shape({"num_tokens": 8, "num_experts": 64, "k": 6})
    base = spec.default_config(full)
    with pytest.raises(ConfigError, match="redux"):
        spec.check_config(full, {**base, "lanes": 8, "reduce": "redux"})
    with pytest.raises(ConfigError, match="spill"):
        spec.check_config(
            spec.canonical_shape({"num_tokens": 8, "num_experts": 512, "k": 6}), {**base, "lanes": 4, "cache": 0}
        )
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, base, "cpu")


def test_reference_hand_checked(spec):
    s = {"num_tokens": 2, "num_experts": 16, "k": 4}
    x = torch.zeros(2, 16)
    x[0, :] = torch.arange(16.0)  # increasing: best are 15, 14, 13, 12
    x[1, :] = 1.0
    x[1, 9] = 3.0
    x[1, 4] = 2.0
    x[1, 7] = 2.0  # tie 2.0 at 4 and 7 -> 4 first; then the 1.0s from index 0
    out = spec.reference(s, x)
    assert out.dtype == torch.int64 and out.shape == (2, 4)
    assert out.tolist() == [[15, 14, 13, 12], [9, 4, 7, 0]]


def test_reference_signed_zero_and_inf_ties(spec):
    s = {"num_tokens": 1, "num_experts": 16, "k": 6}
    x = torch.full((1, 16), float("-inf"))
    x[0, 3] = -0.0
    x[0, 1] = 0.0
    x[0, 12] = float("inf")
    # -0 == +0 (stable: index 1 before 3); then -inf in index order.
    assert spec.reference(s, x).tolist() == [[12, 1, 3, 0, 2, 4]]


def test_make_inputs_have_ties_on_odd_seeds(spec):
    s = spec.canonical_shape({"num_tokens": 64, "num_experts": 64, "k": 8})
    (a,) = spec.make_inputs(s, "cpu", 0)
    (b,) = spec.make_inputs(s, "cpu", 1)
    assert a.dtype == torch.float32 and a.shape == (64, 64)
    assert a.unique().numel() > 0.99 * a.numel()
    assert b.unique().numel() < 0.1 * b.numel()  # rounded values: many ties
    assert torch.isinf(b).any() and (torch.signbit(b) & (b == 0)).any()
    (a2,) = spec.make_inputs(s, "cpu", 0)
    assert torch.equal(a, a2)


def test_bytes_moved(spec):
    s = {"num_tokens": 65536, "num_experts": 256, "k": 8}
    assert spec.bytes_moved(s) == 65536 * (256 * 4 + 8 * 8)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,config",
    [
        ({"num_experts": 256, "k": 8}, None),  # default: warp per token, redux, head lists
        ({"num_experts": 64, "k": 6}, None),
        (
            {"num_experts": 256, "k": 8},
            {"lanes": 8, "vec": 4, "threads": 256, "tokens_per_group": 2, "cache": 4, "reduce": "shfl"},
        ),
        (
            {"num_experts": 16, "k": 16},
            {"lanes": 1, "vec": 1, "threads": 128, "tokens_per_group": 1, "cache": 0, "reduce": "shfl"},
        ),
        (
            {"num_experts": 384, "k": 6},
            {"lanes": 32, "vec": 4, "threads": 128, "tokens_per_group": 1, "cache": 0, "reduce": "shfl"},
        ),
    ],
)
def test_compiles_for_sm90a(cache_dir, shape, config):
    k = tkjit.get(NAME, {"num_tokens": 4001, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "topk_gate" in src
    if k.config["reduce"] == "redux":
        assert "__reduce_max_sync" in src
    else:
        assert "__reduce_max_sync" not in src
