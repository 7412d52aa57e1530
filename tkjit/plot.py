"""Charts of a benchmark run and of a tuning study, as PNG files.

    tkjit plot bench benchmarks/h200/2026-12-02_bench_tuned.json -o bench.png
    tkjit plot study sinkhorn_fwd --shape num_tokens=65536 n=4 --arch sm_90a -o study.png

The bench chart draws, per kernel and shape, every implementation's bandwidth as a percentage of the copy
ceiling measured in the same run (a roofline for memory-bound kernels: 100% is a copy of the bytes the
kernel must move), on a log scale when the bars span more than a decade. The study chart draws each
measured config's time in trial order and the best so far.

Drawing needs matplotlib (`pip install 'tkjit[plot]'`), imported only when a chart is drawn; reading the
data (`load_bench`, `bench_groups`, `study_trials`) does not. Charts are drawn on a bare `Figure` (no
pyplot), so an interactive session's backend and open figures are left alone.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tkjit.errors import TkjitError, brief

# Bar order and colours: tkjit first, then the references, slowest last.
IMPLS = ("tkjit default", "tkjit tuned", "TileKernels", "torch.compile", "torch eager")
COLORS = {"tkjit default": "#9ecae1", "tkjit tuned": "#08519c", "TileKernels": "#fd8d3c",
          "torch.compile": "#74c476", "torch eager": "#bdbdbd"}
INSTALL_HINT = "pip install 'tkjit[plot]'"


def _figure(width: float, height: float):
    """A matplotlib Figure; a TkjitError naming the install command when matplotlib is absent."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise TkjitError(f"drawing charts needs matplotlib ({e}): {INSTALL_HINT}") from None
    return Figure(figsize=(width, height), layout="constrained")


def require_matplotlib() -> None:
    """Raise the install hint now when matplotlib is absent (a tool checks before a long run)."""
    _figure(1, 1)


def _save(fig, out: str | os.PathLike) -> Path:
    path = Path(out)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise TkjitError(f"chart file {str(path)!r}: the name must end in .png, .svg or .pdf")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


# ----------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------
@dataclass
class BenchGroup:
    """One kernel at one shape: the copy floor and each implementation's median time (µs)."""

    kernel: str
    shape: str
    floor_us: float
    us: dict[str, float] = field(default_factory=dict)  # impl (IMPLS) -> µs
    tuned_source: str = ""  # "tkjit tuned:shipped" ...: the row's own label

    def pct(self, impl: str) -> float:
        """Bandwidth as % of the copy ceiling: the copy floor's time over this time."""
        return 100.0 * self.floor_us / self.us[impl]


def load_bench(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON file written by `tools/bench.py --json`: {"meta": {...}, "rows": [...]}."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise TkjitError(f"{path}: not a bench JSON file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise TkjitError(f"{path}: not a bench JSON file (no \"rows\" list; tools/bench.py --json writes one)")
    return doc


def _impl(name: str) -> str | None:
    if name.startswith("tkjit ") and name != "tkjit default":
        return "tkjit tuned"  # "tkjit tuned:shipped", "tkjit tuned:user", "tkjit tuned:nearest(...)"
    return name if name in IMPLS else None


def bench_groups(doc: Mapping[str, Any]) -> list[BenchGroup]:
    """The rows grouped per (kernel, shape), in the file's order; rows without a time (failed) are left out."""
    groups: dict[tuple[str, str], BenchGroup] = {}
    for i, r in enumerate(doc.get("rows", [])):
        if not isinstance(r, Mapping):
            raise TkjitError(f"bench row {i} is not an object: {brief(r)}")
        try:
            k = (str(r["kernel"]), str(r["shape"]))
            impl, us = str(r["impl"]), r["us"]
        except KeyError as e:
            raise TkjitError(f"bench row {i} has no {e}: {brief(r)}") from None
        if impl == "copy floor" and _positive(us):
            groups.setdefault(k, BenchGroup(*k, floor_us=float(us))).floor_us = float(us)
            continue
        name = _impl(impl)
        if name is None or not _positive(us):
            continue
        g = groups.setdefault(k, BenchGroup(*k, floor_us=math.nan))
        g.us[name] = float(us)
        if name == "tkjit tuned":
            g.tuned_source = impl
    return [g for g in groups.values() if g.us and g.floor_us == g.floor_us]  # a group needs its floor


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _shape_label(kernel: str, shape: str) -> str:
    short = shape.replace("num_tokens=", "tokens=").replace("num_experts=", "experts=").replace("dtype=", "")
    return kernel + "\n" + "\n".join(textwrap.wrap(short.replace(",", ", "), 15, break_long_words=False))


def bench_chart(doc: Mapping[str, Any], out: str | os.PathLike, *, title: str | None = None) -> Path:
    """Draw the bench chart of `doc` (see `load_bench`) into `out` (.png, .svg or .pdf); the path written."""
    groups = bench_groups(doc)
    if not groups:
        raise TkjitError("the bench file has no timed rows with a copy floor: nothing to draw")
    meta = doc.get("meta", {}) if isinstance(doc.get("meta"), Mapping) else {}
    impls = [i for i in IMPLS if any(i in g.us for g in groups)]
    fig = _figure(max(8.0, 1.2 * len(groups) + 2.5), 6.4)
    ax = fig.subplots()
    width = 0.8 / len(impls)
    pcts = [g.pct(i) for g in groups for i in g.us]
    for j, impl in enumerate(impls):
        xs = [x + (j - (len(impls) - 1) / 2) * width for x, g in enumerate(groups) if impl in g.us]
        ys = [g.pct(impl) for g in groups if impl in g.us]
        name = "tkjit tuned (none: default kept)" if impl == "tkjit tuned" else impl
        bars = ax.bar(xs, ys, width * 0.95, label=name, color=COLORS[impl], edgecolor="#333333", linewidth=0.4)
        # Each bar says its time: the percentage is the comparison, the µs is what a user measures.
        for b, g in zip(bars, [g for g in groups if impl in g.us]):
            ax.annotate(_us(g.us[impl]), (b.get_x() + b.get_width() / 2, b.get_height()), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", rotation=90, fontsize=6.5)
    ceiling = meta.get("copy_ceiling_gbs")
    label = "copy ceiling" + (f" ({ceiling:.0f} GB/s)" if _positive(ceiling) else "")
    ax.axhline(100.0, color="#cb181d", linestyle="--", linewidth=1.2, label=label)
    lo, hi = min(pcts), max(max(pcts), 100.0)
    if hi / lo > 10:  # eager torch sits two decades below a tuned kernel: a linear axis hides the rest
        ax.set_yscale("log")
        ax.set_ylim(10 ** math.floor(math.log10(lo)) / 1.5, hi * 4)
    else:
        ax.set_ylim(0, hi * 1.25)
    ax.set_ylabel("% of the copy ceiling (higher is better)")
    ax.set_xticks(range(len(groups)), [_shape_label(g.kernel, g.shape) for g in groups], fontsize=7.5)
    ax.grid(axis="y", which="major", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=len(impls) + 1, fontsize=8.5,
               frameon=False)
    gpu = f" on {meta['gpu']}" if meta.get("gpu") else ""
    head = title or f"Bandwidth as % of the copy ceiling{gpu} (over each bar: median time)"
    sub = ", ".join(f"{k} {meta[k]}" for k in ("date", "tkjit", "tilelang", "torch") if meta.get(k))
    ax.set_title(head + (f"\n{sub}" if sub else ""), fontsize=9.5)
    return _save(fig, out)


def _us(v: float) -> str:
    return f"{v:.0f} µs" if v >= 100 else f"{v:.1f} µs"


# ----------------------------------------------------------------------------------------------
# studies
# ----------------------------------------------------------------------------------------------
@dataclass
class StudyTrial:
    """One measured config of a study: its time, or the kind of failure."""

    number: int  # the Optuna trial number
    us: float | None  # None: failed (compile, wrong, crash, timeout, error)
    config: dict[str, Any]
    failure: str = ""


def open_journal(storage: str | None = None):
    """The Optuna storage to read studies from: the cache's journal (None), a journal path or URL.

    A journal file that does not exist is an error (it is never created by reading).
    """
    from tkjit.tuning import open_storage

    if storage is None:
        from tkjit.build import cache

        path = cache().base / "tuned" / "journal.log"
        if not path.exists():
            raise TkjitError(f"no tuning journal at {path}: no study has run with this cache "
                             "(tools/pretune.py or tkjit.tuning.tune runs one)")
        storage = f"journal:{path}"
    elif storage.startswith("journal:") or storage.endswith(".log"):
        path = Path(storage.removeprefix("journal:"))
        if not path.exists():
            raise TkjitError(f"no tuning journal at {path}")
    return open_storage(storage)


def _parts(name: str, attrs: Mapping[str, Any] | None = None) -> tuple[str, dict, str, str] | None:
    """(kernel, {"static":..., "bucket":...}, arch, gpu) of a tuner study: from its `identity` user
    attribute, or parsed from an older study's name (the identity itself); None for another study."""
    ident = (attrs or {}).get("identity")
    if isinstance(ident, dict) and all(k in ident for k in ("kernel", "static", "bucket", "arch", "gpu")):
        return ident["kernel"], {"static": ident["static"], "bucket": ident["bucket"]}, ident["arch"], ident["gpu"]
    head, sep, rest = name.partition("|")
    body, _, tail = rest.rpartition("|")
    body, _, arch = body.rpartition("|")
    if not sep or not body:
        return None
    try:
        shape = json.loads(body)
    except ValueError:
        return None
    if not isinstance(shape, dict):
        return None
    return head.partition("@")[0], shape, arch, tail


def study_title(name: str) -> str:
    """`sinkhorn_fwd n=4 num_tokens~1024 on cpu (gpu)` from a tuner study name."""
    if "|" not in name and " #" in name:
        return name.rpartition(" #")[0]  # today's names are the title and a hash of the identity
    p = _parts(name)
    if p is None:
        return name
    kernel, shape, arch, gpu = p
    static = " ".join(f"{k}={v}" for k, v in shape.get("static", {}).items())
    bucket = " ".join(f"{k}~{v}" for k, v in shape.get("bucket", {}).items())
    return f"{kernel} {' '.join(x for x in (static, bucket) if x)} on {arch} ({gpu})"


def _shape_matches(kernel: str, parts_shape: dict, shape: Mapping[str, Any]) -> bool:
    from tkjit.registry import get_spec
    from tkjit.tuning import tuning_shape

    try:
        _, static, bucket = tuning_shape(get_spec(kernel), shape)
        return parts_shape.get("static") == static and parts_shape.get("bucket") == bucket
    except TkjitError:
        # A partial shape: every given param equals the study's (runtime ones as their bucket).
        have = {**parts_shape.get("static", {}), **parts_shape.get("bucket", {})}
        return all(k in have and have[k] == v for k, v in shape.items())


def pick_study(storage: Any, *, kernel: str | None = None, shape: Mapping[str, Any] | None = None,
               arch: str | None = None) -> str:
    """The one study matching kernel/shape/arch. Several runs of one study key (a changed spec source,
    another GPU) resolve to the most recently updated; several different studies are an error listing them."""
    import optuna

    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    names = [s.study_name for s in summaries]
    parts = {s.study_name: _parts(s.study_name, s.user_attrs) for s in summaries}
    found = []
    for n in names:
        p = parts[n]
        if p is None:
            continue
        if kernel and p[0] != kernel or arch and p[2] != arch:
            continue
        if shape and not _shape_matches(p[0], p[1], shape):
            continue
        found.append(n)
    want = " ".join(x for x in (kernel or "", " ".join(f"{k}={v}" for k, v in (shape or {}).items()),
                                f"--arch {arch}" if arch else "") if x) or "any"
    if not found:
        there = "; ".join(study_title(n) for n in names[:10]) or "none"
        raise TkjitError(f"no tuning study matches {want}; studies there: {there}")
    keys = {(p[0], json.dumps(p[1], sort_keys=True), p[2]) for p in (parts[n] for n in found) if p}
    if len(keys) > 1:
        listed = "; ".join(sorted({study_title(n) for n in found})[:10])
        raise TkjitError(f"{len(found)} tuning studies match {want}: {listed}; name the kernel and give --shape "
                         "(and --arch) to pick one")
    return max(found, key=lambda n: _last_update(storage, n))


def _last_update(storage: Any, name: str) -> float:
    import optuna

    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    times = [t.datetime_complete or t.datetime_start for t in trials]
    return max((t.timestamp() for t in times if t is not None), default=0.0)


def study_trials(storage: Any, name: str) -> list[StudyTrial]:
    """The measured configs of a study in trial order: timed ones and failed ones.

    Left out: configs the constraints pruned before compiling, repeats of a measured config and trials
    still running (none of them was measured).
    """
    import optuna
    from optuna.trial import TrialState

    out = []
    for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False):
        cfg = t.user_attrs.get("config")
        try:
            config = json.loads(cfg) if isinstance(cfg, str) else dict(t.params)
        except ValueError:
            config = dict(t.params)
        if t.state == TrialState.COMPLETE and t.value is not None:
            out.append(StudyTrial(t.number, float(t.value), config))
        elif t.state == TrialState.FAIL and t.user_attrs.get("kind") not in (None, "dup", "stale"):
            out.append(StudyTrial(t.number, None, config, str(t.user_attrs.get("kind"))))
    return sorted(out, key=lambda t: t.number)


def best_so_far(trials: Sequence[StudyTrial]) -> list[float | None]:
    """The fastest time among the trials up to each one (None until one has timed)."""
    best, out = math.inf, []
    for t in trials:
        if t.us is not None:
            best = min(best, t.us)
        out.append(best if best < math.inf else None)
    return out


def study_chart(trials: Sequence[StudyTrial], out: str | os.PathLike, *, title: str = "") -> Path:
    """Time per trial (the first is the heuristic default) and the best so far, into `out`."""
    timed = [(i, t) for i, t in enumerate(trials, 1) if t.us is not None]
    if not timed:
        raise TkjitError(f"the study {title or ''} has no timed trial: nothing to draw".replace("  ", " "))
    fig = _figure(9.0, 5.0)
    ax = fig.subplots()
    xs, ys = [i for i, _ in timed], [t.us for _, t in timed]
    ax.scatter(xs, ys, s=18, color="#6baed6", edgecolor="#08519c", linewidth=0.5, label="measured config",
               zorder=3)
    curve = best_so_far(trials)
    steps = [(i, b) for i, b in enumerate(curve, 1) if b is not None]
    ax.step([i for i, _ in steps], [b for _, b in steps], where="post", color="#cb181d", linewidth=1.6,
            label="best so far", zorder=4)
    first = trials[0]
    if first.us is not None:  # the tuner measures the heuristic default first
        ax.axhline(first.us, color="#636363", linestyle=":", linewidth=1.0,
                   label=f"trial 1 (default): {_us(first.us)}")
    fails = [i for i, t in enumerate(trials, 1) if t.us is None]
    if fails:
        ax.scatter(fails, [max(ys)] * len(fails), marker="x", color="#e6550d", s=22, zorder=3,
                   label=f"failed ({len(fails)}: compile, wrong or crash)")
    if max(ys) / min(ys) > 10:
        from matplotlib.ticker import LogFormatter

        ax.set_yscale("log")
        fmt = LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 1))  # 30, 40, 60 µs: not 3x10^1
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt)
    best_i, best = min(timed, key=lambda p: p[1].us)
    ax.scatter([best_i], [best.us], s=60, facecolor="none", edgecolor="#cb181d", linewidth=1.4, zorder=5,
               label=f"best: {_us(best.us)} (trial {best_i})")
    ax.set_xlabel("measured config (trial order)")
    ax.set_ylabel("median time (µs, lower is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    cfg = textwrap.fill("best config: " + ", ".join(f"{k}={v}" for k, v in best.config.items()), 110)
    counts = f"{len(trials)} configs measured, {len(fails)} failed"
    ax.set_title("\n".join(x for x in (title, counts, cfg) if x), fontsize=9)
    return _save(fig, out)
