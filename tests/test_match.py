"""Type-strict membership, shared by config validation and the tuner's encoding."""

import math

import pytest

from tkjit.errors import ConfigError
from tkjit.match import exact_index
from tkjit.spec import KernelSpec, Runtime, TensorArg
from tkjit.tuning.space import Space


def test_equal_values_of_another_type_do_not_match():
    vals = (1, 2.0, True, "4")
    assert exact_index(vals, 1) == 0 and exact_index(vals, 2.0) == 1 and exact_index(vals, True) == 2
    assert exact_index(vals, 1.0) is None and exact_index(vals, 2) is None and exact_index(vals, 4) is None
    assert exact_index((False, 0), 0) == 1  # the first element of v's type, not the first equal one
    assert exact_index([], 0) is None
    assert exact_index((math.nan,), math.nan) is None  # NaN equals nothing, itself included


def _spec() -> KernelSpec:
    return KernelSpec(
        name="match_probe", family="test", doc="",
        params=(Runtime("num_tokens"),),
        space={"block": (32, 64, 128), "unroll": (False, True)},
        default=lambda s: {"block": 64, "unroll": False},
        constraint=lambda s, c: None, build=lambda s, c: None,
        inputs=(TensorArg("x", "float32", ("num_tokens",)),),
        outputs=(TensorArg("y", "float32", ("num_tokens",)),),
        make_inputs=lambda s, device="cpu", seed=0: (), reference=lambda s, *a: None,
        bytes_moved=lambda s: 0, examples=({"num_tokens": 8},), source_hash="x",
    )


@pytest.mark.parametrize("block", [64.0, True, 1])
def test_spec_and_space_agree(block):
    spec = _spec()
    cfg = {"block": block, "unroll": False}
    with pytest.raises(ConfigError, match="not in the space"):
        spec.check_config({"num_tokens": 8}, cfg)
    with pytest.raises(ValueError):  # an ordinal dim: encoded as the index of its exact value
        Space(spec, {"num_tokens": 8}, None).to_params(cfg)
    with pytest.raises(ConfigError, match="not in the space"):
        spec.check_config({"num_tokens": 8}, {"block": 64, "unroll": 0})
    ok = {"block": 64, "unroll": True}
    assert spec.check_config({"num_tokens": 8}, ok) == ok
    assert Space(spec, {"num_tokens": 8}, None).to_params(ok) == {"block_index": 1, "unroll": True}
