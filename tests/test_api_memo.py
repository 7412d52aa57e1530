"""tkjit.get's hot path: the memo keyed on the call as made (no sorting), still type-strict."""

from __future__ import annotations

import pytest

import tkjit
from tkjit import api


@pytest.fixture
def resolved(monkeypatch):
    calls = []
    monkeypatch.setattr(api, "_resolve", lambda *a: calls.append(a) or object())
    tkjit.reset()
    yield calls
    tkjit.reset()


def test_a_repeat_call_is_a_memo_hit(resolved):
    a = tkjit.get("k", {"num_tokens": 1, "n": 4}, arch="cpu")
    assert tkjit.get("k", {"num_tokens": 1, "n": 4}, arch="cpu") is a
    assert tkjit.get("k", {"n": 4, "num_tokens": 1}, arch="cpu") is a  # other order: the canonical memo
    assert tkjit.get("k", n=4, num_tokens=1, arch="cpu") is not None and len(resolved) == 2
    assert tkjit.get("k", {"n": 4, "num_tokens": 1}, arch="cpu") is a and len(resolved) == 2


@pytest.mark.parametrize("other", [True, 1.0])
def test_equal_values_of_other_types_are_other_keys(resolved, other):
    """1, 1.0 and True are equal dict keys, but only one of them is a valid int param."""
    a = tkjit.get("k", {"num_tokens": 1}, arch="cpu")
    b = tkjit.get("k", {"num_tokens": other}, arch="cpu")
    assert b is not a and len(resolved) == 2
    assert tkjit.get("k", {"num_tokens": 1}, arch="cpu") is a


def test_arch_and_config_are_in_the_key(resolved):
    a = tkjit.get("k", {"num_tokens": 1}, arch="cpu")
    assert tkjit.get("k", {"num_tokens": 1}, arch="sm_90a") is not a
    assert tkjit.get("k", {"num_tokens": 1}, arch="cpu", config={"a": 1}) is not a
    assert tkjit.get("k", {"num_tokens": 1}, arch="cpu", config={"a": 1.0}) is not a
    assert len(resolved) == 4


def test_unhashable_values_still_reach_validation(cache_dir):
    with pytest.raises(tkjit.ShapeError):
        tkjit.get("sinkhorn_fwd", {"num_tokens": [1], "n": 4}, arch="cpu")
    with pytest.raises(tkjit.ShapeError):
        tkjit.get("sinkhorn_fwd", {"num_tokens": [1], "n": 4}, arch="cpu")


def test_reset_forgets_the_hot_memo(resolved):
    tkjit.get("k", {"num_tokens": 1}, arch="cpu")
    tkjit.reset()
    tkjit.get("k", {"num_tokens": 1}, arch="cpu")
    assert len(resolved) == 2
