"""A throwaway PostgreSQL server for tests: initdb into a temp dir, pg_ctl start on a private Unix socket.

    from pg import postgres_server   # a pytest fixture: the server's SQLAlchemy URL (psycopg 3)

Skips (with the reason) when there are no PostgreSQL binaries (Debian's `postgresql` package puts them
in /usr/lib/postgresql/<v>/bin; `.ci/run` installs it) or no psycopg (`pip install 'tkjit[distributed]'`).
PostgreSQL refuses to run as root: as root, initdb and pg_ctl run as the `postgres` user (`runuser`),
in a temp dir that user owns. No TCP port is opened (listen_addresses=''), so parallel runs cannot collide.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def pg_bindir() -> Path | None:
    """The bin dir holding initdb and pg_ctl: $PATH first, then the newest Debian install."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                  if Path(p).parent.name.isdigit() else 0)
    for d in reversed(dirs):
        if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists():
            return Path(d)
    return None


def _as_server_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", "postgres", "--", *cmd]
    return ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(map(_quote, cmd))]


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[str]:
    """A running server for the module's tests; yields `postgresql+psycopg://postgres@/postgres?host=DIR`."""
    pytest.importorskip("psycopg", reason="no psycopg: pip install 'tkjit[distributed]'")
    bindir = pg_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl): apt-get install postgresql")
    if os.geteuid() == 0:
        import pwd

        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no `postgres` user to run the server as")
    root = Path(tempfile.mkdtemp(prefix="tkjit-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        for p in (root, sock):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    log = root / "server.log"
    try:
        # trust: the socket lives in a private dir; nobody else can reach the server.
        subprocess.run(_as_server_user([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
                                        "--no-sync", "-E", "UTF8"]),
                       check=True, capture_output=True, text=True, timeout=120)
        # 200 connections: each worker process holds a pool plus a heartbeat connection, and a worker killed
        # with -9 (the fleet tests do that) keeps its connections until the server notices the dead socket.
        opts = f"-c listen_addresses='' -k {sock} -c fsync=off -c max_connections=200"
        subprocess.run(_as_server_user([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", opts,
                                        "-w", "-t", "60", "start"]),
                       check=True, capture_output=True, text=True, timeout=90)
    except subprocess.CalledProcessError as e:
        text = log.read_text() if log.exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"could not start PostgreSQL: {e.stdout}{e.stderr}{text}")
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={sock}"
    finally:
        subprocess.run(_as_server_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(url: str, name: str) -> str:
    """A new, empty database on the server of `url`; its URL (tests keep their studies apart)."""
    import psycopg

    host = url.split("host=", 1)[1]
    with psycopg.connect(host=host, user="postgres", dbname="postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}"')
        c.execute(f'CREATE DATABASE "{name}"')
    return url.replace("/postgres?", f"/{name}?")
