"""Type-strict membership: a value is in a list of allowed values only as an element of its own type.

Python's `==` says True == 1 == 1.0, but a config or shape value of another type is another value
(True does not pass for 1, nor 64.0 for 64): the spec's validation and the tuner's encoding of a
config both match this way, so they cannot disagree on what is in a space.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def exact_index(values: Iterable[Any], v: Any) -> int | None:
    """Position of the first element equal to v and of exactly v's type; None when there is none."""
    for i, a in enumerate(values):
        if a == v and type(a) is type(v):
            return i
    return None
