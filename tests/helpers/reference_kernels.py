"""CUDA-only kernels on a CPU host: `tkjit.torch_ops.serve.get` serves them as CompiledKernels whose launch
writes the spec's reference, so the ops' schemas, fake implementations, tensor checks and output
allocation run for real while torch does the kernel's work (the GPU tests run the real kernels)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

import tkjit
import tkjit.torch_ops.serve
from tkjit.kernel import CompiledKernel


def serve_references(monkeypatch, names: Collection[str]) -> list[torch.Size]:
    """Patch `tkjit.torch_ops.serve.get` so that the kernels in `names` are reference-writing CPU kernels.

    Returns the list each launch appends its first input's shape to (an empty batch launches nothing)."""
    launches: list[torch.Size] = []
    real_get = tkjit.torch_ops.serve.get

    def get(name, shape, arch=None, config=None):
        if name not in names:
            return real_get(name, shape, arch=arch, config=config)
        spec = tkjit.get_spec(name)
        full = spec.canonical_shape(shape)
        ins = [a for a in spec.inputs if a.present(full)]
        runtime = {p.name for p in spec.runtime_params}

        def launch(*args):
            # The launcher's arguments: the inputs this variant takes, the outputs, then the scalars.
            inputs, outs = args[:len(ins)], args[len(ins):len(ins) + len(spec.outputs)]
            scalars = args[len(ins) + len(spec.outputs):]
            sizes = {d: t.shape[axis] for decl, t in zip([*ins, *spec.outputs], [*inputs, *outs])
                     for axis, d in enumerate(decl.dims) if isinstance(d, str) and d in runtime}
            launches.append(inputs[0].shape)
            ref = spec.reference({**full, **sizes}, *inputs, *scalars)
            refs = ref if isinstance(ref, tuple) else (ref,)
            # A reference gives the in-place inputs' new values first (when it checks them), then the outputs.
            inouts = [t for t, a in zip(inputs, ins) if a.inout]
            for o, r in zip([*inouts, *outs] if len(refs) > len(outs) else outs, refs):
                o.copy_(r)

        return CompiledKernel(spec, full, spec.default_config(full, "sm_90a"), "cpu", "0" * 40, "explicit",
                              Path("."), launch)

    monkeypatch.setattr(tkjit.torch_ops.serve, "get", get)
    return launches
