#!/usr/bin/env python3
"""Host cost per call: many back-to-back launches of a 1-token input, then one sync.

    python tools/hostcost.py [--calls 3000] [--json out.json] [--device cpu]

For µs-sized kernels the host path is the whole cost in eager mode, so each figure is wall time
per call over `--calls` calls (kernels queue asynchronously; one sync at the end), reported beside
torch.topk's on the same host. Rows: the `tkjit.ops` function (eager fast path), the same op through
the dispatcher (`torch.ops.tkjit`), a kernel object from `tkjit.get`, TileKernels where installed
(skipped where not), and sinkhorn forward + backward under autograd at 4096 tokens beside torch's own
floor for one autograd.Function's forward and backward (an identity, no kernel); on a GPU, that step at 1 to
1M tokens beside TileKernels' `sinkhorn_normalize`. On a GPU, three
rows bound the others: the kernel object into given outputs (no allocation), one `torch.empty`, and
an empty kernel launched through the driver API with ctypes (the floor of a launch from Python).

The targets are checked at the end: `tkjit.ops.topk_gate` at most 5 µs and 0.3x torch.topk, a kernel
object at most 3 µs. `--device cpu` runs the C-target kernels (sinkhorn_fwd, transpose) on a host
without a GPU: the same host path, with the kernels' CPU time in each figure.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

import tkjit
import tkjit.ops
from tkjit import envs, torch_ops

OPS_US, OPS_X_TOPK, KERNEL_US = 5.0, 0.3, 3.0  # the targets


def per_call_us(rows: dict[str, Callable[[], object]], calls: Callable[[str], int], sync: Callable[[], None],
                rounds: int = 5) -> dict[str, float]:
    """µs a call of each row: the best of `rounds` rounds, each round timing every row once in turn, so that
    rows compared with each other (tkjit's step beside TileKernels') see the same host state, not one row an
    earlier minute's. Best, not median: the figure is a cost floor, other host activity only adds."""
    for name, fn in rows.items():  # warm-up: plans, caches, allocator
        for _ in range(min(200, calls(name))):
            fn()
    sync()
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(rounds):
        for name, fn in rows.items():
            n = calls(name)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return best


def empty_launch() -> Callable[[], object]:
    """An empty kernel launched through the driver API with ctypes on torch's current stream: no argument
    packing, no checks; what a launch from Python costs on this host at least."""
    import ctypes

    torch.empty(1, device="cuda")  # torch's primary context, current on this thread
    cu = ctypes.CDLL("libcuda.so.1")
    ptx = b".version 7.0\n.target sm_50\n.address_size 64\n.visible .entry tkjit_empty()\n{\n  ret;\n}\n"
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    rc = cu.cuModuleLoadData(ctypes.byref(mod), ptx) or cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"tkjit_empty")
    if rc != 0:
        raise RuntimeError(f"driver error {rc} loading the empty kernel")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    launch, one, zero = cu.cuLaunchKernel, ctypes.c_uint(1), ctypes.c_uint(0)
    return lambda: launch(fn, one, one, one, one, one, one, zero, stream, None, None)


def rows_for(dev: str) -> dict[str, Callable[[], object]]:
    scores = torch.randn(1, 256, device=dev)
    x = torch.randn(1, 4, 4, device=dev)
    rows: dict[str, Callable[[], object]] = {"torch.topk": lambda: torch.topk(scores, 8)}
    if dev == "cuda":
        k_topk = tkjit.get("topk_gate", {"num_tokens": 1, "num_experts": 256, "k": 8})
        rows["tkjit.ops.topk_gate"] = lambda: tkjit.ops.topk_gate(scores, 8)
        rows["torch.ops.tkjit.topk_gate"] = lambda: torch.ops.tkjit.topk_gate(scores, 8)
        rows["tkjit.get(topk_gate) kernel"] = lambda: k_topk(scores)
        # What bounds the rows above (the issue asks for a profile where a target is missed): the same
        # kernel object into given outputs (no allocation), one allocation alone, and an empty kernel
        # launched straight through the driver from Python (the floor of any launch from Python here).
        given = k_topk(scores)
        given = given if isinstance(given, tuple) else (given,)
        rows["tkjit.get(topk_gate) kernel, out= given"] = lambda: k_topk(scores, out=given)
        rows["torch.empty (one output)"] = lambda: torch.empty(1, 8, device=dev)
        try:  # a bound, not a target: a driver that refuses the PTX costs this row only
            rows["ctypes cuLaunchKernel, empty kernel"] = empty_launch()
        except (OSError, RuntimeError) as e:
            print(f"empty-launch row skipped: {e}")
    else:  # topk_gate does not lower on the C target: transpose stands in as the second op
        xt = torch.randn(8, 64)
        k_t = tkjit.get("transpose", {"rows": 8, "cols": 64, "dtype": "float32"}, arch="cpu")
        rows["tkjit.ops.transpose"] = lambda: tkjit.ops.transpose(xt)
        rows["torch.ops.tkjit.transpose"] = lambda: torch.ops.tkjit.transpose(xt)
        rows["tkjit.get(transpose) kernel"] = lambda: k_t(xt)
    k_sink = tkjit.get("sinkhorn_fwd", {"num_tokens": 1, "n": 4}, arch="cpu" if dev == "cpu" else None)
    rows["tkjit.ops.sinkhorn_fwd"] = lambda: tkjit.ops.sinkhorn_fwd(x)
    rows["tkjit.get(sinkhorn_fwd) kernel"] = lambda: k_sink(x)
    if dev == "cuda":
        # The routing ops with scalars, absent optional inputs (top2_sum_gate) and caller-sized outputs
        # (get_fused_mapping), through the compat API as a TileKernels user calls them.
        import tkjit.compat.tile_kernels as tkc

        logits, bias = torch.randn(1, 256, device=dev), torch.randn(256, device=dev)
        idx = torch.topk(scores, 8).indices
        gate_args = (logits, bias, 8, 4, 8, False, 0, 2.5, 0, 1, 0, 1, "sigmoid")
        rows["compat moe.topk_gate"] = lambda: tkc.moe.topk_gate(scores, 8)
        rows["compat moe.top2_sum_gate"] = lambda: tkc.moe.top2_sum_gate(*gate_args)
        rows["compat moe.get_fused_mapping"] = lambda: tkc.moe.get_fused_mapping(idx, 256, 8 + 256 * 127, 128)
        try:
            import tile_kernels.moe as tkm

            rows["tile_kernels.moe.topk_gate"] = lambda: tkm.topk_gate(scores, 8)
            rows["tile_kernels.moe.top2_sum_gate"] = lambda: tkm.top2_sum_gate(*gate_args)
            rows["tile_kernels.moe.get_fused_mapping"] = lambda: tkm.get_fused_mapping(idx, 256, 8 + 256 * 127, 128)
        except Exception as e:  # a baseline, never a dependency
            print(f"TileKernels not available (row skipped): {type(e).__name__}: {e}")
    xs = torch.randn(4096, 4, 4, device=dev, requires_grad=True)
    g = torch.randn(4096, 4, 4, device=dev)

    def step():
        y = tkjit.ops.sinkhorn(xs)
        y.backward(g)

    rows["tkjit.ops.sinkhorn fwd+bwd 4096 tokens"] = step

    def floor_step():  # torch's own cost of one Function's forward and backward, no kernel: the step's floor
        _Identity.apply(xs).backward(g)

    rows["autograd floor: identity Function fwd+bwd 4096"] = floor_step
    if dev == "cuda":
        rows.update(sinkhorn_steps(dev))
    return rows


STEP_TOKENS = (1, 64, 4096, 65536, 1 << 20)  # the token counts of the Sinkhorn step rows


def sinkhorn_steps(dev: str) -> dict[str, Callable[[], object]]:
    """Sinkhorn forward + backward under autograd, a step's wall time at each of STEP_TOKENS, tkjit's
    `ops.sinkhorn` beside TileKernels' `sinkhorn_normalize` where installed (the issue's bar: faster at every
    count; at the small ones the step is host cost, at 1M the kernels)."""
    try:
        from tile_kernels.modeling.mhc.ops import sinkhorn_normalize as theirs
    except Exception as e:  # a baseline, never a dependency
        print(f"TileKernels not available (its sinkhorn rows skipped): {type(e).__name__}: {e}")
        theirs = None
    rows: dict[str, Callable[[], object]] = {}
    for n in STEP_TOKENS:
        x = torch.randn(n, 4, 4, device=dev, requires_grad=True)
        g = torch.randn(n, 4, 4, device=dev)
        for who, fn in (("tkjit.ops.sinkhorn", tkjit.ops.sinkhorn), ("tile_kernels sinkhorn_normalize", theirs)):
            if fn is not None:
                rows[f"{who} fwd+bwd step {n} tokens"] = (lambda f=fn, x=x, g=g: f(x).backward(g))
    return rows


def calls_for(name: str, calls: int) -> int:
    """Fewer calls for the rows whose kernels take long (the 4096-token and larger autograd steps)."""
    if "step" in name:
        n = int(name.split("step ")[1].split()[0])
        return max(3, calls // (10 if n <= 4096 else 100 if n <= 65536 else 1000))
    return calls if "4096" not in name else max(1, calls // 10)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    rows = rows_for(a.device)
    out = per_call_us(rows, lambda name: calls_for(name, a.calls), sync)
    ref = out["torch.topk"]
    print(f"CUDA launcher: {envs.launcher()} (TKJIT_LAUNCHER); torch {torch.__version__}, lean dispatch for "
          f"{len(torch_ops.LEAN_OPS)} of {len(torch_ops.OPS)} torch.ops.tkjit ops")
    for why, op in torch_ops.LEAN_SKIPPED.items():
        print(f"  not lean here ({op} and others alike): {why}")
    print(f"{'call':48s} {'us/call':>8s} {'x torch.topk':>13s}")
    for name, us in out.items():
        print(f"{name:48s} {us:8.2f} {us / ref:13.2f}")
    ops = next(n for n in out if n.startswith("tkjit.ops.") and "sinkhorn" not in n)
    kernel = next(n for n in out if n.startswith("tkjit.get(") and "sinkhorn" not in n)
    checks = {
        f"{ops} <= {OPS_US} us": out[ops] <= OPS_US,
        f"{ops} <= {OPS_X_TOPK} x torch.topk": out[ops] <= OPS_X_TOPK * ref,
        f"{kernel} <= {KERNEL_US} us": out[kernel] <= KERNEL_US,
    }
    for what, ok in checks.items():
        print(f"target {what}: {'met' if ok else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                       "torch": torch.__version__, "launcher": envs.launcher(), "us_per_call": out,
                       "targets": checks}, f, indent=1)


if __name__ == "__main__":
    main()
