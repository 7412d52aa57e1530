"""Shared by the quant tests (CPU and GPU): bit comparisons, parameter ids, the fixtures of a cast's two
scale-layout specs and the every-config GPU check."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import pytest
import torch

from tkjit.registry import get_spec


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """A bfloat16 / float32 tensor's bits (int16 / int32)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def float_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaNs compare by their bits)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(float_bits(a), float_bits(b))


def word_bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor of 1-byte elements as uint8, of 4-byte ones as int32."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def word_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (of 1- or 4-byte elements), whatever the strides."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(word_bits(a.contiguous()),
                                                                     word_bits(b.contiguous()))


def byte_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and bytes (1-byte elements)."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def strided_byte_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, strides (of a non-empty tensor) and bits."""
    return (a.shape == b.shape and (a.numel() == 0 or a.stride() == b.stride())
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


# The per-channel casts' staged-layout options off (no occupancy hint, every thread makes its own factors): what an
# explicit config of those specs spells out when it does not tune them.
NO_HINT = {"min_threads_per_sm": 0, "factors": "thread"}


def tk_kernel_or_none(fn: Callable, *args, **kwargs):
    """TileKernels' kernel fn(*args, **kwargs), or None where it fails to build or run on this host (then only
    that comparison is skipped, with the reason printed)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # a TileLang / compile failure inside TileKernels, not tkjit's
        print(f"TileKernels' kernel failed: {type(e).__name__}: {e}")
        return None


def param_id(v) -> str:
    """A parametrisation id: a name as it is, a static shape as its values joined by '-'."""
    return v if isinstance(v, str) else "-".join(map(str, v.values()))


def cast_back_full(static: dict, n: int) -> dict:
    """A cast_back(_e5m6) shape at n tokens: num_sf_rows ceil(n / block_tokens)."""
    return {**static, "num_tokens": n, "num_sf_rows": -(-n // static.get("block_tokens", 1))}


def layout_fixtures(name: str, colmajor: str, served: Collection[str]) -> tuple[Callable, Callable, Callable]:
    """The fixtures `spec` and `colmajor` (the row- and column-major specs, per module) and `reference_kernels`
    (the kernels in `served` written by their references, see reference_kernels.serve_references)."""
    from reference_kernels import serve_references

    @pytest.fixture(scope="module", name="spec")
    def spec_fixture():
        return get_spec(name)

    @pytest.fixture(scope="module", name="colmajor")
    def colmajor_fixture():
        return get_spec(colmajor)

    @pytest.fixture(name="reference_kernels")
    def reference_kernels_fixture(monkeypatch):
        serve_references(monkeypatch, served)

    return spec_fixture, colmajor_fixture, reference_kernels_fixture


def check_every_config(every: Iterable[tuple[str, dict]], full: Callable[[dict, int], dict] | None = None,
                       tokens: Iterable[int] = (1, 7, 4001)) -> None:
    """GPU: every config of each (name, static) in `every` (the space at 7 tokens), compiled in one batch, then
    bit-exact with the reference (`tkjit.testing.check`, seed: the job's index) at each of `tokens`.
    full(static, n): the shape at n tokens (default: static plus num_tokens)."""
    import tkjit
    from tkjit.pool import compile_many
    from tkjit.testing import check

    full = full or (lambda static, n: {**static, "num_tokens": n})
    jobs = []
    for name, static in every:
        spec = tkjit.get_spec(name)
        shape = spec.canonical_shape(full(static, 7))
        jobs += [(name, spec.static_shape(shape), c, "sm_90a", "explicit") for c in spec.configs(shape, "sm_90a")]
    errors = compile_many(jobs)
    assert all(err is None for _, err in errors), [err for _, err in errors if err][:5]
    failures = []
    for i, (name, static, cfg, _, _) in enumerate(jobs):
        for t in tokens:
            kern = tkjit.get(name, full(static, t), config=cfg)
            msg = check(kern, full(static, t), seed=i)
            if msg:
                failures.append(f"{name} {cfg} t={t}: {msg}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
