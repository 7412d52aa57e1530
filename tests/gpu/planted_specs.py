"""Test-only specs with planted bad configs, importable by the spawned compile and bench workers.

`planted_scale` computes y = 2 * x. Its `variant` tunable plants failures:
  good, good2  correct
  wrong        off by one in every element (the correctness gate must reject it)
  crash        writes 4 GiB past the output (an illegal address on a GPU)
  segv         raise(SIGSEGV) (C target only: the worker dies)
Tuning tests make the bad variants look fastest (a fake timer) and check that they never win.
`planted_slow_reference` is planted_scale whose reference takes SLOW_REFERENCE_S past SLOW_REFERENCE_N elements (a
study's shape, not its small fresh-input check's). Works on the C target (arch="cpu") and on GPUs.
"""

import time

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, TensorArg, Tolerance

VARIANTS = ("good", "good2", "wrong", "crash", "segv")


def build(shape, c):
    from tilelang import language as T

    n = T.dynamic("n")
    bt, variant = c["block"], c["variant"]
    @T.prim_func
    def planted(x: T.Tensor[(n,), T.float32], y: T.Tensor[(n,), T.float32]):
        with T.Kernel(T.ceildiv(n, bt), threads=bt) as bx:
            for t in T.Parallel(bt):
                i = bx * bt + t
                if i < n:
                    if variant == "wrong":
                        y[i] = x[i] * 2.0 + 1.0
                    elif variant == "crash":
                        y[i + (1 << 30)] = x[i] * 2.0  # far out of bounds: an illegal address on a GPU
                    elif variant == "segv":
                        T.evaluate(T.call_extern("int32", "raise", 11))  # the C target's crash: SIGSEGV
                    else:
                        y[i] = x[i] * 2.0

    return planted


def arch_constraint(arch, c, shape):
    if c["variant"] == "segv" and arch != "cpu":
        return "raise(SIGSEGV) is the C target's planted crash"
    return None


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape["n"], generator=g, dtype=torch.float32).to(device),)


SPEC = register(
    KernelSpec(
        name="planted_scale",
        family="planted",
        doc="y = 2 x, with planted wrong and crashing configs (tests only)",
        params=(Runtime("n", hi=1 << 28),),
        space={"variant": VARIANTS, "block": (64, 128)},
        default=lambda s: {"variant": "good", "block": 128},
        build=build,
        arch_constraint=arch_constraint,
        inputs=(TensorArg("x", "float32", ("n",)),),
        outputs=(TensorArg("y", "float32", ("n",)),),
        make_inputs=make_inputs,
        reference=lambda shape, x: x * 2.0,
        tolerance=Tolerance(rtol=1e-6),
        bytes_moved=lambda s: 8 * s["n"],
        examples=({"n": 4096},),
    ),
    replace=True,
)


SLOW_REFERENCE_N, SLOW_REFERENCE_S = 1 << 21, 5.0  # (the fresh-input check: <= 1 << 21 elements)


def slow_reference(shape, x):
    if shape["n"] > SLOW_REFERENCE_N:
        time.sleep(SLOW_REFERENCE_S)
    return x * 2.0


SLOW = register(
    KernelSpec(
        name="planted_slow_reference",
        family="planted",
        doc="y = 2 x, whose reference is slow at large n (tests only)",
        params=SPEC.params,
        space={"variant": ("good", "good2"), "block": (64, 128)},
        default=SPEC.default,
        build=build,
        inputs=SPEC.inputs,
        outputs=SPEC.outputs,
        make_inputs=make_inputs,
        reference=slow_reference,
        tolerance=SPEC.tolerance,
        bytes_moved=SPEC.bytes_moved,
        examples=SPEC.examples,
    ),
    replace=True,
)
