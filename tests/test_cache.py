"""tkjit.cache.Cache: publish, verify on a hit, quarantine a changed entry; a malformed key never becomes a path."""

from __future__ import annotations

from pathlib import Path

import pytest

import tkjit
from tkjit.cache import Cache


def _fake_build(tag: str):
    def build(staging: Path) -> dict:
        (staging / "kernel.so").write_bytes(tag.encode() * 100)
        return {"abi": {"loader": "none"}}

    return build


def test_publish_verify_and_quarantine(cache_dir):
    c = Cache()
    k = "a" * 40
    e = c.get_or_build(k, {"kernel": "toy"}, _fake_build("x"))
    assert (e.path / "kernel.so").read_bytes() == b"x" * 100
    assert oct(e.path.stat().st_mode & 0o777) == "0o700"
    assert oct((e.path / "kernel.so").stat().st_mode & 0o777) == "0o600"
    assert c.get_or_build(k, {}, _fake_build("never")).path == e.path  # hit: not rebuilt
    (e.path / "kernel.so").write_bytes(b"y" * 100)  # same size, different bytes
    e2 = c.get_or_build(k, {"kernel": "toy"}, _fake_build("z"))
    assert (e2.path / "kernel.so").read_bytes() == b"z" * 100
    q = list((c.base / "quarantine").iterdir())
    assert len(q) == 1 and "sha256" in (q[0] / "REASON").read_text()
    assert list((c.base / "staging").iterdir()) == []


def test_malformed_key_never_becomes_a_path(cache_dir):
    with pytest.raises(tkjit.CacheError):
        Cache().entry_path("../../etc")


def test_clear_empties_the_quarantine_in_place(cache_dir):
    """Two concurrent clears once raced: one removed the quarantine dir while the other checked it.

    clear now empties the dir and keeps it, so a process holding it open still sees the same dir.
    """
    import os

    c = Cache()
    k = "b" * 40
    e = c.get_or_build(k, {"kernel": "toy"}, _fake_build("x"))
    (e.path / "kernel.so").write_bytes(b"y" * 100)
    c.get_or_build(k, {"kernel": "toy"}, _fake_build("z"))  # quarantines the changed entry
    qdir = c.base / "quarantine"
    assert len(list(qdir.iterdir())) == 1
    fd = os.open(qdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        c.clear()
        assert os.fstat(fd).st_nlink > 0, "clear removed the quarantine dir instead of emptying it"
    finally:
        os.close(fd)
    assert list(qdir.iterdir()) == []
