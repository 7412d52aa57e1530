"""A test-only spec whose *compile* kills the compiling process, importable by compile pool workers.

`crash_compile` builds y = 2 x. Its builder raises SIGSEGV in the compiling process while the
counter file named by TKJIT_TEST_CRASHES holds fewer than `crashes` lines (one line per crash), so
a test can make the compiler die once, twice or always.
"""

import os
import signal
from pathlib import Path

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, TensorArg


def build(shape, c):
    counter = Path(os.environ["TKJIT_TEST_CRASHES"])
    done = counter.read_text().count("\n") if counter.exists() else 0
    if done < c["crashes"]:
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGSEGV)
    from tilelang import language as T

    n = T.dynamic("n")

    @T.prim_func
    def double(x: T.Tensor[(n,), T.float32], y: T.Tensor[(n,), T.float32]):
        with T.Kernel(1, threads=1) as _:
            for i in T.serial(n):
                y[i] = x[i] * 2.0

    return double


SPEC = register(
    KernelSpec(
        name="crash_compile",
        family="planted",
        doc="y = 2 x; its compile segfaults the first `crashes` times (tests only)",
        params=(Runtime("n", hi=1 << 20),),
        space={"crashes": (0, 1, 2, 99)},
        default=lambda s: {"crashes": 0},
        build=build,
        inputs=(TensorArg("x", "float32", ("n",)),),
        outputs=(TensorArg("y", "float32", ("n",)),),
        make_inputs=lambda shape, device="cpu", seed=0: (torch.randn(shape["n"]).to(device),),
        reference=lambda shape, x: x * 2.0,
        bytes_moved=lambda s: 8 * s["n"],
        examples=({"n": 64},),
    ),
    replace=True,
)
