"""Byte sizes as people write them: `500M`, `2G`, `1.5GiB`, `10kb`, or a plain number of bytes."""

from __future__ import annotations

import re

from tkjit.errors import ConfigError, brief

# Units are binary (K = 1024), as `du -h` and `ls -h` print them; `B`/`iB` after the unit are optional.
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# ASCII digits only: Decimal() would also take "1_000" and non-Latin digits.
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]{1,4}))?\s*([kmgt]?)(?:i?b)?", re.ASCII)
MAX_SIZE = (1 << 63) - 1  # an off_t: larger is no real size and would overflow the callers' arithmetic
EXAMPLES = "e.g. 500M, 2G, 1.5GiB or a number of bytes"


def parse_size(text: str) -> int:
    """The number of bytes `text` names (fractions rounded down); ConfigError saying what is wrong."""
    if not isinstance(text, str):
        raise ConfigError(f"size must be a str such as 500M, got {brief(text)}")
    t = text.strip().lower()
    if not t:
        raise ConfigError(f"size is empty ({EXAMPLES})")
    if t.lstrip("+-") in ("inf", "infinity", "nan"):
        raise ConfigError(f"size {brief(text)} is not a finite number ({EXAMPLES})")
    if t.startswith("-"):
        raise ConfigError(f"size {brief(text)} is negative ({EXAMPLES})")
    m = _SIZE_RE.fullmatch(t.lstrip("+"))
    if m is None:
        raise ConfigError(f"cannot read size {brief(text)} ({EXAMPLES})")
    number, exponent, unit = m.groups()
    # Decimal is exact: no float rounding of 1.5G, no overflow to inf on 1e400. (Imported here: a millisecond
    # of every process's `import tkjit` otherwise, for a cache-size setting read once.)
    from decimal import Decimal

    value = Decimal(number).scaleb(int(exponent or 0)) * _UNITS[unit]
    if value > MAX_SIZE:
        raise ConfigError(f"size {brief(text)} is too large (at most {MAX_SIZE} bytes)")
    return int(value)
