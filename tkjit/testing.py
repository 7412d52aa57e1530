"""Correctness checks shared by the tests, the tuner's gate and the benchmarks.

Outputs are poisoned before every run (NaN for floats, a sentinel for ints) so an element the
kernel never wrote cannot pass; inputs are fresh random draws from the spec, never zeros.
"""

from __future__ import annotations

from typing import Any

import torch

from tkjit.kernel import CompiledKernel, torch_dtype


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


def check(
    kernel: CompiledKernel, shape: dict[str, Any], *, device: str | torch.device = "cuda", seed: int = 0
) -> str | None:
    """Run `kernel` at `shape` (full: static + runtime) against the spec's reference.

    Returns None when every output matches, else the first mismatch as a message.
    """
    spec = kernel.spec
    full = spec.canonical_shape(shape)
    inputs = spec.make_inputs(full, device=device, seed=seed)
    runtime = {p.name: full[p.name] for p in spec.runtime_params}
    outs = poisoned_outputs(kernel, runtime, inputs[0].device if inputs else device)
    kernel(*inputs, out=outs)
    if inputs and inputs[0].is_cuda:
        torch.cuda.synchronize()
    ref = spec.reference(full, *[t.cpu() for t in inputs])
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    for (name, _, _), o, r in zip(spec.output_decls(full), outs, refs):
        problem = spec.tolerance.check(name, o.cpu(), r)
        if problem:
            return f"{spec.name} {kernel.config} at {runtime}: {problem}"
    return None
