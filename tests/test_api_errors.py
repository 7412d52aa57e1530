"""Bad arguments to `tkjit.get` fail validation with a tkjit error naming the problem, before any compile."""

from __future__ import annotations

import pytest
import torch

import tkjit
from tkjit import api
from tkjit.errors import ConfigError, ShapeError, TkjitError, UnknownKernelError, brief
from tkjit.registry import get_spec
from tkjit.spec import Param

SPEC = get_spec("sinkhorn_fwd")
OK = {"num_tokens": 64, "n": 4}
OK_CFG = SPEC.default_config(SPEC.canonical_shape(OK), "cpu")
HUGE = 10**5000  # more digits than Python will print (sys.int_info.default_max_str_digits)


@pytest.fixture(autouse=True)
def _never_compile(cache_dir, monkeypatch):
    """Every case here must fail during validation: reaching the cache or compiler is a bug."""
    monkeypatch.setattr(api, "ensure_entry", lambda *a, **k: pytest.fail("bad input reached the compiler"))


@pytest.mark.parametrize("name", [["x"], {"a": 1}, None, 5, b"sinkhorn_fwd", ("sinkhorn_fwd",)])
def test_kernel_name_must_be_a_str(name):
    with pytest.raises(UnknownKernelError, match="kernel name must be a str"):
        tkjit.get(name, OK, arch="cpu")
    with pytest.raises(UnknownKernelError, match="kernel name must be a str"):
        get_spec(name)


def test_unknown_kernel_message_is_bounded():
    with pytest.raises(UnknownKernelError) as e:
        tkjit.get("x" * 1_000_000, OK, arch="cpu")
    assert len(str(e.value)) < 2000


@pytest.mark.parametrize(
    "shape, match",
    [
        ({"num_tokens": HUGE, "n": 4}, "'num_tokens'.*int of 16610 bits.*above its maximum"),
        ({"num_tokens": -HUGE, "n": 4}, "'num_tokens'.*below its minimum"),
        ({"num_tokens": 64, "n": HUGE}, "'n'.*above its maximum"),
        ({"num_tokens": 64, "eps": 10**400}, "'eps'.*too large for a float"),
        ({"num_tokens": 64, "eps": HUGE}, "'eps'.*too large for a float"),
        ({"num_tokens": 64, "eps": 1e400}, "'eps'.*finite"),
        ({"num_tokens": float("nan"), "n": 4}, "'num_tokens' must be an int, got nan"),
        ({"num_tokens": float("inf"), "n": 4}, "'num_tokens' must be an int"),
        ({"num_tokens": 64, "n": "4"}, "'n' must be an int, got '4' \\(a str\\)"),
        ({"num_tokens": 64, "n": " 4 "}, "'n' must be an int"),
        ({"num_tokens": 64, "n": "١٢"}, "'n' must be an int"),
        ({"num_tokens": 64, "n": 4.0}, "'n' must be an int"),
        ({"num_tokens": 64, "n": True}, "'n' must be an int, got True"),
        ({"num_tokens": 64, "eps": "1e-6"}, "'eps' must be a float, got '1e-6' \\(a str\\)"),
        ({"num_tokens": 64, "eps": b"1"}, "'eps' must be a float"),
        ({"num_tokens": 64, "eps": 1j}, "'eps' must be a float"),
        ({"num_tokens": 64, "eps": False}, "'eps' must be a float"),
        ({"num_tokens": [64], "n": 4}, "'num_tokens' must be an int"),
        ({"num_tokens": 64, HUGE: 1}, "unknown shape params \\[<int of 16610 bits>\\]"),
        ({"num_tokens": 64, "x" * 100000: 1}, "unknown shape params"),
        ([("num_tokens", 64), ("n", 4)], "shape must be a mapping"),
        ("num_tokens=64", "shape must be a mapping"),
    ],
)
def test_bad_shapes(shape, match):
    with pytest.raises(ShapeError, match=match) as e:
        tkjit.get("sinkhorn_fwd", shape, arch="cpu")
    assert len(str(e.value)) < 2000


def test_bad_shapes_as_keywords():
    with pytest.raises(ShapeError, match="'num_tokens'.*above its maximum"):
        tkjit.get("sinkhorn_fwd", arch="cpu", num_tokens=HUGE, n=4)
    with pytest.raises(ShapeError, match="'n' must be an int"):
        tkjit.get("sinkhorn_fwd", arch="cpu", num_tokens=64, n="4")


def test_ints_must_fit_the_kernel_abi():
    """A param without a declared maximum still goes to the kernel as a 64-bit int."""
    p = Param("x")
    assert p.check(2**63 - 1) == 2**63 - 1 and p.check(-(2**63)) == -(2**63)
    for bad in (2**63, -(2**63) - 1, HUGE, -HUGE):
        with pytest.raises(ShapeError, match="'x'.*64-bit"):
            p.check(bad)
    f = Param("y", type=float)
    with pytest.raises(ShapeError, match="'y'.*too large for a float"):
        f.check(HUGE)
    assert f.check(2**63) == float(2**63)


def test_int_like_values_are_accepted():
    """numpy and torch ints implement __index__: lossless, so they are ints (a float is not)."""
    import numpy as np

    assert SPEC.canonical_shape({"num_tokens": np.int64(64), "n": torch.tensor(4)}) == SPEC.canonical_shape(OK)
    assert type(SPEC.canonical_shape({"num_tokens": np.int32(64)})["num_tokens"]) is int
    assert SPEC.canonical_shape({**OK, "eps": np.float32(0.5)})["eps"] == 0.5
    with pytest.raises(ShapeError):
        SPEC.canonical_shape({"num_tokens": np.float64(64)})


@pytest.mark.parametrize(
    "config, match",
    [
        ([("layout", "reg")], "config must be a mapping"),
        ("fast", "config must be a mapping"),
        (5, "config must be a mapping"),
        ({**OK_CFG, "layout": []}, "layout=\\[\\] not in the space"),
        ({**OK_CFG, "layout": {"a": [1]}}, "not in the space"),
        ({**OK_CFG, "block_tokens": HUGE}, "block_tokens=<int of 16610 bits> not in the space"),
        ({**OK_CFG, "block_tokens": float("nan")}, "not in the space"),
        ({**OK_CFG, HUGE: 1}, "unknown: \\[<int of 16610 bits>\\]"),
        ({**OK_CFG, "layout": "x" * 100000}, "not in the space"),
    ],
)
def test_bad_configs(config, match):
    with pytest.raises(ConfigError, match=match) as e:
        tkjit.get("sinkhorn_fwd", OK, arch="cpu", config=config)
    assert len(str(e.value)) < 2000


def test_brief_is_bounded_and_never_fails():
    class Unprintable:
        def __repr__(self):
            raise RuntimeError("no")

    assert brief(HUGE) == "<int of 16610 bits>"
    assert brief(-HUGE) == "<int of 16610 bits>"
    assert brief(12) == "12" and brief("4") == "'4'"
    assert len(brief("x" * 10**6)) < 200
    assert len(brief(list(range(10**5)))) < 200
    nested: list = []
    for _ in range(100000):
        nested = [nested]
    assert len(brief(nested)) < 200
    assert brief([HUGE]).startswith("<list")
    assert brief(Unprintable()).startswith("<Unprintable")


def test_every_failure_is_a_tkjit_error():
    for shape in ({"num_tokens": HUGE}, {"num_tokens": 64, "eps": 10**400}, {"num_tokens": 64, "n": "4"}):
        with pytest.raises(TkjitError):
            tkjit.get("sinkhorn_fwd", shape, arch="cpu")


def test_memo_does_not_serve_an_equal_value_of_another_type(monkeypatch):
    """get() memoises by argument: 1, 1.0 and True are equal keys, yet only 1 is a valid int param."""
    from tkjit import api

    calls = []

    def resolve(name, shape, arch, config):
        calls.append(shape)
        get_spec(name).canonical_shape(shape)
        return object()

    monkeypatch.setattr(api, "_resolve", resolve)
    api.reset()
    try:
        tkjit.get("sinkhorn_fwd", {"num_tokens": 8, "n": 4}, arch="cpu")
        for bad in (4.0, True):
            with pytest.raises(ShapeError):
                tkjit.get("sinkhorn_fwd", {"num_tokens": 8, "n": bad}, arch="cpu")
    finally:
        api.reset()
