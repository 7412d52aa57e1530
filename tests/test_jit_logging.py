"""The JIT can be watched (logging, TKJIT_PRINT_CONFIGS) and forbidden (TKJIT_DISABLE_JIT)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

import tkjit
from tkjit import api, build

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from common import ROOT, subprocess_env  # noqa: E402

SHAPE = {"num_tokens": 8, "n": 4}
GET = "import tkjit; tkjit.get('sinkhorn_fwd', {'num_tokens': 8, 'n': 4}, arch='cpu')"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    # Per-process "first time" sets: each test starts as a new process would.
    monkeypatch.setattr(build, "_seen_keys", set())
    monkeypatch.setattr(build, "_printed", set())
    monkeypatch.setattr(api, "_chosen", set())
    for var in ("TKJIT_LOG", "TKJIT_PRINT_CONFIGS", "TKJIT_DISABLE_JIT"):
        monkeypatch.delenv(var, raising=False)


def _python(cache_dir, code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**subprocess_env(cache_dir), **env},
                          capture_output=True, text=True, timeout=300)


def _cli(cache_dir, *args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tkjit.cli", *args], cwd=ROOT,
                          env={**subprocess_env(cache_dir), **env}, capture_output=True, text=True, timeout=300)


def _lines(caplog, word: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("tkjit") and word in r.getMessage()]


def test_compile_logged_once_and_disk_hit_in_fresh_process(cache_dir, caplog):
    caplog.set_level(logging.INFO, logger="tkjit")
    tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu")
    tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu")
    compiled = _lines(caplog, "compiled sinkhorn_fwd")
    assert len(compiled) == 1, caplog.text
    msg = compiled[0].getMessage()
    assert "n=4" in msg and "(default)" in msg and " s, key " in msg
    assert not _lines(caplog, "from the cache")
    assert not [r for r in caplog.records if r.name.startswith("tkjit") and r.levelno >= logging.WARNING]

    r = _python(cache_dir, GET, TKJIT_LOG="info")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("loaded sinkhorn_fwd") == 1, r.stderr
    assert "from the cache" in r.stderr and "compiled" not in r.stderr
    assert "WARNING" not in r.stderr and "ERROR" not in r.stderr
    r = _python(cache_dir, GET)  # TKJIT_LOG unset: the library configures no handler
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_debug_shows_key_material_and_entry_path(cache_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="tkjit")
    k = tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu")
    assert _lines(caplog, "material") and _lines(caplog, str(k.key))


def test_tuned_db_choice_logged_once_per_bucket(cache_dir, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="tkjit")

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(api, "ensure_entry", stop)  # the choice is logged before any build
    for _ in range(2):
        with pytest.raises(Stop):
            tkjit.get("sinkhorn_fwd", {"num_tokens": 4096, "n": 4}, arch="sm_90a")
    chosen = _lines(caplog, "config for sinkhorn_fwd")
    assert len(chosen) == 1 and "(tuned:shipped)" in chosen[0].getMessage(), caplog.text


def test_print_configs_once_per_shape(cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("TKJIT_PRINT_CONFIGS", "1")
    tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu")
    tkjit.reset()
    tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu")
    err = capsys.readouterr().err
    assert err.count("sinkhorn_fwd") == 1 and "(default)" in err and "n=4" in err, err


def test_disable_jit_refuses_a_miss_and_serves_a_hit(cache_dir, monkeypatch):
    monkeypatch.setenv("TKJIT_DISABLE_JIT", "1")
    with pytest.raises(tkjit.CompileError) as e:
        tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu")
    assert isinstance(e.value, tkjit.JitDisabledError)
    msg = str(e.value)
    assert "sinkhorn_fwd" in msg and "n=4" in msg and "TKJIT_DISABLE_JIT" in msg and "config" in msg
    monkeypatch.delenv("TKJIT_DISABLE_JIT")
    tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu")
    tkjit.reset()
    monkeypatch.setenv("TKJIT_DISABLE_JIT", "1")
    assert tkjit.get("sinkhorn_fwd", SHAPE, arch="cpu") is not None


def test_cli_compile_says_built_then_cached(cache_dir):
    args = ("compile", "sinkhorn_fwd", "--shape", "num_tokens=8", "n=4", "--arch", "cpu", "-j", "1")
    r = _cli(cache_dir, *args)
    assert r.returncode == 0, r.stderr
    assert ": ok built " in r.stdout and " s)" in r.stdout, r.stdout
    r = _cli(cache_dir, *args)
    assert r.returncode == 0, r.stderr
    assert ": ok cached " in r.stdout and "built" not in r.stdout, r.stdout
    r = _cli(cache_dir, *args, TKJIT_DISABLE_JIT="1")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "TKJIT_DISABLE_JIT" in r.stderr, r.stderr


def test_cli_version(cache_dir):
    r = _cli(cache_dir, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"tkjit {tkjit.__version__}")
