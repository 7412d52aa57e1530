"""Winners between hosts: export them from a study storage, merge winner files into a tuned DB.

    tkjit db export --storage postgresql://tkjit@db/tuning > winners.json     # on any host
    tkjit db merge winners-*.json                    # into the user DB (<cache>/v1/tuned), or
    tkjit db merge winners-*.json --into tkjit/tuning_db_data                  # the shipped one

A winner file is a tuned-DB document ({"schema": 1, "entries": [...]}, see tkjit.tuning_db) whose
entries carry their "arch"; a DB file (<arch>/<GPU>.json, arch at the top) is a winner file too. Files
are read by `load_db`, so they get the DB's checks (regular file, size cap, strict JSON, every entry
validated; one bad entry refuses the whole file).

Merging keeps, per (arch, GPU, kernel, static shape, bucket), the entry measured from more trials,
then the one with lower noise (spread), then the newer. Entries tuned with another tkjit or TileLang
version, or another source of their spec, are refused (their timings and configs may not hold here)
unless `allow_other_versions`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tkjit.canon import canonical_json
from tkjit.errors import TkjitError, TuningDBError, UnknownKernelError
from tkjit.tuning_db import SCHEMA, db_path, load_db, validate_doc, validate_entry, write_entries


def export_winners(storage: Any, kernel: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """(winner document, notes) of every finished study in an Optuna storage (or `open_storage` URL).

    A study's winner is what its tuner chose after re-timing the finalists (its `winner` user attribute);
    a study without one (unfinished, or tuned by an older tkjit) is named in the notes.
    """
    import optuna

    from tkjit.tuning.tuner import open_storage

    store = open_storage(storage, heartbeat_s=None)  # reading: no trials of ours run
    entries: list[dict[str, Any]] = []
    notes: list[str] = []
    for s in optuna.get_all_study_summaries(store, include_best_trial=False):
        ident = s.user_attrs.get("identity")
        if not isinstance(ident, dict):
            continue  # not a tkjit study (or one from before identities were recorded)
        if kernel is not None and ident.get("kernel") != kernel:
            continue
        win = s.user_attrs.get("winner")
        if not isinstance(win, dict):
            notes.append(f"{s.study_name}: no winner yet (unfinished)")
            continue
        e = {**win, "arch": ident["arch"]}
        try:
            validate_entry(e, Path(f"study {s.study_name}"), 0)
        except TuningDBError as err:
            notes.append(f"{s.study_name}: winner not exported: {err}")
            continue
        entries.append(e)
    entries.sort(key=lambda e: (e["arch"], e["gpu"], e["kernel"], canonical_json(e["shape"]),
                                sorted(e["bucket"].items())))
    doc = {"schema": SCHEMA, "entries": entries}
    validate_doc(doc, Path("export"))  # one entry per key: a storage holds one study per key and prefix
    return doc, notes


def current_versions() -> dict[str, str]:
    from tkjit.key import tilelang_version
    from tkjit.version import __version__

    return {"tkjit": __version__, "tilelang": tilelang_version()}


def version_problem(e: Mapping[str, Any], here: Mapping[str, str] | None = None) -> str | None:
    """Why an entry was tuned under other versions than this install's (None: the same)."""
    from tkjit.registry import get_spec

    here = here or current_versions()
    theirs = e.get("versions", {})
    for k in ("tkjit", "tilelang"):
        if theirs.get(k) != here[k]:
            return f"{k} {theirs.get(k)} (here {here[k]})"
    try:
        spec = get_spec(e["kernel"])
    except UnknownKernelError:
        return "its kernel is not in this catalog"
    if e.get("spec_source") and e["spec_source"] != spec.source_hash:
        return f"spec source {e['spec_source'][:12]} (here {spec.source_hash[:12]})"
    return None


@dataclass
class Change:
    action: str  # added, replaced, kept, unchanged, refused
    entry: dict[str, Any]
    path: Path | None
    why: str = ""

    def line(self) -> str:
        e = self.entry
        what = (f"{e['kernel']} {_kv(e['shape'])} {_kv(e['bucket'], '~')} on {e.get('arch', '?')} ({e['gpu']}): "
                f"{_kv(e['config'])}")
        return f"{self.action:9} {what}" + (f"  [{self.why}]" if self.why else "") + \
            (f" -> {self.path}" if self.path and self.action in ("added", "replaced") else "")


def _kv(d: Mapping[str, Any], sep: str = "=") -> str:
    return ",".join(f"{k}{sep}{v}" for k, v in d.items())


def _rank(e: Mapping[str, Any]) -> tuple:
    # More trials saw more of the space; then less noise; then the newer measurement.
    return (int(e.get("trials") or 0), -float(e.get("spread") or 0.0), str(e.get("date", "")))


def _key(e: Mapping[str, Any]) -> tuple:
    return (e["kernel"], canonical_json(e["shape"]), canonical_json(e["bucket"]))


def _strip(e: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k != "arch"}  # a DB file holds one arch: it says it at the top


def read_winners(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """The entries of winner files (each with its "arch"); a bad file raises TuningDBError naming it."""
    out = []
    for p in paths:
        db = load_db(Path(p))
        top = db.doc.get("arch")
        for i, e in enumerate(db.doc["entries"]):
            arch = e.get("arch", top)
            if not isinstance(arch, str):
                raise TuningDBError(f"tuning DB {p}: entry {i} ({e['kernel']}): no arch (in the entry or the file)")
            out.append({**e, "arch": arch})
    return out


def merge_winners(paths: Sequence[str | Path], into: str | Path, *, allow_other_versions: bool = False,
                  dry_run: bool = False) -> list[Change]:
    """Merge winner files into <into>/<arch>/<GPU>.json (see the module doc); what happened per entry."""
    from tkjit.arch import check_arch

    incoming = read_winners(paths)
    here = current_versions()
    changes: list[Change] = []
    best: dict[tuple, dict[str, Any]] = {}  # (arch, gpu, key) -> the best incoming entry
    for e in incoming:
        try:
            check_arch(e["arch"])
        except TkjitError as err:
            changes.append(Change("refused", e, None, str(err)))
            continue
        why = version_problem(e, here)
        if why and not allow_other_versions:
            changes.append(Change("refused", e, None, f"tuned with {why}; --allow-other-versions takes it"))
            continue
        k = (e["arch"], e["gpu"], *_key(e))
        if k not in best or _rank(e) > _rank(best[k]):
            best[k] = e
    by_file: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (arch, gpu, *_), e in best.items():
        by_file.setdefault((arch, gpu), []).append(e)
    for (arch, gpu), entries in sorted(by_file.items()):
        path = db_path(Path(into), arch, gpu)
        existing: dict[tuple, dict] = {}
        if path.exists():
            existing = {_key(x): x for x in load_db(path).doc["entries"]}  # a bad target file: refused, raised
        take = []
        for e in entries:
            old = existing.get(_key(e))
            new = _strip(e)
            if old is None:
                changes.append(Change("added", e, path, f"{e.get('trials', '?')} trials"))
                take.append(new)
            elif canonical_json(old) == canonical_json(new):
                changes.append(Change("unchanged", e, path))
            elif _rank(new) > _rank(old) or (version_problem(old, here) and not version_problem(new, here)):
                changes.append(Change("replaced", e, path, _versus(new, old)))
                take.append(new)
            else:
                changes.append(Change("kept", {**old, "arch": arch}, path, "existing " + _versus(old, new)))
        if take and not dry_run:
            write_entries(path, take, arch=arch, gpu=gpu)
    return changes


def _versus(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    return (f"{a.get('trials', '?')} trials, spread {a.get('spread')} vs {b.get('trials', '?')} trials, "
            f"spread {b.get('spread')}; was {_kv(b['config'])}")


def dumps(doc: Mapping[str, Any]) -> str:
    """A winner document as the DB files are written (indent=1, sorted keys: diffable)."""
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"
