"""tkjit.fs: private paths (owner, mode, kind, no links), non-blocking opens, bounded reads, ELF checks."""

from __future__ import annotations

import _ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tkjit.errors import CacheError
from tkjit.fs import (
    BadFile,
    WrongKind,
    check_elf,
    check_private,
    make_parents,
    mkdir_private,
    open_private,
    private_dir,
    read_private,
    sha256_file,
)


def _file(path: Path, data: bytes = b"x", mode: int = 0o600) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_check_private_accepts_ours_and_refuses_the_rest(tmp_path):
    f = _file(tmp_path / "f")
    check_private(f, is_dir=False)
    check_private(private_dir(tmp_path / "d"), is_dir=True)
    with pytest.raises(WrongKind, match="should be a directory"):
        check_private(f, is_dir=True)
    with pytest.raises(WrongKind, match="should be a regular file, not a directory"):
        check_private(tmp_path / "d", is_dir=False)
    os.chmod(f, 0o620)
    with pytest.raises(CacheError, match="writable by group or others"):
        check_private(f, is_dir=False)
    (tmp_path / "link").symlink_to(f)
    with pytest.raises(CacheError, match="symbolic link"):
        check_private(tmp_path / "link", is_dir=False)
    with pytest.raises(FileNotFoundError):
        check_private(tmp_path / "absent", is_dir=False)


def test_open_private_never_blocks_on_a_fifo_nor_follows_a_link(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(WrongKind, match="FIFO"):
        open_private(fifo)  # checked before opening: an open would wait for a writer forever
    (tmp_path / "link").symlink_to(_file(tmp_path / "f"))
    with pytest.raises(CacheError, match="symbolic link"):
        open_private(tmp_path / "link")
    fd = open_private(tmp_path / "new", os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    assert stat.S_IMODE(os.lstat(tmp_path / "new").st_mode) == 0o600


def test_read_private_is_bounded(tmp_path):
    f = _file(tmp_path / "m", b"a" * 10)
    assert read_private(f, 10) == b"a" * 10
    with pytest.raises(BadFile, match="larger than 9 bytes"):
        read_private(f, 9)


def test_sha256_file(tmp_path):
    data = os.urandom(3 << 20)
    assert sha256_file(_file(tmp_path / "b", data)) == hashlib.sha256(data).hexdigest()


def test_check_elf(tmp_path):
    lib = tmp_path / "lib.so"
    shutil.copyfile(_ctypes.__file__, lib)  # a shared object built for this host
    os.chmod(lib, 0o600)
    check_elf(lib)
    with pytest.raises(BadFile, match="not an ELF"):
        check_elf(_file(tmp_path / "text.so", b"#!/bin/sh\n" * 4))
    head = bytearray(lib.read_bytes()[:64])
    little = "little" if head[5] == 1 else "big"
    exe = bytearray(head)
    exe[16:18] = (2).to_bytes(2, little)  # ET_EXEC
    with pytest.raises(BadFile, match="not a shared library"):
        check_elf(_file(tmp_path / "exe.so", bytes(exe)))
    other = bytearray(head)
    other[18:20] = (0x1234).to_bytes(2, little)
    with pytest.raises(BadFile, match="ELF machine 4660"):
        check_elf(_file(tmp_path / "other.so", bytes(other)))


def test_private_dirs_whatever_the_umask(tmp_path):
    old = os.umask(0o277)  # would leave a plain mkdir 0500
    try:
        assert mkdir_private(tmp_path / "d") is True
        assert mkdir_private(tmp_path / "d") is False
        make_parents(tmp_path / "a" / "b" / "leaf")
    finally:
        os.umask(old)
    for d in (tmp_path / "d", tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d
    assert not os.path.lexists(tmp_path / "a" / "b" / "leaf")  # the parents only


def test_private_tempdir_is_private_and_removed_at_exit(tmp_path):
    code = ("import os, sys; from tkjit.fs import private_tempdir; d = private_tempdir(); "
            "(d / 'kernel.so').write_bytes(b'x'); print(d, oct(os.stat(d).st_mode & 0o777))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "0o700"
    assert not os.path.lexists(out[0])
