"""`tkjit bundle export/import`: compile once on a CPU host (sm_90a cross-compiles), serve with the JIT off.

One module-scoped export (two sinkhorn_fwd variants, the shipped tuned winners of two buckets) serves
every test; each import goes into a fresh cache. A tampered bundle must be refused whole.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

import tkjit
from tkjit import bundle as bmod
from tkjit.cli import main
from tkjit.errors import JitDisabledError

pytestmark = pytest.mark.usefixtures("module_cache")
TOKENS = (4096, 1048576)
MANIFEST = "[[study]]\nkernel = 'sinkhorn_fwd'\nshape = { n = 4, num_tokens = [4096, 1048576] }\n"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def exported(module_cache, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bundle")
    (d / "fleet.toml").write_text(MANIFEST)
    out = d / "tkjit-sm_90a.tar"
    assert main(["bundle", "export", "--arch", "sm_90a", "--manifest", str(d / "fleet.toml"), "-o", str(out),
                 "-j", "2"]) == 0
    return out


@pytest.fixture
def fleet_host(cache_dir, tmp_path, monkeypatch) -> Path:
    """A fresh cache on a host whose shipped tuned DB lacks these shapes: only the bundle's DB entries serve."""
    (tmp_path / "no-shipped-db").mkdir()
    monkeypatch.setenv("TKJIT_TUNING_DB", str(tmp_path / "no-shipped-db"))
    return cache_dir


def _index(path: Path) -> dict:
    with tarfile.open(path) as tar:
        return json.loads(tar.extractfile("index.json").read())


def _installed(cache: Path) -> list[str]:
    """Entry dirs and tuned-DB files in the cache (a refused bundle leaves none)."""
    entries = cache / "v1" / "entries"
    return sorted(os.listdir(entries) if entries.exists() else []) + sorted(
        str(p) for p in (cache / "v1" / "tuned").rglob("*.json"))


def test_export_holds_the_served_kernels_and_their_tuned_entries(exported):
    index = _index(exported)
    assert index["arch"] == "sm_90a" and len(index["entries"]) == 2
    assert {e["kernel"] for e in index["entries"].values()} == {"sinkhorn_fwd"}
    assert sorted(t["bucket"]["num_tokens"] for t in index["tuned"]) == list(TOKENS)
    configs = {json.dumps(e["config"], sort_keys=True) for e in index["entries"].values()}
    assert {json.dumps(t["config"], sort_keys=True) for t in index["tuned"]} == configs
    with tarfile.open(exported) as tar:
        for m in tar.getmembers():
            assert (m.isdir() and m.mode == 0o700) or (m.isreg() and m.mode == 0o600), m.name
            assert m.uid == 0 and m.uname == ""


def test_import_serves_every_entry_with_the_jit_off(exported, fleet_host, monkeypatch, capsys):
    rc, out, err = _run(capsys, "bundle", "import", str(exported))
    assert rc == 0, err
    assert "2 entries (2 new, 0 already there); 2 tuned DB entries (2 new or changed)" in out, out
    monkeypatch.setenv("TKJIT_DISABLE_JIT", "1")
    keys = set(_index(exported)["entries"])
    for n in TOKENS:
        k = tkjit.get("sinkhorn_fwd", {"num_tokens": n, "n": 4}, arch="sm_90a")
        assert k.key in keys and k.config_source == "tuned:user"  # the bundle's DB entry picked the bundle's binary
        keys.discard(k.key)
    assert not keys


def test_a_gpu_host_without_nvcc_serves_the_bundle(exported, fleet_host, monkeypatch, capsys):
    # Keys hold the nvcc version; a serving host has no nvcc: import pins the build host's versions.
    assert _run(capsys, "bundle", "import", str(exported))[0] == 0
    monkeypatch.setenv("TKJIT_NVCC", str(fleet_host / "no-cuda" / "bin" / "nvcc"))
    monkeypatch.setenv("TKJIT_DISABLE_JIT", "1")
    tkjit.reset()
    keys = set(_index(exported)["entries"])
    for n in TOKENS:
        assert tkjit.get("sinkhorn_fwd", {"num_tokens": n, "n": 4}, arch="sm_90a").key in keys
    (fleet_host / "v1" / "toolchain-sm_90a.json").unlink()  # without the pin: other keys, nothing cached
    tkjit.reset()
    with pytest.raises(JitDisabledError):
        tkjit.get("sinkhorn_fwd", {"num_tokens": TOKENS[0], "n": 4}, arch="sm_90a")


def test_import_is_idempotent(exported, fleet_host, capsys):
    assert _run(capsys, "bundle", "import", str(exported))[0] == 0
    db = next((fleet_host / "v1" / "tuned").rglob("*.json"))
    before = db.read_bytes()
    rc, out, err = _run(capsys, "bundle", "import", str(exported))
    assert rc == 0, err
    assert "(0 new, 2 already there)" in out and "(0 new or changed)" in out, out
    assert db.read_bytes() == before


def test_export_from_cache_and_with_the_jit_off(exported, tmp_path, monkeypatch, capsys):
    rc, _, err = _run(capsys, "bundle", "export", "--arch", "sm_90a", "--from-cache", "-o", str(tmp_path / "c.tar"))
    assert rc == 0, err
    assert set(_index(tmp_path / "c.tar")["entries"]) == set(_index(exported)["entries"])
    monkeypatch.setenv("TKJIT_DISABLE_JIT", "1")
    (tmp_path / "m.toml").write_text(MANIFEST)
    rc, out, err = _run(capsys, "bundle", "export", "--arch", "sm_90a", "--manifest", str(tmp_path / "m.toml"),
                        "-o", str(tmp_path / "m.tar"))
    assert rc == 0 and out.count(": cached ") == 2, err  # all cached: no compiler needed
    (tmp_path / "m.toml").write_text(MANIFEST.replace("n = 4,", "n = 4, repeat = 5,"))
    rc, _, err = _run(capsys, "bundle", "export", "--arch", "sm_90a", "--manifest", str(tmp_path / "m.toml"),
                      "-o", str(tmp_path / "m2.tar"))
    assert rc == 1 and "TKJIT_DISABLE_JIT=1 forbids compiling" in err and err.count("\n") == 1, err
    assert not (tmp_path / "m2.tar").exists()


# -- tampering --------------------------------------------------------------------------------
Members = list[tuple[tarfile.TarInfo, bytes]]


def _rewrite(src: Path, dst: Path, edit: Callable[[Members], Members]) -> None:
    with tarfile.open(src) as tar:
        members = [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()]
    with tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tar:
        for m, data in edit(members):
            tar.addfile(m, io.BytesIO(data) if m.isreg() else None)
    dst.chmod(0o600)


def _file(name: str, data: bytes = b"x", **kw) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode = len(data), 0o600
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti, data


def _last(members: Members, suffix: str) -> int:
    return max(i for i, (m, _) in enumerate(members) if m.name.endswith(suffix))


def _flip_byte(src: Path, dst: Path) -> None:
    """One byte of the last library's data (the first entry is intact: a partial import would install it)."""
    with tarfile.open(src) as tar:
        m = [m for m in tar.getmembers() if m.name.endswith("kernel.so")][-1]
    raw = bytearray(src.read_bytes())
    raw[m.offset_data + m.size // 2] ^= 0x01
    dst.write_bytes(bytes(raw))
    dst.chmod(0o600)


def _drop(suffix: str) -> Callable[[Members], Members]:
    return lambda ms: [x for i, x in enumerate(ms) if i != _last(ms, suffix)]


def _add(*extra: tuple[tarfile.TarInfo, bytes]) -> Callable[[Members], Members]:
    return lambda ms: ms + list(extra)


def _link_over_library(ms: Members) -> Members:
    i = _last(ms, "kernel.so")
    link = tarfile.TarInfo(ms[i][0].name)
    link.type, link.linkname = tarfile.SYMTYPE, "/usr/lib/x86_64-linux-gnu/libc.so.6"
    return [*ms[:i], (link, b""), *ms[i + 1:]]


def _edit_index(reseal: bool) -> Callable[[Members], Members]:
    def edit(ms: Members) -> Members:
        i = _last(ms, "index.json")
        doc = json.loads(ms[i][1])
        entry = doc["entries"][sorted(doc["entries"])[-1]]
        entry["config"] = {**entry["config"], "threads": 64}
        if reseal:  # a consistent index that lies about the entry: the manifest still disagrees
            doc["sha256"] = bmod._seal(doc)
        data = json.dumps(doc).encode()
        m = ms[i][0]
        m.size = len(data)
        return [*ms[:i], (m, data), *ms[i + 1:]]

    return edit


def _key(ms: Members) -> str:
    return ms[_last(ms, "kernel.so")][0].name.split("/")[1]


TAMPER = {
    "byte flipped": (None, "does not match its sha256 in the index"),
    "../ member": (_add(_file("entries/../../evil.so")), "escapes the bundle"),
    "absolute member": (_add(_file("/tmp/evil.so")), "escapes the bundle"),
    "symlink member": (_link_over_library, "is a symbolic link"),
    "device member": (_add(_file("entries/dev", type=tarfile.CHRTYPE, devmajor=1, devminor=3)), "character device"),
    "setuid member": (lambda ms: ms + [_file(f"entries/{_key(ms)}/x.so", mode=0o4755)], "setuid"),
    "missing file": (_drop("kernel.so"), "is missing (the index lists it)"),
    "member not in the index": (lambda ms: ms + [_file(f"entries/{_key(ms)}/extra.so")], "not in the bundle's index"),
    "index edited": (_edit_index(reseal=False), "index.json does not match its checksum"),
    "index mismatch": (_edit_index(reseal=True), "the index says config"),
    "no index": (_drop("index.json"), "no index.json"),
    "duplicate member": (lambda ms: ms + [ms[_last(ms, "kernel.so")]], "appears twice"),
}


@pytest.mark.parametrize("how", list(TAMPER))
def test_tampered_bundle_refused_whole(exported, fleet_host, tmp_path, capsys, how):
    edit, words = TAMPER[how]
    bad = tmp_path / "bad.tar"
    if edit is None:
        _flip_byte(exported, bad)
    else:
        _rewrite(exported, bad, edit)
    rc, out, err = _run(capsys, "bundle", "import", str(bad))
    assert rc == 1 and err.startswith("tkjit: error: ") and err.count("\n") == 1, (out, err)
    assert "refused, nothing installed" in err and words in err, err
    assert _installed(fleet_host) == []


def test_a_bundle_others_can_write_is_refused(exported, fleet_host, tmp_path, capsys):
    bad = tmp_path / "loose.tar"
    bad.write_bytes(exported.read_bytes())
    bad.chmod(0o666)
    rc, _, err = _run(capsys, "bundle", "import", str(bad))
    assert rc == 1 and "writable by group or others" in err and "chmod go-w" in err, err
    bad.write_bytes(b"not a tar at all" * 100)
    bad.chmod(0o600)
    rc, _, err = _run(capsys, "bundle", "import", str(bad))
    assert rc == 1 and "not a readable tar file" in err and err.count("\n") == 1, err
    assert _installed(fleet_host) == []
