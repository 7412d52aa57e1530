"""The two scale layouts of a per-token cast, registered as a pair of specs.

`NAME` stores its float32 scales row-major, (num_tokens, groups); `NAME_colmajor` stores them as the
TMA-aligned column-major buffer DeepGEMM reads, (groups, align(num_tokens, 4)), its padding written 0.0
(the op returns the (num_tokens, groups) view of it). The two differ in their builder, their reference and
the scale bytes they move; everything else (params, space, default, inputs) is the cast's own.

Both builders are the cast's one `build(shape, c, col_major)`, a module-level function of the cast's module,
wrapped with functools.wraps: the wrappers keep its `__module__`, so `tkjit.spec.source_hash_of` hashes the
cast's module (and what it imports, this one included), as it would a builder defined there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tkjit.registry import register
from tkjit.scales import TMA_ALIGN
from tkjit.spec import Align, KernelSpec, TensorArg


def register_scale_layouts(name: str, doc: str, *, out: TensorArg, groups: Any, build: Callable,
                           reference: Callable, reference_colmajor: Callable,
                           bytes_moved: Callable[..., int], **fields: Any) -> tuple[KernelSpec, KernelSpec]:
    """(row-major spec, column-major spec). groups: the scale columns per token (a dim: an int, a param
    name or a function of the shape); build(shape, c, col_major); bytes_moved(shape, col_major=False)."""
    row = register(KernelSpec(
        name=name, doc=f"{doc}; scales row-major", build=_layout_builder(build, col_major=False), reference=reference,
        bytes_moved=bytes_moved,
        outputs=(out, TensorArg("scales", "float32", ("num_tokens", groups))), **fields))
    col = register(KernelSpec(
        name=f"{name}_colmajor", doc=f"{name} with TMA-aligned column-major scales (groups, align(num_tokens, 4))",
        build=_layout_builder(build, col_major=True), reference=reference_colmajor,
        bytes_moved=lambda s: bytes_moved(s, col_major=True),
        outputs=(out, TensorArg("scales", "float32", (groups, Align("num_tokens", TMA_ALIGN)))), **fields))
    return row, col


def layout_builders(build: Callable) -> tuple[Callable, Callable]:
    """(row-major, column-major) spec builders build(shape, c) of a cast's build(shape, c, col_major), for a pair
    registered otherwise (cast_back's scale inputs, per_block_cast_lossless's per-block scales): they keep build's
    module, as register_scale_layouts's do."""
    return _layout_builder(build, col_major=False), _layout_builder(build, col_major=True)


def _layout_builder(build: Callable, *, col_major: bool) -> Callable:
    """build(shape, c, col_major) for one layout: a spec's build(shape, c) that keeps build's module (see above)."""

    @functools.wraps(build)
    def build_layout(shape, c):
        return build(shape, c, col_major)

    return build_layout
