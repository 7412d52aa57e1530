"""The built wheel and sdist carry the shipped tuning DB, and an installed tkjit serves it (slow);
without a shipped DB, lookups serve defaults and say once where they looked.

Builds from a copy of the source tree (no build outputs left in the checkout), installs the wheel
into a fresh venv that sees this environment's site-packages (torch, tilelang, optuna come from
there, nothing is downloaded), and runs `tkjit.get` from outside the source tree.
"""

import json
import logging
import os
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = "tkjit/tuning_db_data/sm_90a/NVIDIA_H200.json"
SPECS_DIR = ROOT / "kernel_specs"  # installed and imported as `tkjit_kernels`
# A shape the shipped H200 DB holds (checked against the file below, so a re-tune that drops it says so).
KERNEL, SHAPE = "transpose", {"rows": 4096, "cols": 7168, "dtype": "bfloat16"}
SKIP = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache", ".gpu", "benchmarks"}


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=lambda d, names: [n for n in names if n in SKIP or n.endswith(".egg-info")])
    dist = tmp / "dist"
    env = {**os.environ, "PIP_NO_INDEX": "1"}  # everything the build needs is installed already
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
         env=env)
    _run([sys.executable, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(dist)!r})"], cwd=src)
    (wheel,) = dist.glob("tkjit-*.whl")
    (sdist,) = dist.glob("tkjit-*.tar.gz")
    return tmp, wheel, sdist


def test_shipped_shape_is_in_the_repo_db():
    doc = json.loads((ROOT / SHIPPED).read_text())
    static = {k: v for k, v in SHAPE.items() if k != "rows"}
    assert any(e["kernel"] == KERNEL and e["shape"] == static and e["bucket"] == {"rows": SHAPE["rows"]}
               for e in doc["entries"])


@pytest.mark.slow
def test_wheel_and_sdist_carry_the_shipped_db(built):
    _, wheel, sdist = built
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert SHIPPED in names, sorted(n for n in names if "tuning" in n)
        assert json.loads(z.read(SHIPPED)) == json.loads((ROOT / SHIPPED).read_text())
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert SHIPPED in names, sorted(n for n in names if "tuning" in n)


@pytest.mark.slow
def test_wheel_installs_the_specs_as_tkjit_kernels(built):
    """kernel_specs/ goes into the wheel as `tkjit_kernels` (every spec module), never as a top-level
    `kernel_specs` that another project could own too."""
    _, wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    tops = {n.split("/", 1)[0] for n in names if "/" in n and ".dist-info/" not in n}
    assert tops == {"tkjit", "tkjit_kernels"}, tops
    want = {f"tkjit_kernels/{p.relative_to(SPECS_DIR).as_posix()}" for p in SPECS_DIR.rglob("*.py")}
    assert want <= names, sorted(want - names)


def test_every_package_folder_is_listed_in_pyproject():
    """pyproject lists the packages (the kernel_specs/ -> tkjit_kernels mapping rules out
    `packages.find`): a new package folder left out would be missing from the wheel."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"] == {"tkjit_kernels": "kernel_specs"}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tkjit").rglob("__init__.py")}
    found |= {".".join(("tkjit_kernels", *p.parent.relative_to(SPECS_DIR).parts))
              for p in SPECS_DIR.rglob("__init__.py")}
    assert set(conf["packages"]) == found


@pytest.mark.slow
def test_installed_wheel_serves_the_shipped_config(built, tmp_path):
    tmp, wheel, _ = built
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    py = venv / "bin" / "python"
    # This environment may itself be a venv: its site-packages (torch, tilelang, optuna) go on the new
    # venv's path after the venv's own, as plain entries (so an editable install's finder stays out).
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    (Path(purelib) / "tkjit_test_parent_env.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TKJIT_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONSAFEPATH")}
    env.update(TKJIT_CACHE_DIR=str(tmp_path / "cache"), TKJIT_GPU_NAME="NVIDIA H200")
    work = tmp_path / "elsewhere"
    work.mkdir()
    script = textwrap.dedent(f"""
        import importlib.util, json, tkjit, tkjit_kernels
        k = tkjit.get({KERNEL!r}, {SHAPE!r}, arch="sm_90a")
        print(json.dumps({{"file": tkjit.__file__, "source": k.config_source,
                          "specs_file": tkjit_kernels.__file__,
                          "kernel_specs": importlib.util.find_spec("kernel_specs") is not None,
                          "index": sorted(tkjit_kernels.INDEX),
                          "catalog": [s.name for s in tkjit.all_specs()]}}))
    """)
    r = _run([str(py), "-I", "-c", script], cwd=work, env=env)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    installed = Path(out["file"]).resolve()
    assert ROOT not in installed.parents, f"imported the checkout's tkjit: {installed}"
    assert venv.resolve() in installed.parents, installed
    assert out["source"] == "tuned:shipped", out
    specs = Path(out["specs_file"]).resolve()
    assert venv.resolve() in specs.parents and specs.parent.name == "tkjit_kernels", specs
    assert not out["kernel_specs"], "a top-level kernel_specs package is importable"
    assert set(out["index"]) <= set(out["catalog"]), "the full scan of tkjit_kernels misses INDEX kernels"


def test_no_shipped_db_serves_defaults_and_says_where_it_looked_once(cache_dir, tmp_path, monkeypatch, caplog):
    import tkjit
    from tkjit import tuning_db

    broken = tmp_path / "no-shipped-db"
    monkeypatch.setenv("TKJIT_TUNING_DB", str(broken))
    monkeypatch.setenv("TKJIT_GPU_NAME", "NVIDIA H200")
    monkeypatch.delenv("TKJIT_NO_TUNED_DB", raising=False)
    tuning_db.clear_memo()
    spec = tkjit.get_spec("sinkhorn_fwd")
    full = spec.canonical_shape({"num_tokens": 4096, "n": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.INFO, logger="tkjit"):
            assert tuning_db.lookup(spec, full, "sm_90a") is None
            assert tuning_db.lookup(spec, full, "sm_90a") is None
        assert tuning_db.choose_config(spec, full, "sm_90a", None)[1] == "default"
    said = [r for r in caplog.records if r.name == "tkjit" and "no shipped tuning DB" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    msg = said[0].getMessage()
    assert str(broken / "sm_90a") in msg and "TKJIT_TUNING_DB" in msg and str(tuning_db.user_db_dir()) in msg
