"""Correctness checks shared by the tests, the tuner's gate and the benchmarks.

Outputs are poisoned before every run (NaN for floats, a sentinel for ints) so an element the
kernel never wrote cannot pass; inputs are fresh random draws from the spec, never zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tkjit.kernel import CompiledKernel, torch_dtype
from tkjit.spec import KernelSpec


def poisoned_outputs(kernel: CompiledKernel, sizes: dict[str, Any], device) -> list[torch.Tensor]:
    outs = []
    for _, dtype, dims in kernel.spec.output_decls({**kernel.shape, **sizes}):
        dt = torch_dtype(dtype)
        t = torch.empty(dims, dtype=dt, device=device)
        if dt.is_floating_point and t.element_size() > 1:
            t.fill_(float("nan"))
        elif dt.is_floating_point:  # fp8: 0xFF is NaN in e4m3fn
            t.view(torch.uint8).fill_(0xFF)
        elif dt == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(dt).min if dt.is_signed else torch.iinfo(dt).max)
        outs.append(t)
    return outs


def reference_outputs(spec: KernelSpec, full: dict[str, Any], inputs: Sequence[torch.Tensor]) -> tuple:
    """The spec's reference outputs for `inputs`, always a tuple of CPU tensors (computed on CPU copies of
    the inputs, or where they are for a spec with `reference_on_device`).

    inputs: the tensors, then the values of the spec's scalars (passed to the reference as they are)."""
    if spec.reference_on_device:
        ref = spec.reference(full, *inputs)
    else:
        ref = spec.reference(full, *[t.cpu() if isinstance(t, torch.Tensor) else t for t in inputs])
    ref = tuple(ref) if isinstance(ref, (tuple, list)) else (ref,)
    return tuple(r.cpu() if isinstance(r, torch.Tensor) else r for r in ref)


def inout_copies(spec: KernelSpec, full: dict[str, Any], inputs: Sequence[Any]) -> list[Any]:
    """`inputs` with each in-place input (TensorArg.inout) replaced by a copy: a kernel run on the result, once or
    a thousand times, leaves `inputs` as they were. make_inputs gives the present inputs only (then any scalars):
    positions are among those, not among spec.inputs."""
    present = [a for a in spec.inputs if a.present(full)]
    return [t.clone() if i < len(present) and present[i].inout else t for i, t in enumerate(inputs)]


def run_against_reference(
    kernel: CompiledKernel,
    full: dict[str, Any],
    inputs: Sequence[torch.Tensor],
    *,
    refs: Sequence[Any] | None = None,
    device: str | torch.device = "cuda",
) -> tuple[list[torch.Tensor], str | None]:
    """Run `kernel` on `inputs` into poisoned outputs and compare each output with the reference.

    full: static + runtime shape. refs: the reference outputs when already computed (the tuner
    computes them once per study and keeps them on the device), else computed here after the run.
    device: where the outputs go when there are no inputs to follow. Returns (the outputs, kept for
    re-runs; None when every output is within the spec's tolerance, else the first mismatch).
    """
    spec = kernel.spec
    runtime = {p.name: full[p.name] for p in spec.runtime_params}
    dev = torch.device(inputs[0].device if inputs else device)
    # make_inputs gives the present inputs only (then any scalars): index those, not spec.inputs (an absent
    # optional input before an inout one would shift it).
    present = [a for a in spec.inputs if a.present(full)]
    inouts = [i for i, a in enumerate(present) if a.inout]
    if inouts:
        # An in-place kernel changes its inputs: the reference sees them first, and the kernel runs on
        # copies, so the caller's inputs (a tuner's study data) stay as they were.
        if refs is None:
            refs = reference_outputs(spec, full, inputs)
        inputs = inout_copies(spec, full, inputs)
    outs = poisoned_outputs(kernel, runtime, dev)
    kernel(*inputs, out=outs)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if refs is None:
        refs = reference_outputs(spec, full, inputs)
    # What the call returns, in its order: the inout inputs, then the outputs. A reference that gives only
    # the outputs leaves the inout inputs unchecked: they are scratch space (get_fused_mapping's workspace).
    decls = spec.output_decls(full)
    results = [(present[i].name, inputs[i]) for i in inouts] if len(refs) > len(decls) else []
    results += [(name, o) for (name, _, _), o in zip(decls, outs)]
    for (name, o), r in zip(results, refs):
        # Compared where the reference is: the CPU, or the device for references a caller moved there (the
        # tuner's study data: a 1M-token output is tens of MB to copy back and compare on the host per config).
        problem = spec.tolerance.check(name, o if isinstance(r, torch.Tensor) and r.device == o.device else o.cpu(), r)
        if problem:
            return outs, problem
    return outs, None


def check(
    kernel: CompiledKernel, shape: dict[str, Any], *, device: str | torch.device = "cuda", seed: int = 0,
    data: tuple[Sequence[Any], Sequence[Any]] | None = None,
) -> str | None:
    """Run `kernel` at `shape` (full: static + runtime) on fresh random inputs against the spec's reference.

    data: the inputs drawn at `seed` and their reference outputs, when the caller keeps them (the tuner's
    worker: one draw a seed checks many candidates). Returns None when every output matches, else the first
    mismatch as a message.
    """
    spec = kernel.spec
    full = spec.canonical_shape(shape)
    inputs, refs = data if data is not None else (spec.make_inputs(full, device=device, seed=seed), None)
    _, problem = run_against_reference(kernel, full, inputs, refs=refs, device=device)
    if problem:
        runtime = {p.name: full[p.name] for p in spec.runtime_params}
        return f"{spec.name} {kernel.config} at {runtime}: {problem}"
    return None


def spread(configs: Sequence[dict[str, Any]], most: int | None, keep: dict[str, Any] | None = None) -> list:
    """At most `most` of configs, evenly spread over the list (its order is the space's), `keep` (the
    default) always among them; all of them when most is None or not smaller."""
    configs = list(configs)
    if most is None or len(configs) <= most:
        return configs
    picked = [configs[round(i * (len(configs) - 1) / max(1, most - 1))] for i in range(most)]
    if keep is not None and keep in configs and keep not in picked:
        picked[-1] = keep
    return picked


def check_configs(
    name: str,
    shapes: Sequence[dict[str, Any]],
    sizes: Sequence[dict[str, int]],
    *,
    seeds: Sequence[int] = (0, 1),
    arch: str = "sm_90a",
    device: str = "cuda",
    most: int | None = None,
) -> list[str]:
    """The configs of the space at each shape, compiled in parallel first (tkjit.pool.compile_many), each
    run at every runtime size of `sizes` (merged into the shape) with every seed against the reference.

    Returns the failures, each naming the config and the sizes (empty: all passed). most: an evenly
    spread subset of each space (`spread`, the default always in), for a bounded test time.
    """
    from tkjit.pool import compile_many
    from tkjit.registry import get_spec

    spec = get_spec(name)
    jobs = []
    for shape in shapes:
        full = spec.canonical_shape(shape)
        picked = spread(spec.configs(full, arch), most, spec.default_config(full, arch))
        jobs += [(name, spec.static_shape(full), c, arch, "explicit") for c in picked]
    failures = [f"{name} {cfg} does not compile: {err}" for (_, _, cfg, _, _), (_, err) in
                zip(jobs, compile_many(jobs)) if err is not None]
    if failures:
        return failures
    from tkjit.api import get

    for _, static, cfg, _, _ in jobs:
        for size in sizes:
            kern = get(name, {**static, **size}, arch=arch, config=cfg)
            for seed in seeds:
                msg = check(kern, {**static, **size}, device=device, seed=seed)
                if msg:
                    failures.append(msg)
    return failures


def bit_equal(a, b) -> bool:
    """Bit-exact equality of tensors (or tuples of them): same dtype, shape and bits; 1-byte floats
    (fp8) are compared as bytes, and NaN never equals NaN, so a NaN-poisoned element left unwritten
    fails."""
    import torch

    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(bit_equal(x, y) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1 and a.dtype.is_floating_point:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)
