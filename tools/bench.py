#!/usr/bin/env python3
"""Benchmark every kernel: tkjit (default and tuned) vs TileKernels vs torch eager vs torch.compile.

    python tools/bench.py [--kernels sinkhorn_fwd ...] [--shape k=v ...] [--json out.json] [--plot out.png]
    python tools/bench.py --from-json benchmarks/h200/2026-12-02_bench_tuned.json --plot out.png   # no GPU

--plot draws each implementation's bandwidth against the copy ceiling (`tkjit plot bench`; needs
`pip install 'tkjit[plot]'`). --shape (one kernel) replaces the kernel's shapes from tools/baselines.py.

Median of CUDA-event timings, L2 flushed before each run, fresh random inputs, warm-up excluded;
the copy ceiling is measured in the same run. Prints one table and writes JSON.

--isolate runs each kernel in a process of its own (each under --kernel-timeout seconds): a kernel that
faults (an illegal address poisons the CUDA context) or hangs then costs its own rows only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from baselines import SHAPES, TILE_KERNELS, TORCH  # noqa: E402

import tkjit  # noqa: E402
from tkjit import key as tkkey  # noqa: E402
from tkjit.timing import copy_ceiling_gbs, median, rel_spread, time_cuda  # noqa: E402


def _row(kernel, shape, impl, us, sp, nbytes, ceiling, note=""):
    gbs = nbytes / (us * 1e-6) / 1e9 if us else None
    return {
        "kernel": kernel, "shape": shape, "impl": impl, "us": us, "spread": sp,
        "gbs": gbs, "pct_ceiling": 100 * gbs / ceiling if gbs else None, "note": note,
    }


def _said(e: Exception) -> str:
    """An error in one line: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def implementations(name: str, full: dict, inputs: tuple, with_torch: bool = True,
                    with_compile: bool = False) -> list[tuple[str, Callable[[], object], str]]:
    """(impl, call, note) of one kernel at one canonical shape on these inputs: tkjit's default config, the config
    `get` serves where it differs, TileKernels' kernel where it takes the shape, then (with_torch) torch eager and
    (with_compile) torch.compile of the reference. Building them compiles tkjit's variants; TileKernels compiles its
    kernels on their first call."""
    spec = tkjit.get_spec(name)
    impls = []
    default_cfg = spec.default_config(full, "sm_90a")
    kd = tkjit.get(name, full, config=default_cfg)
    kw = {r: full[r] for r in kd.caller_sized}  # outputs no input sizes (get_fused_mapping's maps)
    impls.append(("tkjit default", lambda kd=kd, inputs=inputs, kw=kw: kd(*inputs, **kw), str(default_cfg)))
    kt = tkjit.get(name, full)
    if kt.config_source != "default" and kt.config != default_cfg:
        impls.append((f"tkjit {kt.config_source}", lambda kt=kt, inputs=inputs, kw=kw: kt(*inputs, **kw),
                      str(kt.config)))
    tk = TILE_KERNELS.get(name)
    f = tk(full, inputs) if tk else None
    if f is not None:
        impls.append(("TileKernels", f, "shipped config"))
    tf = TORCH.get(name) if with_torch else None
    if tf is not None:
        eager = tf(full)
        impls.append(("torch eager", lambda f=eager, inputs=inputs: f(*inputs), ""))
        if with_compile:
            compiled = torch.compile(eager, dynamic=False)
            impls.append(("torch.compile", lambda f=compiled, inputs=inputs: f(*inputs), ""))
    return impls


def bench_kernel(name: str, shapes, reps: int, ceiling: float, with_compile: bool) -> list[dict]:
    spec = tkjit.get_spec(name)
    rows = []
    for shape in shapes:
        full = spec.canonical_shape(shape)
        nbytes = spec.bytes_moved(full)
        inputs = spec.make_inputs(full, device="cuda", seed=1)
        label = ",".join(f"{k}={v}" for k, v in shape.items())
        floor_us = nbytes / (ceiling * 1e9) * 1e6
        rows.append(_row(name, label, "copy floor", floor_us, 0.0, nbytes, ceiling))
        for impl, fn, note in implementations(name, full, inputs, with_compile=with_compile):
            try:
                ts = time_cuda(fn, reps=reps)
                rows.append(_row(name, label, impl, median(ts), rel_spread(ts), nbytes, ceiling, note))
            except Exception as e:  # one broken baseline must not lose the table
                rows.append(_row(name, label, impl, None, None, nbytes, ceiling, f"failed: {type(e).__name__}: {e}"))
                # said now too: a CUDA fault makes the next shape raise, and this kernel's rows are then lost
                print(f"{name} {label} {impl}: {_said(e)}", file=sys.stderr)
    return rows


def bench_isolated(names: list[str], args: argparse.Namespace, ceiling: float) -> list[dict]:
    """Each kernel's rows from a child process of this tool (same options, the parent's copy ceiling)."""
    rows: list[dict] = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--kernels", name, "--json", out, "--reps",
                   str(args.reps), "--ceiling", str(ceiling), *(["--no-compile"] if args.no_compile else []),
                   *(["--shape", *args.shape] if args.shape else [])]
            try:
                done = subprocess.run(cmd, timeout=args.kernel_timeout, capture_output=True, text=True)
                last = (done.stderr.strip().splitlines() or [""])[-1]  # (a traceback's last line: the error)
                why = None if os.path.exists(out) else f"exit {done.returncode}: {last}"
            except subprocess.TimeoutExpired:
                why = f"timed out after {args.kernel_timeout} s"
            if why is None:
                with open(out) as f:
                    got = json.load(f)["rows"]
            else:
                got = [_row(name, "-", "-", None, None, 0, ceiling, f"failed: {why}")]
                print(f"{name}: {why}", file=sys.stderr)
        print_table(got)  # as each kernel ends: a run stopped from outside keeps what it measured in its log
        sys.stdout.flush()
        rows += got
    return rows


def print_table(rows: list[dict]) -> None:
    header = ["kernel", "shape", "impl", "us", "GB/s", "% ceiling", "spread", "note"]
    body = [
        [r["kernel"], r["shape"], r["impl"], f"{r['us']:.1f}" if r["us"] else "-",
         f"{r['gbs']:.0f}" if r["gbs"] else "-", f"{r['pct_ceiling']:.0f}%" if r["pct_ceiling"] else "-",
         f"{100 * r['spread']:.1f}%" if r["spread"] else "-", r["note"][:70]]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    for line in [header, ["-" * w for w in widths], *body]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())


def main() -> int:
    from tkjit.cli import add_shape_arg, parse_shape

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", nargs="*", default=None)
    add_shape_arg(ap, help="one kernel's shape instead of tools/baselines.py's (e.g. --shape num_tokens=4096 n=4)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, metavar="PNG", help="also draw the chart (needs tkjit[plot])")
    ap.add_argument("--from-json", default=None, metavar="JSON",
                    help="no run: print the table (and --plot the chart) of a JSON this tool wrote")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    ap.add_argument("--isolate", action="store_true", help="each kernel in a process of its own (see above)")
    ap.add_argument("--kernel-timeout", type=float, default=300.0, help="seconds a kernel may take with --isolate")
    ap.add_argument("--ceiling", type=float, default=None, help=argparse.SUPPRESS)  # (--isolate's children)
    args = ap.parse_args()
    if args.from_json:
        from tkjit import plot

        doc = plot.load_bench(args.from_json)
        meta = doc.get("meta", {})
        print(f"# {meta.get('gpu')}  copy ceiling {meta.get('copy_ceiling_gbs')} GB/s  {meta.get('date')}")
        print_table(doc["rows"])
        if args.plot:
            print(f"wrote {plot.bench_chart(doc, args.plot)}")
        return 0
    if args.plot:  # before the run: a missing matplotlib must not cost a whole benchmark
        from tkjit import plot

        plot.require_matplotlib()
    names = args.kernels or [s.name for s in tkjit.all_specs() if s.name in SHAPES]
    shapes = dict(SHAPES)
    if args.shape:
        if len(names) != 1:
            ap.error("--shape takes one kernel: --kernels NAME --shape k=v ...")
        try:
            shapes[names[0]] = [parse_shape(args.shape)]
        except ValueError as e:  # UsageError: said as argparse says its own
            ap.error(str(e))
    ceiling = args.ceiling or copy_ceiling_gbs()
    rows = bench_isolated(names, args, ceiling) if args.isolate else []
    for name in [] if args.isolate else names:
        try:
            rows += bench_kernel(name, shapes[name], args.reps, ceiling, not args.no_compile)
        except Exception as e:  # the table so far is kept; a CUDA fault poisons the context: stop there
            rows.append(_row(name, "-", "-", None, None, 0, ceiling, f"failed: {type(e).__name__}: {e}"))
            print(f"{name}: {_said(e)}", file=sys.stderr)
            if isinstance(e, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(e):
                print("CUDA context lost: the kernels after this one are not measured", file=sys.stderr)
                break
    meta = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
        "copy_ceiling_gbs": round(ceiling, 1), "torch": torch.__version__, "tkjit": tkjit.__version__,
        "tilelang": tkkey.tilelang_version(), "nvcc": tkkey.nvcc_version(),
    }
    print(f"# {meta['gpu']}  copy ceiling {ceiling:.0f} GB/s  {meta['date']}  tilelang {meta['tilelang']}  "
          f"torch {meta['torch']}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.plot:
        from tkjit import plot

        print(f"wrote {plot.bench_chart({'meta': meta, 'rows': rows}, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
