"""Tuned-config lookup (filled by the autotuner issue). Returns None: heuristic defaults serve."""

from __future__ import annotations

from typing import Any

from tkjit.spec import KernelSpec


def lookup(spec: KernelSpec, shape: dict[str, Any], arch: str) -> tuple[dict[str, Any], str] | None:
    return None
