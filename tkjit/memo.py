"""Memo: a bounded dict of checked call signatures, the one shape every call-path memo takes."""

from __future__ import annotations

from typing import Any


class Memo(dict):
    """signature -> what a call with it resolved to (a plan, a kernel object, its scalars).

    Lookups are plain `dict.get` (the hot path adds nothing); `remember` adds one and, once `bound` are held,
    starts over first: a serving loop sees a handful of signatures, and a sweep over many shapes must not
    grow a memo without end (nor pay for an LRU's bookkeeping on every hit)."""

    __slots__ = ("bound",)

    def __init__(self, bound: int):
        super().__init__()
        self.bound = bound

    def remember(self, key: Any, value: Any) -> Any:
        if len(self) >= self.bound:
            self.clear()
        self[key] = value
        return value
