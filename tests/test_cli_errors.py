"""The `tkjit` command on bad input: one `tkjit: error:` line and exit 2 (usage) or 1, never a traceback."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from reliability import fake_build, key, meta_for  # noqa: E402

from tkjit import cli, envs  # noqa: E402
from tkjit.cache import Cache  # noqa: E402
from tkjit.errors import ConfigError, UsageError  # noqa: E402
from tkjit.sizes import parse_size  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPILE = ["compile", "sinkhorn_fwd", "--arch", "cpu", "--shape", "num_tokens=64", "n=4"]


def _env(cache_dir, **extra: str) -> dict:
    env = dict(os.environ)
    env.pop("TKJIT_LOG", None)
    env["TKJIT_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _cli(cache_dir, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tkjit.cli", *args], cwd=ROOT, env=_env(cache_dir, **env),
                          capture_output=True, text=True, timeout=120)


def _one_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The run failed with `code` and said so in exactly one `tkjit: error:` line naming each needle."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tkjit: error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _fill(root: Path, n: int) -> list[str]:
    c = Cache(root)
    keys = [key(f"cli-errors-{i}") for i in range(n)]
    for k in keys:
        c.get_or_build(k, meta_for(k), fake_build(k, files={"kernel.bin": 64}))
    return keys


# -- exit codes and format ----------------------------------------------------------------------
def test_tkjit_errors_exit_1_in_one_line(cache_dir):
    r = _cli(cache_dir, "compile", "sinkhorn_fwd", "--arch", "cpu", "--shape", "num_tokens=64", "bogus=1")
    _one_error(r, 1, "unknown shape params", "bogus")
    _one_error(_cli(cache_dir, "show", "nope"), 1, "unknown kernel 'nope'")
    _one_error(_cli(cache_dir, "specs", "sinkhorn_fwd", "nope"), 1, "unknown kernel 'nope'")


def test_tune_without_a_gpu_or_arch_says_so(cache_dir, tmp_path):
    """The bench worker reports the GPU's arch as it starts (no separate probe process): on a host without a
    GPU, `tkjit tune` without --arch stops with one line naming the fix."""
    r = _cli(cache_dir, "tune", "sinkhorn_fwd", "--shape", "num_tokens=64", "--storage", f"journal:{tmp_path}/j.log")
    _one_error(r, 1, "no CUDA GPU found: pass --arch")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["frobnicate"], "invalid choice"),
        (["prune"], "--max-size"),
        (["list", "--bogus"], "--bogus"),
        (["compile", "sinkhorn_fwd", "--shape", "num_tokens"], "key=value"),
        (["compile", "sinkhorn_fwd", "--shape", "num_tokens=64", "--config", "threads"], "key=value"),
        (["compile", "sinkhorn_fwd", "transpose", "--shape", "num_tokens=64"], "one kernel"),
        (["compile", "sinkhorn_fwd", "-j", "-3", "--shape", "num_tokens=64"], "-j"),
        (["compile", "sinkhorn_fwd", "-j", "many", "--shape", "num_tokens=64"], "-j"),
    ],
)
def test_usage_errors_exit_2_in_one_line(cache_dir, args, needle):
    _one_error(_cli(cache_dir, *args), 2, needle)


def test_help_still_exits_0(cache_dir):
    r = _cli(cache_dir, "--help")
    assert r.returncode == 0 and "usage" in r.stdout and r.stderr == ""


def test_system_exit_with_a_message_is_a_usage_error(monkeypatch, capsys):
    def boom(args):
        raise SystemExit("tkjit specs: cannot do that")

    monkeypatch.setattr(cli, "cmd_specs", boom)
    assert cli.main(["specs"]) == 2
    err = capsys.readouterr().err
    assert err == "tkjit: error: cannot do that\n"


def test_debug_log_adds_the_traceback(cache_dir):
    r = _cli(cache_dir, "show", "nope", TKJIT_LOG="debug")
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "UnknownKernelError" in r.stderr
    assert r.stderr.splitlines()[-1].startswith("tkjit: error: unknown kernel 'nope'")


def test_log_level_is_a_registered_env_var(cache_dir):
    assert envs.LOG in envs.REGISTRY and envs.LOG.name == "TKJIT_LOG" and envs.LOG.doc
    _one_error(_cli(cache_dir, "specs", TKJIT_LOG="loud"), 1, "TKJIT_LOG", "loud")
    assert _cli(cache_dir, "specs", TKJIT_LOG="INFO").returncode == 0


# -- sizes -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, n",
    [("0", 0), ("1024", 1024), ("500M", 500 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("10kb", 10240),
     (" 3 T ", 3 << 40), ("2g", 2 << 30), ("1e3", 1000), ("0.5K", 512)],
)
def test_parse_size_accepts(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize(
    "text, match",
    [("inf", "finite"), ("-inf", "finite"), ("nan", "finite"), ("1e400", "too large"), ("9" * 5000, "too large"),
     ("99999999999T", "too large"), ("-5", "negative"), ("-1G", "negative"), ("", "empty"), ("lots", "cannot read"),
     ("5X", "cannot read"), ("١٢", "cannot read"), ("1_000", "cannot read"), ("G", "cannot read"), ("0x10", "cannot")],
)
def test_parse_size_rejects(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_size(text)


@pytest.mark.parametrize("size", ["inf", "1e400", "-5", "nan", "lots", "5X"])
def test_prune_rejects_bad_sizes(cache_dir, size):
    line = _one_error(_cli(cache_dir, "prune", "--max-size", size), 2, "--max-size")
    assert size in line


def test_prune_takes_units(cache_dir):
    _fill(cache_dir, 2)
    r = _cli(cache_dir, "prune", "--max-size", "1.5GiB")
    assert r.returncode == 0 and "evicted 0" in r.stdout, r.stderr
    r = _cli(cache_dir, "prune", "--max-size", "0")
    assert r.returncode == 0 and "evicted 2" in r.stdout, r.stderr


# -- shape and config values -------------------------------------------------------------------
@pytest.mark.parametrize("opt", ["--config", "--shape"])
@pytest.mark.parametrize("value", ["[" * 100000, "{" * 100000, '{"a": [1]}', "[1, 2]"])
def test_nested_json_values_are_usage_errors(cache_dir, opt, value):
    args = ["compile", "sinkhorn_fwd", "--arch", "cpu", "--shape", "num_tokens=64"]
    args += [opt, f"x={value}"] if opt == "--config" else [f"n={value}"]
    _one_error(_cli(cache_dir, *args), 2, opt)


def test_parse_kv_is_public():
    assert cli.parse_kv(["n=4", " eps = 1e-6", "f=true", "g=False", "s=abc", "q=\"x y\"", "z=04", "m=-3"], "shape") == {
        "n": 4, "eps": 1e-6, "f": True, "g": False, "s": "abc", "q": "x y", "z": 4, "m": -3,
    }
    with pytest.raises(UsageError, match="--shape takes key=value"):
        cli.parse_kv(["n"], "shape")
    with pytest.raises(UsageError, match="--shape n: .*digits"):
        cli.parse_kv(["n=" + "9" * 5000], "shape")


def test_huge_numbers_in_shape(cache_dir):
    _one_error(_cli(cache_dir, *COMPILE[:-1], "n=" + "9" * 5000), 2, "--shape n")
    _one_error(_cli(cache_dir, *COMPILE[:-1], "n=" + "9" * 50), 1, "'n'", "above its maximum")
    _one_error(_cli(cache_dir, *COMPILE, "eps=1e400"), 1, "'eps'", "finite")


def test_bad_jobs_env_var(cache_dir):
    _one_error(_cli(cache_dir, *COMPILE, TKJIT_JOBS="abc"), 1, "TKJIT_JOBS")


# -- unusable cache dirs -----------------------------------------------------------------------
@pytest.mark.parametrize("cmd", [["list"], ["show", "sinkhorn_fwd"], ["clear"], ["prune", "--max-size", "1G"]])
def test_cache_dir_under_a_file(tmp_path, cmd):
    f = tmp_path / "file"
    f.write_text("x")
    for root in (f / "x", f / "x" / "y"):
        _one_error(_cli(root, *cmd), 1, f"cannot use the cache at {root}: Not a directory")


@pytest.mark.parametrize("root", ["/proc/tkjit-no-such-dir", "/proc/tkjit-no-such-dir/cache"])
def test_cache_dir_under_proc(root):
    r = _cli(root, "list")
    _one_error(r, 1, f"cannot use the cache at {root}: ")


def test_doctor_reports_an_unusable_cache_in_its_table(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for root in (f / "x", Path("/proc/tkjit-no-such-dir/cache")):
        r = _cli(root, "doctor")
        assert r.returncode == 1 and r.stderr == "", r.stderr
        row = next(line for line in r.stdout.splitlines() if line.startswith("cache perms"))
        assert f"PROBLEM: cannot use the cache at {root}" in row


def test_missing_parents_of_the_root_are_created(tmp_path):
    root = tmp_path / "not" / "yet" / "cache"
    r = _cli(root, "list")
    assert r.returncode == 0 and "is empty" in r.stdout, r.stderr
    assert _cli(root, "doctor").returncode == 0


@pytest.mark.slow
def test_read_only_cache_bind_mount(tmp_path):
    root = tmp_path / "cache"
    _fill(root, 3)
    if subprocess.run(["mount", "--bind", str(root), str(root)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(root)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        r = _cli(root, "list")
        assert r.returncode == 0 and "3 entries" in r.stdout, r.stderr
        for cmd in (["prune", "--max-size", "0"], ["clear"]):
            _one_error(_cli(root, *cmd), 1, f"cannot use the cache at {root}: Read-only file system")
    finally:
        subprocess.run(["umount", str(root)], check=True)
    assert len(Cache(root).entries()) == 3


@pytest.mark.parametrize("cmd", [["prune", "--max-size", "0"], ["clear"]])
def test_read_only_cache_in_process(cache_dir, monkeypatch, capsys, cmd):
    """Where bind mounts are not allowed: the disk refuses every rename, as a read-only one does."""
    from tkjit import api

    _fill(cache_dir, 2)
    api.reset()

    def rename(src, dst, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src))

    monkeypatch.setattr(os, "rename", rename)
    assert cli.main(cmd) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tkjit: error: cannot use the cache at {cache_dir}: Read-only file system")
    assert err.count("\n") == 1


# -- a closed stdout -----------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", [["list"], ["list", "--json"], ["specs"], ["doctor"]])
def test_closed_stdout_pipe_exits_quietly(cache_dir, cmd):
    _fill(cache_dir, 5)
    p = subprocess.Popen([sys.executable, "-m", "tkjit.cli", *cmd], cwd=ROOT, env=_env(cache_dir),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader is gone before the first write: it gets EPIPE
    err = p.stderr.read()
    p.stderr.close()
    assert p.wait(timeout=120) in (0, 1)
    assert err == ""


def test_shell_pipeline_into_head(cache_dir):
    _fill(cache_dir, 700)  # more than a pipe buffer of rows
    r = subprocess.run(["bash", "-c", f"{sys.executable} -m tkjit.cli list | head -1"], cwd=ROOT,
                       env=_env(cache_dir), capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("kernel") and r.stderr == "", r.stderr
