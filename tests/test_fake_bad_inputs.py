"""Every torch.ops.tkjit op under bad input: a tkjit error naming the problem, from the fake implementation
(what torch.compile runs) and from the real one alike.

For each op a valid call is built from its spec's first example (runtime sizes made small) and `make_inputs`,
and checked to trace under FakeTensorMode. Then one argument at a time is mutated: another dtype, one axis
more or fewer, an axis one larger, zero, one or huge (so it disagrees with the tensors sharing it), None, a
non-contiguous view, a negative, zero or huge int, a non-finite float, another string. The fake must either
accept the mutation or refuse it with a TkjitError subclass (or a TypeError from torch's own argument
parsing, before tkjit runs): never an IndexError, ZeroDivisionError, AttributeError, a RuntimeError from
torch, ... that a missing check lets through. The real implementations (every kernel served as a CPU kernel
that checks its arguments as on the GPU) get the same mutations and must refuse them with the fake's error.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tkjit
import tkjit.ops  # noqa: F401  (registers torch.ops.tkjit.*)
import tkjit.torch_ops.serve
from tkjit.errors import TkjitError
from tkjit.kernel import CompiledKernel

TKJIT_DIR = str(Path(tkjit.__file__).resolve().parent)

# Small runtime sizes (each spec takes the ones it has): the fakes' work does not depend on them, and
# make_inputs stays cheap.
SMALL = {"num_tokens": 5, "num_expanded_tokens": 24, "num_expand_tokens": 9, "num_tokens_out": 7,
         "num_sf_rows": 5, "token_blocks": 2, "rows": 5, "batch": 2, "num_weights": 30}


@dataclass(frozen=True)
class Case:
    """How one op's valid arguments come from a spec: the spec's make_inputs tensors and scalars and its shape
    params fill the op's arguments of the same name; `shape` overrides the example's params; `args(shape,
    named)` gives the arguments that have other names or forms (named: make_inputs' tensors and scalars)."""

    spec: str
    shape: dict = field(default_factory=dict)
    args: Callable[[dict, dict], dict] | None = None


def _flat_2d(name: str) -> Callable[[dict, dict], dict]:
    """The per-channel ops take TileKernels' 2-D x; the spec's x is its 3-D (blocks, rows, width) view."""
    return lambda shape, named: {name: named[name].reshape(-1, named[name].shape[-1])}


def _pre_norm_fn_bwd(shape: dict, named: dict) -> dict:
    g = named["mul_grad"]
    return {"out_grad": g, "out_mul": g.clone(), "sqrsum": named["sqrsum_grad"], "norm_eps": 1e-6}


def _big_fuse(shape: dict, named: dict) -> dict:
    m, h = shape["mhc_mult"], shape["hidden"]
    return {"fn": torch.zeros(2 * m + m * m, m * h)}


def _swiglu_channel(shape: dict, named: dict) -> dict:
    return {**_flat_2d("x")(shape, named), "swiglu_clamp_value": shape["clamp_value"] if shape["use_clamp"] else None}


def _top2(shape: dict, named: dict) -> dict:
    """One EP and TP rank, no shared experts; the masks (make_inputs' int8, the kernel's form) as the op's bool."""
    return {"use_shared_as_routed": False, "num_shared_experts": 0, "num_ep_ranks": 1, "ep_rank": 0, "tp_rank": 0,
            "num_tp_ranks": 1, "mask": named["mask"].bool() if "mask" in named else None,
            "fix_routing_mask": named["fix_routing_mask"].bool() if "fix_routing_mask" in named else None}


def _reduce(shape: dict, named: dict) -> dict:
    return {"fp8_format": "e4m3" if shape["e4m3_out"] else ""}


def _reduce_out(shape: dict, named: dict) -> dict:
    dtype = torch.float8_e4m3fn if shape["e4m3_out"] else named["x"].dtype
    return {**_reduce(shape, named), "out": torch.empty(shape["num_tokens"], shape["hidden"], dtype=dtype)}


_REDUCE_SHAPE = {"has_weights": True, "has_x_sf": True, "has_sf": True, "e4m3_out": True}
_SWIGLU_TOKEN_SHAPE = {"has_weights": True, "has_expert": True, "count_clamp": True, "swiglu_clamp_value": 10.0}

CASES: dict[str, Case] = {
    "aux_fi": Case("aux_fi"),
    "cast_back": Case("cast_back"),
    "cast_back_colmajor": Case("cast_back_colmajor"),
    "cast_back_e5m6": Case("cast_back_e5m6"),
    "cast_back_e5m6_colmajor": Case("cast_back_e5m6_colmajor"),
    "engram_gate_bwd": Case("engram_gate_bwd"),
    "engram_gate_fwd": Case("engram_gate_fwd"),
    "engram_hash": Case("engram_hash"),
    "expand_to_fused": Case("expand_to_fused"),
    "expand_to_fused_with_sf": Case("expand_to_fused_with_sf"),
    "expand_to_mhc": Case("expand_to_mhc"),
    "expand_to_mhc_bwd": Case("expand_to_mhc_bwd"),
    "fused_weight": Case("fused_weight"),
    "get_fused_mapping": Case("get_fused_mapping"),
    "grad_w_reduce": Case("grad_w_reduce"),
    "group_count": Case("group_count"),
    "inplace_unique_group_indices": Case("inplace_unique_group_indices"),
    "mask_indices_by_tp": Case("mask_indices_by_tp", args=lambda shape, named: {
        "n": 256, "num_ep_ranks": 8, "tp_rank": 1, "num_tp_ranks": 2}),
    "mhc_head_compute_mix": Case("mhc_head_compute_mix"),
    "mhc_head_compute_mix_bwd": Case("mhc_head_compute_mix_bwd"),
    "mhc_multilayer_recompute": Case("mhc_multilayer_recompute"),
    "mhc_post_bwd": Case("mhc_post_bwd"),
    "mhc_post_fwd": Case("mhc_post_fwd"),
    "mhc_pre_big_fuse": Case("mhc_pre_big_fuse", args=_big_fuse),
    "mhc_pre_norm_fn": Case("mhc_pre_norm_fn"),
    "mhc_pre_norm_fn_bwd": Case("mhc_pre_norm_fn_bwd", args=_pre_norm_fn_bwd),
    "mhc_pre_split_mixes": Case("mhc_pre_split_mixes"),
    "mhc_pre_split_mixes_bwd": Case("mhc_pre_split_mixes_bwd"),
    "normalize_weight": Case("normalize_weight"),
    "per_block_cast": Case("per_block_cast"),
    "per_block_cast_colmajor": Case("per_block_cast_colmajor"),
    "per_block_cast_lossless": Case("per_block_cast_lossless"),
    "per_block_cast_lossless_colmajor": Case("per_block_cast_lossless_colmajor"),
    "per_block_cast_with_sf": Case("per_block_cast_with_sf"),
    "per_channel_cast": Case("per_channel_cast", args=_flat_2d("x")),
    "per_channel_cast_and_transpose": Case("per_channel_cast_and_transpose", args=_flat_2d("x")),
    "per_channel_cast_fused": Case("per_channel_cast_fused", shape={"in_dtype": "float8_e4m3fn", "has_x_sf": True,
                                                                    "has_pos": True}),
    "per_token_cast": Case("per_token_cast"),
    "per_token_cast_colmajor": Case("per_token_cast_colmajor"),
    "per_token_cast_e2m1": Case("per_token_cast_e2m1"),
    "per_token_cast_e2m1_colmajor": Case("per_token_cast_e2m1_colmajor"),
    "per_token_cast_e5m6": Case("per_token_cast_e5m6"),
    "per_token_cast_e5m6_colmajor": Case("per_token_cast_e5m6_colmajor"),
    "pre_apply_mix": Case("pre_apply_mix"),
    "pre_apply_mix_bwd": Case("pre_apply_mix_bwd"),
    "pre_apply_mix_bwd_acc": Case("pre_apply_mix_bwd_acc"),
    "reduce_fused": Case("reduce_fused", shape=_REDUCE_SHAPE, args=_reduce),
    "reduce_fused_out": Case("reduce_fused", shape=_REDUCE_SHAPE, args=_reduce_out),
    "sinkhorn_bwd": Case("sinkhorn_bwd"),
    "sinkhorn_fwd": Case("sinkhorn_fwd"),
    "swiglu_backward_and_per_token_cast": Case("swiglu_backward_and_per_token_cast"),
    "swiglu_forward_and_per_channel_cast": Case("swiglu_forward_and_per_channel_cast", args=_swiglu_channel),
    "swiglu_forward_and_per_channel_cast_and_transpose": Case("swiglu_forward_and_per_channel_cast_and_transpose",
                                                              args=_swiglu_channel),
    "swiglu_forward_and_per_token_cast": Case("swiglu_forward_and_per_token_cast", shape=_SWIGLU_TOKEN_SHAPE),
    "top2_sum_gate": Case("top2_sum_gate", shape={"has_mask": True, "has_map": True, "num_duplicates": 2,
                                                  "has_fix": True, "has_unmapped": True}, args=_top2),
    "topk_gate": Case("topk_gate"),
    "topk_sum_and_topk_group_idx": Case("topk_sum_and_topk_group_idx"),
    "transpose": Case("transpose", shape={"dtype": "float32"}),
}


def _op_names() -> list[str]:
    """Every op of the tkjit library (its schemas, not a list kept by hand: a new op without a case fails)."""
    return sorted(n for n in dir(torch.ops.tkjit) if isinstance(getattr(torch.ops.tkjit, n, None),
                                                                   torch._ops.OpOverloadPacket))


def _schema(name: str) -> list:
    return list(getattr(torch.ops.tkjit, name).default._schema.arguments)


def _valid_args(name: str, case: Case | None = None) -> dict[str, Any]:
    """The op's valid arguments by name (real tensors; defaults left out), from CASES[name] or `case`."""
    case = case or CASES[name]
    spec = tkjit.get_spec(case.spec)
    small = {p.name: SMALL[p.name] for p in spec.runtime_params}
    shape = spec.canonical_shape({**spec.examples[0], **small, **case.shape})
    made = spec.make_inputs(shape, device="cpu", seed=0)
    present = [a.name for a in spec.inputs if a.present(shape)]
    named = dict(zip(present + [s.name for s in spec.scalars], made))
    extra = case.args(shape, named) if case.args else {}
    args = {}
    for arg in _schema(name):
        if arg.name in extra:
            args[arg.name] = extra[arg.name]
        elif arg.name in named:
            args[arg.name] = named[arg.name]
        elif arg.name in shape and arg.name != "config":
            args[arg.name] = shape[arg.name]
        elif _kind(arg) == ("Tensor", True) and not arg.has_default_value():  # an optional input left out
            args[arg.name] = None
        elif not arg.has_default_value():
            raise AssertionError(f"{name}: no value for argument {arg.name}")
    return args


def _call(name: str, args: dict[str, Any]) -> Any:
    return getattr(torch.ops.tkjit, name)(**args)


# -- mutations --------------------------------------------------------------------------------------

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.int32, torch.int8,
          torch.bool)


def _empty(shape, dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype)


def _tensor_mutations(t: torch.Tensor) -> Iterator[tuple[str, Any]]:
    """(what, value): t's bad forms, made inside the fake mode."""
    shape, dtype = list(t.shape), t.dtype
    for d in DTYPES:
        if d != dtype:
            yield f"dtype {d}", _empty(shape, d)
    yield "a leading axis more", _empty([1, *shape], dtype)
    yield "a trailing axis more", _empty([*shape, 2], dtype)
    if shape:
        yield "the first axis less", _empty(shape[1:], dtype)
        yield "the last axis less", _empty(shape[:-1], dtype)
    for axis, size in enumerate(shape):
        for new in (size + 1, 0, 1 << 31, *([1] if size > 1 else [])):  # (1: what torch would broadcast)
            yield f"axis {axis} = {new}", _empty(shape[:axis] + [new] + shape[axis + 1:], dtype)
    yield "None", None
    if len(shape) >= 2:
        yield "transposed storage", _empty([*shape[:-2], shape[-1], shape[-2]], dtype).transpose(-1, -2)
    if shape:
        yield "every other column", _empty([*shape[:-1], 2 * shape[-1]], dtype)[..., ::2]


def _kind(arg) -> tuple[str, bool]:
    """A schema argument's type ('int', 'Tensor', ...) and whether it is optional."""
    if isinstance(arg.type, torch.OptionalType):
        return str(arg.type.getElementType()), True
    return str(arg.type), False


def _scalar_mutations(arg, value: Any) -> Iterator[tuple[str, Any]]:
    kind, optional = _kind(arg)
    if kind == "int":
        for v in (-1, 0, 1 << 31, (1 << 63) - 1):
            yield f"{v}", v
    elif kind == "float":
        for v in (-1.0, math.nan, math.inf, 1e300):
            yield f"{v}", v
    elif kind == "bool":
        yield f"{not value}", not value
    elif kind == "str":
        for v in ("bogus", ""):
            yield repr(v), v
    if optional and value is not None:
        yield "None", None


def _mutations(name: str, args: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for arg in _schema(name):
        if arg.name == "config" or arg.name.endswith("_config"):
            continue
        value = args.get(arg.name, arg.default_value if arg.has_default_value() else None)
        if isinstance(value, torch.Tensor):
            bad = _tensor_mutations(value)
        elif _kind(arg)[0] == "Tensor" and value is None:  # an optional tensor left out: given 1-D
            bad = iter([("a 1-D float32 tensor", _empty([3], torch.float32))])
        else:
            bad = _scalar_mutations(arg, value)
        for what, v in bad:
            yield f"{arg.name}: {what}", {**args, arg.name: v}


def _from_torch_parsing(e: BaseException) -> bool:
    """A TypeError raised by torch's argument parsing, before any tkjit code ran."""
    frames = traceback.extract_tb(e.__traceback__)
    return isinstance(e, TypeError) and not any(str(Path(f.filename).resolve()).startswith(TKJIT_DIR) for f in frames)


class Internal(Exception):
    """What a call raised that is neither a tkjit error nor torch's argument parsing refusing a Python type."""


def _outcome(name: str, args: dict[str, Any]) -> str | None:
    """None if the call accepts the arguments (or torch's argument parsing refuses them), else the tkjit error it
    raised as 'Type: message'; Internal for anything else."""
    try:
        _call(name, args)
    except TkjitError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - any other exception type is the finding
        if _from_torch_parsing(e):
            return None
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise Internal(f"{type(e).__name__}: {str(e).splitlines()[0][:200]} "
                       f"(at {Path(where.filename).name}:{where.lineno})") from None
    return None


def _outcomes(name: str, mutations: list[tuple[str, dict]]) -> tuple[list[str | None], list[str]]:
    """Each mutation's outcome, and the findings: the mutations that raised an internal error."""
    got, findings = [], []
    for what, bad in mutations:
        try:
            got.append(_outcome(name, bad))
        except Internal as e:
            got.append(None)
            findings.append(f"{what} -> {e}")
    return got, findings


def _fake_args(mode: FakeTensorMode, real: dict[str, Any]) -> dict[str, Any]:
    return {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in real.items()}


def test_every_op_has_a_case():
    assert _op_names() == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_refuses_bad_input_with_a_tkjit_error(name):
    real = _valid_args(name)  # (made outside the mode: make_inputs computes on real tensors)
    with FakeTensorMode() as mode:
        args = _fake_args(mode, real)
        assert _outcome(name, args) is None  # the valid call traces
        _, findings = _outcomes(name, list(_mutations(name, args)))
    assert not findings, f"{name}: {len(findings)} mutations raised a non-tkjit error:\n  " + "\n  ".join(findings)


# -- the eager path: every kernel a CPU kernel that checks its arguments as on the GPU ---------------

def _real(v: Any) -> Any:
    """A fake-mode mutation as a real tensor of the same shape, dtype and strides (zeros: valid indices)."""
    if not isinstance(v, torch.Tensor):
        return v
    base = torch.zeros(v.untyped_storage().nbytes() // v.element_size() or 1, dtype=v.dtype)
    return base.as_strided(v.shape, v.stride(), v.storage_offset())


def _serve_checking_kernels(monkeypatch) -> None:
    """`tkjit.torch_ops.serve.get` gives every kernel as a CPU CompiledKernel whose launch zero-fills the outputs: the
    kernels' own argument checks run (as on the GPU), nothing compiles, no reference is computed."""
    def get(name, shape, arch=None, config=None):
        spec = tkjit.get_spec(name)
        full = spec.canonical_shape(shape)
        first = len([a for a in spec.inputs if a.present(full)])

        def launch(*args):
            for out in args[first:first + len(spec.outputs)]:
                out.zero_()

        return CompiledKernel(spec, full, spec.default_config(full, "sm_90a"), "cpu", "0" * 40, "explicit",
                              Path("."), launch)

    monkeypatch.setattr(tkjit.torch_ops.serve, "get", get)


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_refuses_bad_input_as_the_fake_does(name, monkeypatch):
    """The same mutations through the real implementations (the dispatcher's eager path; not those too large to
    allocate): a tkjit error or success, never an internal error; where the fake refuses, the same error; where
    the eager call accepts, the fake too (what torch.compile traces runs). The fake may accept what the kernel
    then refuses at run time (a layout it does not check, an out= tensor)."""
    _serve_checking_kernels(monkeypatch)
    real = _valid_args(name)
    assert _outcome(name, real) is None
    with FakeTensorMode() as mode:
        small = [(what, bad) for what, bad in _mutations(name, _fake_args(mode, real))
                 if not any(isinstance(v, torch.Tensor) and v.numel() > 1 << 24 for v in bad.values())]
        fake, _ = _outcomes(name, small)
    eager, findings = _outcomes(name, [(what, {k: _real(v) for k, v in bad.items()}) for what, bad in small])
    findings += [f"{what} -> fake {f!r}, eager {e!r}" for (what, _), f, e in zip(small, fake, eager)
                 if f is not None and f != e]
    assert not findings, f"{name}: {len(findings)} mutations:\n  " + "\n  ".join(findings)


# Other valid forms of the ops (optional inputs left out or given alone, another spec of the op): the fake
# accepts each, and its outputs are the eager call's (shapes, dtypes).
VARIANTS = [
    ("top2_sum_gate", Case("top2_sum_gate", shape={"has_map": True, "num_duplicates": 2}, args=_top2)),
    ("top2_sum_gate", Case("top2_sum_gate", shape={"has_mask": True}, args=_top2)),
    ("top2_sum_gate", Case("top2_sum_gate", shape={"has_unmapped": True}, args=_top2)),
    ("reduce_fused", Case("reduce_fused", shape={"has_weights": False}, args=_reduce)),
    ("reduce_fused", Case("reduce_fused", shape={"has_x_sf": True}, args=_reduce)),
    ("per_channel_cast_fused", Case("per_channel_cast_fused", shape={"has_pos": True})),
    ("per_channel_cast_fused", Case("per_channel_cast_fused", shape={"in_dtype": "float8_e4m3fn", "has_x_sf": True,
                                                                     "num_tokens_out": 5})),
    ("swiglu_forward_and_per_token_cast", Case("swiglu_forward_and_per_token_cast", shape={"num_weights": 1},
                                               args=lambda shape, named: {"clamped_count": None})),
    ("swiglu_forward_and_per_token_cast", Case("swiglu_forward_and_per_token_cast", shape={"has_expert": True,
                                                                                           "num_weights": 1},
                                               args=lambda shape, named: {"clamped_count": None})),
    ("transpose", Case("batched_transpose", shape={"dtype": "float32"})),
    ("per_block_cast", Case("per_block_cast", shape={"fmt": "e2m1"})),
    ("per_block_cast_colmajor", Case("per_block_cast_colmajor", shape={"fmt": "e2m1", "round_scale": True})),
    ("per_block_cast_with_sf", Case("per_block_cast_with_sf", shape={"fmt": "e2m1"})),
]


@pytest.mark.parametrize("name, case", [(n, CASES[n]) for n in sorted(CASES)] + VARIANTS,
                         ids=[*sorted(CASES), *(f"{n}-{i}" for i, (n, _) in enumerate(VARIANTS))])
def test_fake_outputs_are_the_eager_ones(name, case, monkeypatch):
    _serve_checking_kernels(monkeypatch)
    real = _valid_args(name, case)
    eager = _call(name, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in real.items()})
    with FakeTensorMode() as mode:
        fake = _call(name, _fake_args(mode, real))
    if eager is None:  # an op that only writes its arguments in place
        assert fake is None
        return
    eager, fake = (eager, fake) if isinstance(eager, tuple) else ((eager,), (fake,))
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in eager]
