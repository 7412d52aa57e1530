"""Tune many studies in one process: a manifest (or one kernel and shape), the tuned DB, a warm cache.

    from tkjit.tuning.pretune import load_manifest, run_studies
    report = run_studies(load_manifest("manifest.toml"), PretuneOptions(arch="cpu", max_configs=4))

`tkjit tune` and tools/pretune.py are its command lines. One study per (kernel, static shape,
runtime bucket, arch, GPU, versions). Trials are stored as they finish (the cache's journal, or
--storage: a journal file, SQLite, PostgreSQL), so a killed run resumes; several workers (processes,
GPUs, hosts) given one storage share each study. The compile pool and the bench worker live across
all studies.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tkjit.errors import TkjitError

# A manifest is TOML:
#   [defaults]            per-study settings (trials, time_budget); command-line flags override them
#   [[study]]             kernel = "sinkhorn_fwd", shape = { n = 4, num_tokens = [4096, 1048576] }
# A list value expands into one study per element (lists in several params: their product).


def expand(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """[[study]] tables -> one dict per concrete study (list values expanded as a product)."""
    defaults = dict(manifest.get("defaults", {}))
    out = []
    for i, st in enumerate(manifest.get("study", [])):
        if "kernel" not in st:
            raise TkjitError(f"manifest: study {i} has no 'kernel'")
        shape = dict(st.get("shape", {}))
        keys = list(shape)
        lists = [v if isinstance(v, list) else [v] for v in shape.values()]
        for combo in itertools.product(*lists):
            s = {**defaults, **{k: v for k, v in st.items() if k != "shape"}}
            s["shape"] = dict(zip(keys, combo))
            out.append(s)
    return out


def load_manifest(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The studies of a TOML manifest file (see `expand`)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return expand(tomllib.load(f))
    except tomllib.TOMLDecodeError as e:
        raise TkjitError(f"manifest {path}: {e}") from None


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _shape_text(shape: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def summary_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The end-of-run table: default and tuned time per study, speedup, % of the copy ceiling."""
    head = ["kernel", "shape", "default us", "tuned us", "speedup", "% copy", "trials", "s", "note"]
    lines = [head]
    for r in rows:
        if r.get("error"):
            lines.append([r["kernel"], _shape_text(r["shape"]), "-", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        note = "win" if r["won"] else "no win (kept default)"
        if r.get("failed"):
            note += f", {len(r['failed'])} failed"
        lines.append([
            r["kernel"], _shape_text(r["full_shape"]), _fmt(r["default_us"], ".2f"), _fmt(r["tuned_us"], ".2f"),
            _fmt(r["speedup"], ".3f") + ("x" if r["speedup"] else ""), _fmt(r.get("pct_copy"), ".0f"),
            str(r["trials"]), f"{r.get('elapsed_s', 0):.0f}", note,
        ])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    out = []
    for j, row in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


@dataclass
class PretuneOptions:
    """How `run_studies` tunes; a study's own `trials` / `time_budget` apply where these are None."""

    arch: str | None = None  # None: TKJIT_ARCH, else the bench worker's GPU
    trials: int | None = None  # distinct configs measured per study
    time_budget: float | None = None  # seconds per study
    jobs: int | None = None  # parallel compile processes (None: cores)
    storage: str | None = None  # journal:PATH, sqlite:///PATH, postgresql://...; None: the cache's journal
    heartbeat_s: int | None = None  # RDB storages; None: tkjit.tuning.tuner.HEARTBEAT_S
    study_prefix: str = ""
    resume: bool = True
    max_configs: int | None = None
    exhaustive_max: int = 64
    timeout_s: float = 60.0  # before a benchmark counts as hung
    bench_budget_s: float | None = None
    seed: int = 0
    imports: Sequence[str] = ()
    timer: str | None = None
    progress: bool = True
    user_db: bool = True
    update_shipped: bool = False
    log: Any = field(default=None, repr=False)  # where the progress lines go (None: stderr)


@dataclass
class PretuneReport:
    arch: str
    gpu: str
    copy_gbps: float | None
    rows: list[dict[str, Any]]
    entries: list[dict[str, Any]]
    written: list[Path]
    elapsed_s: float
    phases: dict[str, float] = field(default_factory=dict)  # where elapsed_s went (seconds; see run_studies)
    before_s: float | None = None  # a command's seconds before elapsed_s began (interpreter, imports, specs)

    @property
    def search_phases(self) -> dict[str, float]:
        """The studies' search phases (TuneResult.search_phases), summed."""
        total: dict[str, float] = {}
        for row in self.rows:
            for k, v in row.get("search_phases", {}).items():
                total[k] = total.get(k, 0.0) + v
        return total

    @property
    def measured(self) -> int:
        """Configs the studies measured (this run)."""
        return sum(row.get("new_trials", 0) for row in self.rows)

    @property
    def status(self) -> int:
        """0: every study tuned; 2: some failed (a row with `error`)."""
        return 0 if self.entries and len(self.entries) == len(self.rows) else 2

    def to_json(self) -> dict[str, Any]:
        return {"arch": self.arch, "gpu": self.gpu, "copy_gbps": self.copy_gbps, "results": self.rows,
                "written": [str(p) for p in self.written], "elapsed_s": round(self.elapsed_s, 3),
                "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "before_s": None if self.before_s is None else round(self.before_s, 3),
                "search_phases": {k: round(v, 3) for k, v in self.search_phases.items()}, "measured": self.measured}

    def closed(self, close_s: float) -> None:
        """Count the evaluator's closing (a caller's, after run_studies returned) in elapsed_s."""
        self.phases["close"] = self.phases.get("close", 0.0) + close_s
        self.elapsed_s += close_s


def resolve_studies(studies: Sequence[Mapping[str, Any]]) -> list[tuple[dict, Any, dict]]:
    """(study, spec, full shape) of each study whose kernel and shape are valid; others are warned
    about and skipped (a manifest may name kernels still to land)."""
    import tkjit
    from tkjit.errors import ShapeError, UnknownKernelError

    out = []
    for s in studies:
        try:
            spec = tkjit.get_spec(s["kernel"])
            full = spec.canonical_shape(s["shape"])
        except UnknownKernelError:
            warnings.warn(f"pretune: kernel {s['kernel']!r} is not in the catalog; skipped", stacklevel=2)
            continue
        except ShapeError as e:
            warnings.warn(f"pretune: {s['kernel']} shape {s['shape']} invalid ({e}); skipped", stacklevel=2)
            continue
        out.append((dict(s), spec, full))
    return out


def _bar(desc: str, log: Any) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # bars are a nicety: tkjit[tools] brings tqdm
        return None
    return tqdm(total=0, desc=desc, unit="cfg", leave=True, file=log, dynamic_ncols=True)


def _given_arch(opts: PretuneOptions) -> str | None:
    """--arch, else TKJIT_ARCH; None: the bench worker's GPU, which it reports as it starts."""
    from tkjit import envs

    return opts.arch or envs.ARCH.get()


def start_evaluator(opts: PretuneOptions) -> Any:
    """The bench worker, started now without waiting for it: it imports torch and starts CUDA (seconds) while
    the caller reads its specs and opens its storage. For `run_studies`' `evaluator`; the caller closes it
    (at once if the worker has not finished starting: a bad study name costs no wait)."""
    from tkjit.tuning import LocalEvaluator
    from tkjit.tuning.worker import AUTO_ARCH

    ev = LocalEvaluator(_given_arch(opts) or AUTO_ARCH, jobs=opts.jobs, timer=opts.timer, imports=opts.imports,
                        timeout_s=opts.timeout_s, budget_s=opts.bench_budget_s, copy_at_start=True)
    ev.worker.spawn()
    return ev


def run_studies(studies: Sequence[Mapping[str, Any]], opts: PretuneOptions, evaluator: Any = None) -> PretuneReport:
    """Tune every study (one failing does not stop the others), write the tuned DB, warm the cache.
    `evaluator`: one from `start_evaluator` (the caller closes it); None: started and closed here.

    Each winner is merged into the DB files as soon as its study ends: a run cut short (a time limit, a
    killed worker) keeps the studies it finished."""
    import contextlib

    from tkjit.tuning import open_storage, tune
    from tkjit.tuning.tuner import HEARTBEAT_S
    from tkjit.tuning_db import gpu_model, shipped_db_path, user_db_path, write_entries

    log = opts.log or sys.stderr
    import importlib

    t_all = time.perf_counter()
    phases: dict[str, float] = {}  # start (worker, studies, storage), copy ceiling, search, re-time, warm, close
    mark = [t_all]
    for m in opts.imports:
        importlib.import_module(m)
    own = evaluator is None
    if own:
        evaluator = start_evaluator(opts)
    arch = _given_arch(opts)  # None: the bench worker's GPU (below)

    def lap(name: str) -> None:
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - mark[0]
        mark[0] = now
    rows: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = []
    written: dict[Path, None] = {}  # the DB files written, in order
    with evaluator if own else contextlib.nullcontext(evaluator) as ev:
        # While the bench worker starts: the studies' specs, the compile pool, the storage (opened once: an RDB
        # storage is an engine and a connection pool, not a path).
        resolved = resolve_studies(studies)
        if not resolved:
            raise TkjitError("nothing to tune (no study names a known kernel with a valid shape)")
        # Its processes import TileLang while the bench worker finishes starting; not before the studies are
        # read: a bad name or shape must not wait for them (on a 2-core host they also slow the worker's start).
        ev.pool.warm()
        storage = open_storage(opts.storage, heartbeat_s=opts.heartbeat_s or HEARTBEAT_S)
        info = ev.device_info()
        if arch is None:  # the worker's GPU (a separate probe process would start CUDA once more: seconds)
            arch = info.get("arch")
            if not arch:
                raise TkjitError("no CUDA GPU found: pass --arch (e.g. --arch cpu to tune the C target)")
        gpu = gpu_model(arch, info.get("gpu"))
        lap("start")
        copy_gbps = ev.copy_bandwidth_gbps()
        lap("copy")
        # The DB files each winner is merged into as its study ends.
        targets = ([user_db_path(arch, gpu)] if opts.user_db else []) + (
            [shipped_db_path(arch, gpu)] if opts.update_shipped else [])
        print(f"tune: {len(resolved)} {'study' if len(resolved) == 1 else 'studies'}, arch {arch}, {gpu}, "
              f"compile jobs {ev.pool.n_jobs}, copy {_fmt(copy_gbps, '.0f')} GB/s", file=log)
        for s, spec, full in resolved:
            bar = _bar(f"{spec.name} {_shape_text(full)}", log) if opts.progress else None

            def progress(done: int, total: int, best: float | None, bar: Any = bar) -> None:
                if bar is None:
                    return
                bar.total = total
                bar.n = done
                bar.set_postfix_str(f"best {best:.2f}us" if best else "")
                bar.refresh()

            try:
                r = tune(spec, full, arch=arch, gpu=gpu, evaluator=ev, storage=storage,
                         trials=s.get("trials") if opts.trials is None else opts.trials,
                         time_budget=s.get("time_budget") if opts.time_budget is None else opts.time_budget,
                         exhaustive_max=opts.exhaustive_max, seed=opts.seed, resume=opts.resume,
                         max_configs=opts.max_configs, progress=progress, study_prefix=opts.study_prefix)
            except Exception as e:  # one study failing (every config broken?) must not lose the others
                if bar is not None:
                    bar.close()
                print(f"tune: {spec.name} {full}: {type(e).__name__}: {e}", file=log)
                lap("search")
                rows.append({"kernel": spec.name, "shape": full, "error": f"{type(e).__name__}: {e}"})
                continue
            if bar is not None:
                bar.close()
            lap("search")
            phases["search"] -= r.retime_s
            phases["retime"] = phases.get("retime", 0.0) + r.retime_s
            row = r.to_json()
            if copy_gbps and r.tuned_us:
                gbps = spec.bytes_moved(r.full_shape) / (r.tuned_us * 1e-6) / 1e9
                row["gbps"] = gbps
                row["pct_copy"] = 100.0 * gbps / copy_gbps
            rows.append(row)
            entries.append(r.db_entry())
            for path in targets:
                written[write_entries(path, entries[-1:], arch=arch, gpu=gpu)] = None
        # Warm the cache: every served config is published (normally a cache hit from the search).
        warm = [(e["kernel"], e["shape"], e["config"], arch, "tuned:user") for e in entries]
        for _, err in ev.pool.compile(warm):
            if err:
                print(f"tune: warming the cache: {err}", file=log)
        lap("warm")
    if own:  # (the caller's evaluator closes after this returns)
        lap("close")
    return PretuneReport(arch, gpu, copy_gbps, rows, entries, list(written), time.perf_counter() - t_all, phases)


def footer(report: PretuneReport) -> str:
    """The line after the table: studies tuned, time (and before it, a command's start), the DB files written."""
    where = ", ".join(f"{k} {v:.1f}" for k, v in report.phases.items())
    before = "" if report.before_s is None else f", {report.before_s:.1f}s before (Python, imports, specs)"
    search = ""
    if report.search_phases:  # the search's seconds by what the tuner waited on, the rest in "other"
        sp = dict(report.search_phases)
        sp["other"] = max(0.0, report.phases.get("search", 0.0) - sum(sp.values()))
        search = (f"\n  search: {report.measured} configs measured; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sp.items()) + " s")
    return (f"tune: {len(report.entries)}/{len(report.rows)} studies tuned in {report.elapsed_s:.1f}s"
            + (f" ({where})" if where else "") + before + f"; copy ceiling {_fmt(report.copy_gbps, '.0f')} GB/s"
            + search
            + "".join(f"\n  wrote {p}" for p in report.written))


# ----------------------------------------------------------------------------------------------
# several workers on one host: one process per GPU
# ----------------------------------------------------------------------------------------------
def visible_devices() -> list[str]:
    """The GPUs a worker may take: CUDA_VISIBLE_DEVICES's entries, else those the driver lists
    (asked of a child process: this one never initialises CUDA)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        n = int(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        n = 0
    return [str(i) for i in range(n)]


def select_device(index: int) -> str:
    """Make GPU `index` (of the visible ones) the only one this process's children see; its id."""
    devices = visible_devices() if os.environ.get("CUDA_VISIBLE_DEVICES") is not None else None
    if devices is not None:
        if not 0 <= index < len(devices):
            raise TkjitError(f"--device {index}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} "
                             f"holds {len(devices)} devices")
        dev = devices[index]
    else:
        dev = str(index)
    os.environ["CUDA_VISIBLE_DEVICES"] = dev  # the bench worker and the arch probe inherit it
    return dev
