"""The content-addressed cache key: everything that can change the binary, and nothing else.

No absolute paths go in, so a cache copied to another install still hits.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tkjit import envs
from tkjit.canon import canonical_json
from tkjit.version import ARTIFACT_FORMAT, __version__


@functools.lru_cache(maxsize=1)
def tilelang_version() -> str:
    """The installed tilelang's version, without importing it (that takes seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("tilelang")
    if spec is None or not spec.submodule_search_locations:
        return "none"
    site = Path(next(iter(spec.submodule_search_locations))).parent
    # The dist-info beside the package answers in microseconds; importlib.metadata scans sys.path.
    found = sorted(site.glob("tilelang-*.dist-info"))
    if len(found) == 1:
        return found[0].name[len("tilelang-"): -len(".dist-info")]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tilelang")
    except PackageNotFoundError:
        return "none"


def nvcc_path() -> str | None:
    explicit = envs.NVCC.get()
    if explicit:
        return explicit
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


@functools.lru_cache(maxsize=4)
def nvcc_version_of(path: str | None) -> str:
    """The version of the nvcc at path ('none' without one): what the key records of a compiler."""
    if path is None:
        return "none"
    # A toolkit's version.json, or a pip install's nvcc package record, answers in microseconds; `nvcc
    # --version` takes a process start (milliseconds of every fresh process's first `get`).
    home = Path(os.path.realpath(path)).parent.parent
    try:
        data = json.loads((home / "version.json").read_text())
        return str(data["cuda_nvcc"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = _nvcc_dist_version(home)
    if found:
        return found
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "none"
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


_DIST_RE = re.compile(r"nvidia_cuda_nvcc(?:_cu\d+)?-(\d+\.\d+\.\d+)\.dist-info")


def _nvcc_dist_version(home: Path) -> str | None:
    """The version of the nvcc wheel that installed the toolkit at home: its dist-info sits in
    home/dist-info (a toolkit assembled from the wheels) or in the site-packages holding home
    (nvidia/cu13 or nvidia/cuda_nvcc). One record only: two would not say which nvcc this is."""
    for where in (home / "dist-info", home.parent.parent):
        try:
            names = [m.group(1) for e in os.scandir(where) if (m := _DIST_RE.fullmatch(e.name))]
        except OSError:
            continue
        if len(names) == 1:
            return names[0]
    return None


def nvcc_version() -> str:
    return nvcc_version_of(nvcc_path())


@functools.lru_cache(maxsize=1)
def host_cc_version() -> str:
    try:
        out = subprocess.run(["gcc", "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0] if out else "none"
    except (OSError, subprocess.SubprocessError):
        return "none"


PINNABLE = ("nvcc", "tilelang")  # what a serving host may lack, and take from the cache's pinned record


def toolchain(arch: str, pinned: Callable[[], Mapping[str, str]] | None = None) -> dict[str, str]:
    """Compiler identities for arch: these version strings are part of every key.

    pinned: gives the versions recorded for arch by `tkjit bundle import` (Cache.pinned_toolchain); asked
    only when this host reads one of PINNABLE as "none". A GPU host that only serves has no nvcc (or no
    TileLang): such a version is then the build host's, so the keys are the ones the bundle's entries
    were published under. A host with its own compiler keys on its own versions (and compiles what they
    do not match)."""
    tc = {"tilelang": tilelang_version(), "tkjit": __version__, "format": str(ARTIFACT_FORMAT)}
    if arch == "cpu":
        tc["cc"] = host_cc_version()
        tc["machine"] = platform.machine()
    else:
        tc["nvcc"] = nvcc_version()
        launcher = launcher_of(arch)
        if launcher != "tvm_ffi":  # (recorded only when not the original one: those keys are unchanged)
            tc["launcher"] = launcher
    missing = [k for k in PINNABLE if tc.get(k) == "none"] if arch != "cpu" else []
    if missing and pinned is not None:
        record = pinned()
        for k in missing:
            if isinstance(record.get(k), str):
                tc[k] = record[k]
    return tc


def launcher_of(arch: str) -> str:
    """How arch's kernels are built and launched (tkjit.loader names the loader of each): the C target's
    own C ABI, or for CUDA the one TKJIT_LAUNCHER picks. Part of the key: each builds another library."""
    return "ctypes" if arch == "cpu" else envs.launcher()


def key_material(
    name: str, source_hash: str, static_shape: dict, config: dict, pass_configs: dict, arch: str,
    pinned: Callable[[], Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    return {
        "spec": name,
        "spec_source": source_hash,
        "static_shape": static_shape,
        "config": config,
        "pass_configs": pass_configs,
        "arch": arch,
        "toolchain": toolchain(arch, pinned),
    }


def key_of(material: dict[str, Any]) -> str:
    blob = canonical_json(material)  # its format is pinned: every cache and tuned DB is keyed on it
    return hashlib.sha256(blob.encode()).hexdigest()[:40]
