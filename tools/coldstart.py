#!/usr/bin/env python3
"""How long a fresh process takes to get a cached kernel and launch it, and the memo-hit cost.

    python tools/coldstart.py [--kernel topk_gate] [--shape num_tokens=1 num_experts=256 k=8] [--runs 5]
                              [--arch cpu] [--breakdown]

Fills the cache once, then starts fresh processes that time, after `import torch`:
  ctx      CUDA context + the input tensor (paid by any CUDA program, not by tkjit)
  import   `import tkjit`
  get      `tkjit.get(...)` from disk (key, verify sha256, dlopen)
  launch   first call + synchronize
  tkjit_total_ms = import + get + launch, against the 20 ms target
and whether TileLang (the compiler) or the tvm_ffi Python package was imported at all (neither
should be: kernels load and launch through the tvm-ffi C ABI). tkjit's and the specs' bytecode is
compiled first, as `pip install` does: a source checkout without __pycache__ (PYTHONDONTWRITEBYTECODE
set, or a fresh copy) would otherwise compile every module in each fresh process (45-60 ms instead
of 13-16 ms for `import tkjit` on the 2-core CPU host). Beside it, where TileKernels is
installed, the same fresh-process figure for its topk_gate (import + first call); skipped where not.
`--arch cpu` runs the C target on a host without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

from tkjit import envs
from tkjit.cli import add_shape_arg, parse_shape

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    t0 = time.perf_counter()
    name, shape, arch = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] or None
    if torch.cuda.is_available():
        torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
    t1 = time.perf_counter()
    import tkjit
    t2 = time.perf_counter()
    k = tkjit.get(name, shape, arch=arch)
    t3 = time.perf_counter()
    spec = tkjit.get_spec(name)
    inputs = spec.make_inputs(spec.canonical_shape(shape), device="cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available(): torch.cuda.synchronize()
    t4 = time.perf_counter()
    k(*inputs)
    if torch.cuda.is_available(): torch.cuda.synchronize()
    t5 = time.perf_counter()
    n = 200000
    s = time.perf_counter()
    for _ in range(n):
        tkjit.get(name, shape, arch=arch)
    memo_us = (time.perf_counter() - s) / n * 1e6
    out = k(*inputs)
    m = 2000
    s = time.perf_counter()
    for _ in range(m):
        k(*inputs)
    call_us = (time.perf_counter() - s) / m * 1e6  # host-side cost of one call (checks once + launch)
    s = time.perf_counter()
    for _ in range(m):
        k(*inputs, out=out)
    call_out_us = (time.perf_counter() - s) / m * 1e6  # with out=: every check, every call
    if torch.cuda.is_available(): torch.cuda.synchronize()
    print(json.dumps({"ctx_ms": (t1-t0)*1e3, "import_ms": (t2-t1)*1e3, "get_ms": (t3-t2)*1e3,
                      "launch_ms": (t5-t4)*1e3, "tkjit_total_ms": (t3-t1 + t5-t4)*1e3,
                      "memo_us": memo_us, "call_us": call_us, "call_out_us": call_out_us,
                      "source": k.config_source, "tilelang_imported": "tilelang" in sys.modules,
                      "tvm_compiler_loaded": "tvm" in sys.modules,
                      "tvm_ffi_imported": "tvm_ffi" in sys.modules}))
    """
)


BREAKDOWN = textwrap.dedent(
    """
    import json, sys, time
    import torch
    torch.empty(1, device="cuda"); torch.cuda.synchronize()
    T = time.perf_counter
    steps = {}
    t = T(); import tkjit; from tkjit import build, registry, tuning_db, arch as A, loader
    steps["import tkjit"] = T() - t
    name, shape, arch = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] or None
    t = T(); spec = registry.get_spec(name); steps["get_spec (import spec module)"] = T() - t
    t = T(); full = spec.canonical_shape(shape); a = A.resolve_arch(None); steps["shape + arch"] = T() - t
    t = T(); cfg, src = tuning_db.choose_config(spec, full, a, None); steps["choose_config (tuning DB)"] = T() - t
    t = T(); key, _ = build.entry_key(spec, spec.static_shape(full), cfg, a); steps["cache key"] = T() - t
    t = T(); e, _ = build.ensure_entry(spec, spec.static_shape(full), cfg, a); steps["verify entry"] = T() - t
    t = T(); from tkjit import ffi; ffi.lib(); steps["libtvm_ffi.so (C ABI, no tvm_ffi import)"] = T() - t
    t = T(); ffi.load_runtime(loader._tilelang_lib_dir); steps["libtvm_runtime.so"] = T() - t
    if e.meta["abi"].get("tilelang_runtime"):
        t = T(); loader._load_tilelang_runtime(); steps["libtilelang.so (TMA kernels)"] = T() - t
    t = T(); fn = loader.load(e.file(e.meta["lib"]), e.meta); steps["load module"] = T() - t
    x = spec.make_inputs(full, device="cuda")
    outs = [torch.empty(d, dtype=getattr(torch, dt), device="cuda") for _, dt, d in spec.output_decls(full)]
    torch.cuda.synchronize()
    t = T(); fn(*x, *outs); torch.cuda.synchronize(); steps["first launch + sync"] = T() - t
    t = T(); fn(*x, *outs); torch.cuda.synchronize(); steps["second launch + sync"] = T() - t
    t = T(); import tvm_ffi; steps["(for scale, not on the path: import tvm_ffi)"] = T() - t
    print(json.dumps({k: v * 1e3 for k, v in steps.items()}))
    """
)


TILE_KERNELS = textwrap.dedent(
    """
    import json, time
    import torch
    torch.empty(1, device="cuda"); torch.cuda.synchronize()
    scores = torch.randn(1, 256, device="cuda"); torch.cuda.synchronize()
    t0 = time.perf_counter()
    from tile_kernels.moe import topk_gate
    t1 = time.perf_counter()
    topk_gate(scores, 8); torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(json.dumps({"import_ms": (t1 - t0) * 1e3, "first_call_ms": (t2 - t1) * 1e3, "total_ms": (t2 - t0) * 1e3}))
    """
)

TARGET_MS = 20.0  # import tkjit + get from disk + first launch, in a fresh process after CUDA init
DEFAULT_SHAPE = {"num_tokens": 1, "num_experts": 256, "k": 8}  # topk_gate at decode: one token


def compile_bytecode() -> None:
    """Write the __pycache__ of tkjit and tkjit_kernels (an installed package has it from pip)."""
    import compileall
    import importlib.util

    for pkg in ("tkjit", "tkjit_kernels"):
        spec = importlib.util.find_spec(pkg)
        for path in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(path, quiet=1)


def import_profile(top: int = 10) -> list[tuple[str, float, float]]:
    """`import tkjit` in a fresh process after `import torch`, under -X importtime: the `top` modules it
    imported by cumulative time, as (module, self ms, cumulative ms)."""
    code = "import torch, sys; sys.stderr.write('--- tkjit\\n'); import tkjit"
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True).stderr
    rows = []
    for line in err.split("--- tkjit\n", 1)[-1].splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            rows.append((parts[2].strip(), int(parts[0]) / 1e3, int(parts[1]) / 1e3))
    return sorted(rows, key=lambda r: -r[2])[:top]


def run_child(cmd: list[str]) -> str:
    """Run one fresh process; its stdout, or SystemExit with the last lines of its stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        raise SystemExit(f"coldstart: the fresh process failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="topk_gate")
    add_shape_arg(ap, help="the kernel's shape (default, for topk_gate: --shape num_tokens=1 num_experts=256 k=8)")
    ap.add_argument("--arch", default="", help="e.g. cpu (default: the GPU's)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--breakdown", action="store_true", help="also time each step of one fresh get")
    args = ap.parse_args()
    shape = parse_shape(args.shape) if args.shape else DEFAULT_SHAPE
    child = [sys.executable, "-c", CHILD, args.kernel, json.dumps(shape), args.arch]
    compile_bytecode()
    run_child(child)  # warm the cache (compiles if cold)
    runs = []
    for i in range(args.runs):
        out = run_child(child)
        runs.append(json.loads(out.strip().splitlines()[-1]))
        # each run as it ends: a caller's time limit that stops this tool still leaves the runs so far
        print(f"run {i + 1}: {json.dumps(runs[-1])}", flush=True)
    keys = ["ctx_ms", "import_ms", "get_ms", "launch_ms", "tkjit_total_ms", "memo_us", "call_us", "call_out_us"]
    print(f"{args.kernel} {shape}: {args.runs} fresh processes (median), config from {runs[0]['source']}, "
          f"CUDA launcher {envs.launcher()} (TKJIT_LAUNCHER)")
    for k in keys:
        print(f"  {k:15s} {statistics.median(r[k] for r in runs):8.2f}")
    print(f"  tilelang imported: {any(r['tilelang_imported'] for r in runs)}; "
          f"tvm compiler loaded: {any(r['tvm_compiler_loaded'] for r in runs)}; "
          f"tvm_ffi package imported: {any(r['tvm_ffi_imported'] for r in runs)}")
    total = statistics.median(r["tkjit_total_ms"] for r in runs)
    print(f"  target import + get + first launch <= {TARGET_MS} ms: {'met' if total <= TARGET_MS else 'NOT met'}")
    print(json.dumps(runs))
    if args.arch != "cpu":
        try:
            tk = [json.loads(subprocess.run([sys.executable, "-c", TILE_KERNELS], check=True, capture_output=True,
                                            text=True).stdout.strip().splitlines()[-1]) for _ in range(args.runs)]
        except (subprocess.CalledProcessError, IndexError, ValueError) as e:
            print(f"TileKernels fresh process skipped (not installed or failed): {type(e).__name__}")
        else:
            print(f"TileKernels topk_gate, {args.runs} fresh processes (median, after CUDA init):")
            for k in ("import_ms", "first_call_ms", "total_ms"):
                print(f"  {k:15s} {statistics.median(r[k] for r in tk):8.2f}")
    if args.breakdown:
        print("import tkjit after import torch, -X importtime (ms; the slowest by cumulative time):")
        for mod, self_ms, cum_ms in import_profile():
            print(f"  {mod:36s} self {self_ms:7.2f}  cumulative {cum_ms:7.2f}")
    if args.breakdown and args.arch != "cpu":  # the breakdown times the CUDA steps
        out = run_child([sys.executable, "-c", BREAKDOWN, args.kernel, json.dumps(shape), args.arch])
        print("breakdown of one fresh process (ms):")
        for k, v in json.loads(out.strip().splitlines()[-1]).items():
            print(f"  {k:36s} {v:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
