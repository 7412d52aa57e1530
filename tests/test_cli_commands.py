"""The `tkjit` commands' behaviour: list filters and width, show serves what get serves, clear and --all,
did-you-mean, what compile says is missing, the shared --shape parser. In-process (fast) unless a real
pipe is needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from common import ROOT  # noqa: E402
from common import subprocess_env as _env  # noqa: E402
from reliability import fake_build, key  # noqa: E402

from tkjit import cli  # noqa: E402
from tkjit.cache import Cache  # noqa: E402
from tkjit.errors import UsageError  # noqa: E402

ROWS = [  # kernel, arch, source
    ("sinkhorn_fwd", "sm_90a", "tuned:shipped"),
    ("sinkhorn_fwd", "cpu", "default"),
    ("sinkhorn_bwd", "sm_90a", "tuned:nearest(user, num_tokens=4096)"),
    ("transpose", "sm_100a", "explicit"),
]


def _fill(root: Path, rows=ROWS) -> list[str]:
    c = Cache(root)
    keys = []
    for i, (kernel, arch, source) in enumerate(rows):
        k = key(f"cli-cmd-{i}")
        meta = {"kernel": kernel, "arch": arch, "shape": {"n": 4, "long_param_name": 123456789 + i},
                "config": {"threads": 128, "block_tokens": 64, "layout": "thread"}, "config_source": source,
                "toolchain": {"fake": "1"}}
        c.get_or_build(k, meta, fake_build(k, files={"kernel.bin": 64}))
        keys.append(k)
    return keys


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _kernels(out: str) -> list[str]:
    lines = out.splitlines()
    body = lines[2:lines.index("")] if "" in lines else lines[2:]
    return [line.split()[0] for line in body]


# -- list ---------------------------------------------------------------------------------------
def test_list_filters(cache_dir, capsys):
    _fill(cache_dir)
    rc, out, _ = _run(capsys, "list", "sinkhorn_fwd")
    assert rc == 0 and _kernels(out) == ["sinkhorn_fwd", "sinkhorn_fwd"] and "2 of 4 entries" in out
    assert _kernels(_run(capsys, "list", "sinkhorn*")[1]) == ["sinkhorn_bwd", "sinkhorn_fwd", "sinkhorn_fwd"]
    rc, out, _ = _run(capsys, "list", "--arch", "sm_90a")
    assert sorted(_kernels(out)) == ["sinkhorn_bwd", "sinkhorn_fwd"]
    # --source tuned matches every tuned source; a full label matches only itself
    assert sorted(_kernels(_run(capsys, "list", "--source", "tuned")[1])) == ["sinkhorn_bwd", "sinkhorn_fwd"]
    assert _kernels(_run(capsys, "list", "--source", "tuned:shipped")[1]) == ["sinkhorn_fwd"]
    assert _kernels(_run(capsys, "list", "--source", "explicit", "--arch", "sm_100a")[1]) == ["transpose"]
    rc, out, _ = _run(capsys, "list", "topk_gate")
    assert rc == 0 and "no matching entries" in out


def test_list_name_typo_is_an_error_with_did_you_mean(cache_dir, capsys):
    rc, out, err = _run(capsys, "list", "sinkhorn_fw")
    assert rc == 1 and out == ""
    assert err.startswith("tkjit: error: unknown kernel 'sinkhorn_fw'; did you mean sinkhorn_fwd")


def test_list_narrow_by_default_wide_on_request(cache_dir, capsys, monkeypatch):
    keys = _fill(cache_dir)
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, _ = _run(capsys, "list")
    table = out.split("\n\n")[0].splitlines()
    assert rc == 0 and table[0].split() == ["kernel", "shape", "arch", "source", "size", "last", "used", "key"]
    assert all(len(line) <= 80 for line in table), table
    assert "…" in out and keys[0] not in out and keys[0][:12] in out  # shortened, short keys
    assert "threads=128" not in out  # the config is --wide's
    rc, out, _ = _run(capsys, "list", "--wide")
    assert rc == 0 and "config" in out.splitlines()[0] and "threads=128" in out and keys[0] in out
    assert "long_param_name=123456789" in out and "…" not in out


def test_list_json_has_readable_times_and_filters(cache_dir, capsys):
    _fill(cache_dir)
    rc, out, _ = _run(capsys, "list", "--json", "--arch", "sm_90a")
    rows = json.loads(out)
    assert rc == 0 and {r["kernel"] for r in rows} == {"sinkhorn_fwd", "sinkhorn_bwd"}
    import datetime

    for r in rows:
        for f in ("created", "last_used"):
            t = datetime.datetime.fromisoformat(r[f])  # ISO 8601 with the offset
            assert t.tzinfo is not None and abs(t.timestamp() - datetime.datetime.now().timestamp()) < 3600


def test_list_bad_arch_is_a_usage_error(cache_dir, capsys):
    rc, _, err = _run(capsys, "list", "--arch", "hopper")
    assert rc == 2 and "--arch" in err and "sm_90a" in err


# -- specs / show -------------------------------------------------------------------------------
@pytest.mark.parametrize("name, near", [("sinkhorn", "sinkhorn_fwd"), ("tranpose", "transpose"),
                                        ("topk", "topk_gate")])
def test_specs_unknown_name_did_you_mean(cache_dir, capsys, name, near):
    rc, out, err = _run(capsys, "specs", name)
    assert rc == 1 and out == ""
    assert f"unknown kernel '{name}'; did you mean" in err and near in err and err.count("\n") == 1


def test_specs_nosuch_lists_the_known(cache_dir, capsys):
    rc, _, err = _run(capsys, "specs", "nosuch")
    assert rc == 1 and "unknown kernel 'nosuch'" in err and "sinkhorn_fwd" in err


def test_show_prints_what_get_serves_with_its_source(cache_dir, capsys):
    """A shape the shipped H200 DB tunes away from the heuristic default: show names the tuned config."""
    from tkjit.registry import get_spec
    from tkjit.tuning_db import choose_config

    spec = get_spec("transpose")
    shape = {"rows": 16384, "cols": 7168, "dtype": "bfloat16"}
    full = spec.canonical_shape(shape)
    cfg, source = choose_config(spec, full, "sm_90a", None)
    default = spec.default_config(full, "sm_90a")
    assert source.startswith("tuned:") and cfg != default  # the premise: the DB differs from the default
    rc, out, err = _run(capsys, "show", "transpose", "--arch", "sm_90a", "--shape", "rows=16384", "cols=7168")
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("config at"))
    assert cli._compact(cfg) in line and f"({source};" in line and cli._compact(default) in line
    # the examples too are shown as served, not as the heuristic default
    rc, out, _ = _run(capsys, "show", "transpose", "--arch", "sm_90a")
    ex = next(ln for ln in out.splitlines() if "example" in ln and "rows=16384" in ln)
    assert cli._compact(cfg) in ex.split("(")[0] and source in ex


def test_show_with_tuning_db_off_serves_the_default(cache_dir, capsys, monkeypatch):
    monkeypatch.setenv("TKJIT_NO_TUNED_DB", "1")
    rc, out, _ = _run(capsys, "show", "transpose", "--arch", "sm_90a", "--shape", "rows=16384", "cols=7168")
    assert rc == 0 and "(default)" in out


def test_show_shape_without_arch_on_a_cpu_host_says_the_option(cache_dir, capsys, monkeypatch):
    monkeypatch.delenv("TKJIT_ARCH", raising=False)
    monkeypatch.setattr("tkjit.arch.current_arch", lambda device=None: None)
    rc, out, err = _run(capsys, "show", "sinkhorn_fwd", "--shape", "num_tokens=4096")
    assert rc == 1 and "--arch sm_90a" in err and "arch='" not in err
    rc, out, _ = _run(capsys, "show", "sinkhorn_fwd")  # without a shape: the heuristic, said as such
    assert rc == 0 and "heuristic default" in out and "--arch" in out


def test_api_keyword_syntax_becomes_options():
    assert cli.cli_syntax("no CUDA GPU found: pass arch='sm_90a' (or set TKJIT_ARCH)") == \
        "no CUDA GPU found: pass --arch sm_90a (or set TKJIT_ARCH)"
    assert cli.cli_syntax("get it with arch=None (or arch='cpu')") == "get it with --arch None (or --arch cpu)"


# -- compile ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needles", [
    (["compile"], ["missing the kernel NAME", "--shape", "--all-defaults"]),
    (["compile", "sinkhorn_fwd"], ["sinkhorn_fwd needs --shape", "--shape num_tokens="]),
    (["compile", "sinkhorn_fwd", "transpose", "--shape", "num_tokens=4"], ["one kernel NAME", "got 2"]),
    (["compile", "--all-defaults", "--shape", "num_tokens=4"], ["--all-defaults", "no --shape"]),
    (["compile", "sinkhorn_fwd", "--shape", "num_tokens=4", "--arch", "hopper"], ["--arch", "sm_90a"]),
])
def test_compile_says_what_is_missing(cache_dir, capsys, argv, needles):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)


def test_compile_partial_shape_names_the_missing_param(cache_dir, capsys):
    rc, _, err = _run(capsys, "compile", "transpose", "--arch", "cpu", "--shape", "rows=64")
    assert rc == 1 and "missing shape params: cols" in err and "--shape rows=64 cols=" in err


def test_compile_failure_is_one_line_per_kernel(cache_dir, capsys, monkeypatch):
    from tkjit import pool

    source = "RuntimeError: #include <x.h>\nextern \"C\" __global__ void k() {}\nnvcc fatal   : Unsupported arch"

    class Res(tuple):
        built = False

    monkeypatch.setattr(pool, "compile_many", lambda jobs, n: [Res((None, f"CompileError: boom: {source}"))
                                                               for _ in jobs])
    rc, out, err = _run(capsys, "compile", "sinkhorn_fwd", "--arch", "cpu", "--shape", "num_tokens=64")
    assert rc == 1
    (line,) = [ln for ln in out.splitlines() if "FAILED" in ln]
    assert "#include" not in out and "nvcc fatal" in line and "boom" in line
    assert err.startswith("tkjit: error: 1 of 1 kernel(s) failed to compile")


# -- clear ----------------------------------------------------------------------------------------
def _tuned(root: Path) -> tuple[Path, Path]:
    tuned = root / "v1" / "tuned"
    db = tuned / "sm_90a" / "NVIDIA_H200.json"
    db.parent.mkdir(parents=True, exist_ok=True)
    db.write_text('{"schema": 1, "arch": "sm_90a", "gpu": "NVIDIA H200", "entries": []}\n')
    journal = tuned / "journal.log"
    journal.write_text("{}\n" * 10)
    return db, journal


def test_clear_says_what_it_keeps_and_all_removes_it(cache_dir, capsys):
    _fill(cache_dir)
    db, journal = _tuned(cache_dir)
    rc, out, _ = _run(capsys, "clear")
    assert rc == 0 and "removed 4 entries" in out
    assert "kept the tuned DB (1 files" in out and "the tuning journal" in out and "clear --all" in out
    assert db.exists() and journal.exists()
    _fill(cache_dir)
    rc, out, _ = _run(capsys, "clear", "--all")
    assert rc == 0 and "removed 4 entries" in out and "removed the tuned DB (1 files) and the tuning journal" in out
    assert not db.exists() and not journal.exists() and (cache_dir / "v1" / "tuned").is_dir()
    assert Cache(cache_dir).entries() == []
    rc, out, _ = _run(capsys, "clear")
    assert rc == 0 and "no tuned DB or tuning journal" in out


def test_clear_all_removes_links_without_following_them(cache_dir, capsys, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.json").write_text("{}")
    _tuned(cache_dir)
    (cache_dir / "v1" / "tuned" / "sm_80").symlink_to(outside)
    rc, _, err = _run(capsys, "clear", "--all")
    assert rc == 0, err
    assert (outside / "keep.json").exists() and list((cache_dir / "v1" / "tuned").iterdir()) == []


# -- the shared shape parser ----------------------------------------------------------------------
def test_parse_shape_one_syntax():
    want = {"num_tokens": 4096, "n": 4, "dtype": "bfloat16"}
    assert cli.parse_shape(["num_tokens=4096", "n=4", "dtype=bfloat16"]) == want
    assert cli.parse_shape("num_tokens=4096,n=4,dtype=bfloat16") == want
    assert cli.parse_shape(["num_tokens=4096,n=4", "dtype=bfloat16"]) == want
    assert cli.parse_shape(['s="x, y"', "n=1"]) == {"s": "x, y", "n": 1}
    with pytest.raises(UsageError, match="--shape takes key=value, got 'n'"):
        cli.parse_shape(["num_tokens=4", "n"])
    with pytest.raises(UsageError, match="no key"):
        cli.parse_shape(["=4"])


def test_add_shape_arg_is_repeatable():
    import argparse

    ap = argparse.ArgumentParser()
    cli.add_shape_arg(ap)
    args = ap.parse_args(["--shape", "a=1", "b=2", "--shape", "c=3"])
    assert cli.parse_shape(args.shape) == {"a": 1, "b": 2, "c": 3}
    assert ap.parse_args([]).shape == []


# -- exit codes and pipes, every command -----------------------------------------------------------
@pytest.mark.parametrize("argv", [["--help"], ["list", "--help"], ["specs"], ["show", "sinkhorn_fwd"], ["list"],
                                  ["list", "--wide"]])
def test_pipe_into_head_never_prints_a_traceback(cache_dir, argv):
    _fill(cache_dir)
    cmd = " ".join([sys.executable, "-m", "tkjit.cli", *argv])
    r = subprocess.run(["bash", "-c", f"{cmd} | head -1"], cwd=ROOT, env=_env(cache_dir), capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.count("\n") == 1 and r.stderr == "", r.stderr
