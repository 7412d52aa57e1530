"""The `tkjit` command: compile, list, show, specs, doctor and clear against a private cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from common import ROOT  # noqa: E402
from common import subprocess_env as _env  # noqa: E402


def _cli(cache_dir, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tkjit.cli", *args], cwd=ROOT, env=_env(cache_dir),
                          capture_output=True, text=True)


@pytest.mark.slow
def test_cli_compile_list_show_clear_doctor(cache_dir):
    r = _cli(cache_dir, "compile", "sinkhorn_fwd", "--shape", "num_tokens=4096", "n=4", "--arch", "sm_90a")
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout
    r = _cli(cache_dir, "list")
    assert r.returncode == 0 and "sinkhorn_fwd" in r.stdout and "sm_90a" in r.stdout
    assert "tuned:shipped" in r.stdout  # tuning_db/sm_90a serves a CPU host that names the arch
    assert "sinkhorn_fwd" in _cli(cache_dir, "show", "sinkhorn_fwd").stdout
    assert "layout" in _cli(cache_dir, "specs").stdout
    r = _cli(cache_dir, "doctor")
    assert r.returncode == 0 and "nvcc" in r.stdout and str(cache_dir) in r.stdout
    r = _cli(cache_dir, "compile", "sinkhorn_fwd", "--shape", "num_tokens=4096", "bogus=1", "--arch", "sm_90a")
    assert r.returncode == 1 and "unknown shape params" in r.stderr
    assert "removed 1" in _cli(cache_dir, "clear").stdout
    assert "empty" in _cli(cache_dir, "list").stdout


def test_the_command_ends_without_the_interpreters_teardown_and_loses_no_output(cache_dir):
    """`tkjit` (tkjit.cli.run) leaves by os._exit once torch is loaded (its teardown took 0.7 s of every `tkjit
    tune`): what it printed, on a pipe (block-buffered) and however long, all arrives, as main() through a normal
    exit prints it, and its status with it."""
    def python(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(cache_dir), capture_output=True,
                              text=True)

    normal = python("import sys; from tkjit.cli import main; sys.exit(main(['specs']))")
    assert normal.returncode == 0 and len(normal.stdout) > 8192, normal.stderr  # more than a pipe's buffer
    r = _cli(cache_dir, "specs")
    assert r.returncode == 0 and r.stdout == normal.stdout, r.stderr
    r = _cli(cache_dir, "show", "no_such_kernel")
    assert r.returncode == 1 and "no_such_kernel" in r.stderr
    # the exit handlers still run (multiprocessing's reaps children): one registered before prints last
    r = python("import atexit, sys, torch; atexit.register(print, 'exit handler ran'); sys.argv = ['tkjit', 'specs']; "
               "from tkjit.cli import run; run()")
    assert r.returncode == 0 and r.stdout == normal.stdout + "exit handler ran\n", r.stderr
