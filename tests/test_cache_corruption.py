"""Damaged or foreign entries are caught before anything is loaded, quarantined, and rebuilt."""

from __future__ import annotations

import _ctypes
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from reliability import counted, finish, key, spawn  # noqa: E402

from tkjit.cache import MANIFEST, Cache, CorruptEntry, manifest_digest  # noqa: E402
from tkjit.fs import sha256_file  # noqa: E402

ELF = Path(_ctypes.__file__).read_bytes()  # a real shared object for this machine
META = {"kernel": "fake", "arch": "cpu", "shape": {"n": 4}, "config": {"b": 64}, "toolchain": {"tilelang": "1"},
        "spec_source": "abc"}


def build_lib(calls: list):
    def build(staging: Path) -> dict:
        calls.append(1)
        (staging / "kernel.so").write_bytes(ELF)
        (staging / "kernel.cu").write_text("// source\n" * 100)
        return {"lib": "kernel.so", "abi": {"loader": "ctypes", "dynamic": []}}

    return build


def rehash(entry: Path, edit=None) -> None:
    """Rewrite the manifest consistently (after an edit), as a careful attacker or a bad copy would."""
    m = json.loads((entry / MANIFEST).read_text())
    if edit:
        edit(m)
    m["files"] = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
                  for p in entry.iterdir() if p.name != MANIFEST}
    _put_manifest(entry, m)


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


def _manifest(e: Path) -> dict:
    return json.loads((e / MANIFEST).read_text())


def _put_manifest(e: Path, m) -> None:
    """Write an edited manifest resealed (its checksum recomputed), so the checks behind the checksum are tested."""
    if isinstance(m, dict):
        m = {**m, "meta_sha256": manifest_digest(m)}
    (e / MANIFEST).write_text(json.dumps(m))


def _other_machine(e: Path) -> None:
    data = bytearray((e / "kernel.so").read_bytes())
    data[18:20] = (183 if data[18] != 183 else 62).to_bytes(2, "little")  # aarch64 <-> x86_64
    (e / "kernel.so").write_bytes(bytes(data))
    rehash(e)


def _foreign_entry(e: Path) -> None:
    """A whole valid entry of another variant (different shape), renamed into this key."""
    m = _manifest(e)
    m["meta"]["shape"] = {"n": 8}
    _put_manifest(e, m)


CORRUPTIONS = {
    "truncated lib": (lambda e: (e / "kernel.so").write_bytes(ELF[: len(ELF) // 2]), "bytes, manifest says"),
    "truncated to zero": (lambda e: (e / "kernel.so").write_bytes(b""), "bytes, manifest says"),
    "bit flip in lib header": (lambda e: flip(e / "kernel.so", 5), "sha256"),
    "bit flip in lib middle": (lambda e: flip(e / "kernel.so", len(ELF) // 2), "sha256"),
    "bit flip in lib tail": (lambda e: flip(e / "kernel.so", -1), "sha256"),
    "bit flip in source": (lambda e: flip(e / "kernel.cu", 7), "sha256"),
    "missing lib": (lambda e: (e / "kernel.so").unlink(), "missing"),
    "missing source": (lambda e: (e / "kernel.cu").unlink(), "missing"),
    "missing manifest": (lambda e: (e / MANIFEST).unlink(), "manifest missing"),
    "empty manifest": (lambda e: (e / MANIFEST).write_text(""), "not JSON"),
    "truncated manifest": (lambda e: (e / MANIFEST).write_text((e / MANIFEST).read_text()[:50]), "not JSON"),
    "deeply nested manifest": (lambda e: (e / MANIFEST).write_text("[" * 100000 + "]" * 100000), "not JSON"),
    "manifest is a list": (lambda e: _put_manifest(e, [1, 2]), "does not name this key"),
    "manifest for another key": (lambda e: _put_manifest(e, {**_manifest(e), "key": key("other")}), "does not name"),
    "manifest sizes edited": (
        lambda e: _put_manifest(e, {**_manifest(e), "files": {**_manifest(e)["files"], "kernel.so": {
            "size": 1, "sha256": _manifest(e)["files"]["kernel.so"]["sha256"]}}}), "bytes, manifest says"),
    "manifest sha edited": (
        lambda e: _put_manifest(e, {**_manifest(e), "files": {**_manifest(e)["files"], "kernel.so": {
            "size": len(ELF), "sha256": "0" * 64}}}), "sha256"),
    "manifest files not a dict": (lambda e: _put_manifest(e, {**_manifest(e), "files": ["kernel.so"]}), "no files"),
    "manifest without meta": (lambda e: _put_manifest(e, {k: v for k, v in _manifest(e).items() if k != "meta"}),
                              "no meta"),
    "planted extra library": (lambda e: (e / "evil.so").write_bytes(ELF), "does not list"),
    "lib outside the entry": (lambda e: rehash(e, lambda m: m["meta"].update(lib="../../evil.so")), "not one of"),
    "lib not in files": (lambda e: rehash(e, lambda m: m["meta"].update(lib="other.so")), "not one of"),
    "file name with a slash": (lambda e: _put_manifest(e, {**_manifest(e), "files": {
        **_manifest(e)["files"], "../kernel.so": {"size": 1, "sha256": "0"}}}), "bad file"),
    "lib replaced by a symlink": (lambda e: ((e / "kernel.so").unlink(), (e / "kernel.so").symlink_to(
        _ctypes.__file__)), "symbolic link"),
    "lib is not ELF": (lambda e: ((e / "kernel.so").write_bytes(b"#!/bin/sh\nrm -rf ~\n"), rehash(e)), "not an ELF"),
    "lib for another machine": (_other_machine, "ELF machine"),
    "wrong arch meta (sm_90a artifact)": (lambda e: rehash(e, lambda m: m["meta"].update(arch="sm_90a")), "arch"),
    "wrong toolchain meta": (lambda e: rehash(e, lambda m: m["meta"].update(toolchain={"tilelang": "0"})),
                             "toolchain"),
    "foreign entry (other shape)": (_foreign_entry, "shape"),
    "file replaced by a dir": (lambda e: ((e / "kernel.cu").unlink(), (e / "kernel.cu").mkdir()), "regular file"),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_corruption_detected_quarantined_rebuilt(tmp_path, what):
    corrupt, reason = CORRUPTIONS[what]
    cache = Cache(tmp_path / "c")
    k = key("corrupt")
    calls: list = []
    first = cache.get_or_build(k, META, build_lib(calls))
    assert calls == [1]
    corrupt(first.path)
    with pytest.raises(CorruptEntry, match=reason):
        cache.verify(k, {k_: v for k_, v in META.items()})
    again = cache.get_or_build(k, META, build_lib(calls))
    assert calls == [1, 1], "a corrupt entry must be rebuilt"
    assert (again.path / "kernel.so").read_bytes() == ELF
    cache.verify(k, META)
    q = list((cache.base / "quarantine").iterdir())
    assert len(q) == 1 and q[0].name.startswith(k)
    assert (q[0] / "REASON").read_text().strip()


def test_quarantine_keeps_the_newest_few(tmp_path):
    from tkjit.cache import QUARANTINE_KEEP

    cache = Cache(tmp_path / "c")
    k = key("q")
    calls: list = []
    for _ in range(QUARANTINE_KEEP + 5):
        e = cache.get_or_build(k, META, build_lib(calls))
        flip(e.path / "kernel.so", 100)
        assert cache.lookup(k, META) is None
    assert len(list((cache.base / "quarantine").iterdir())) == QUARANTINE_KEEP


@pytest.mark.slow
def test_real_artifact_bit_flip_is_rebuilt_before_load(tmp_path):
    """Real compile path: a flipped bit in a real kernel.so is caught in a fresh process, which recompiles."""
    root, counter = tmp_path / "c", tmp_path / "compiles"
    (r1,) = finish([spawn("real", root, "sinkhorn_fwd", 257, "--counter", counter)], timeout=170)
    lib = Path(r1[0]["path"]) / "kernel.so"
    good = lib.read_bytes()
    flip(lib, len(good) // 3)
    (r2,) = finish([spawn("real", root, "sinkhorn_fwd", 999, "--counter", counter)], timeout=170)
    assert r2[0]["key"] == r1[0]["key"]
    assert len(counted(counter)) == 2  # detected and recompiled, and the recompiled kernel computed right
    q = list((root / "v1" / "quarantine").iterdir())
    assert len(q) == 1 and "sha256" in (q[0] / "REASON").read_text()
    Cache(root).verify(r1[0]["key"])
