"""Canonical JSON: the one text of a value that identities are made of.

Cache keys (`tkjit.key.key_of` hashes it), config ids, study names and the tuned DB's shape and
bucket keys are this text. Shipped tuning DBs and caches are keyed on it, so the format is fixed:
keys sorted, no whitespace, non-ASCII escaped (json's defaults otherwise). Changing any of it
changes every key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

_SEPARATORS = (",", ":")


def canonical_json(obj: Any, *, default: Callable[[Any], Any] | None = None) -> str:
    """The canonical text of obj; a top-level Mapping that is not a dict is read as a dict.

    default: as json.dumps's (what to write for a value JSON has no type for); None raises TypeError.
    """
    if isinstance(obj, Mapping) and not isinstance(obj, dict):
        obj = dict(obj)
    return json.dumps(obj, sort_keys=True, separators=_SEPARATORS, default=default)
