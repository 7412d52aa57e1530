"""tkjit.key: a new tilelang, nvcc, C compiler, tkjit, artifact format or edited spec never reuses an old binary;
the key is stable across processes, changes with every input and holds no absolute path."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from common import ROOT, SINK  # noqa: E402
from common import subprocess_env as _env  # noqa: E402

import tkjit  # noqa: E402
import tkjit.key as keymod  # noqa: E402
from tkjit import build, key  # noqa: E402
from tkjit.cache import Cache, CorruptEntry  # noqa: E402
from tkjit.registry import get_spec  # noqa: E402

SPEC = get_spec("sinkhorn_fwd")
FULL = SPEC.canonical_shape({"num_tokens": 64})
STATIC = SPEC.static_shape(FULL)


def _key(arch: str, spec=SPEC, cfg=None) -> str:
    cfg = cfg or SPEC.default_config(FULL, arch)
    return build.entry_key(spec, STATIC, cfg, arch)[0]


@pytest.mark.parametrize(
    "arch, attr, new",
    [
        ("cpu", "tilelang_version", lambda: "0.1.16"),
        ("sm_90a", "tilelang_version", lambda: "0.2.0"),
        ("sm_90a", "nvcc_version", lambda: "13.9.1"),
        ("cpu", "host_cc_version", lambda: "gcc (GCC) 15.1.0"),
        ("cpu", "__version__", "0.2.0"),
        ("sm_90a", "__version__", "0.1.1"),
        ("cpu", "ARTIFACT_FORMAT", 99),
        ("sm_100a", "ARTIFACT_FORMAT", 99),
    ],
)
def test_toolchain_change_changes_the_key(monkeypatch, arch, attr, new):
    before = _key(arch)
    assert _key(arch) == before  # stable
    monkeypatch.setattr(keymod, attr, new)
    after = _key(arch)
    assert after != before


def test_nvcc_version_matters_not_its_path(monkeypatch):
    versions = {"/usr/local/cuda/bin/nvcc": "12.8.93", "/opt/cuda/bin/nvcc": "12.8.93", "/opt/new/bin/nvcc": "13.0.1"}
    monkeypatch.setattr(keymod, "nvcc_version_of", lambda path: versions[path])
    keys = {}
    for path in versions:
        monkeypatch.setattr(keymod, "nvcc_path", lambda p=path: p)
        keys[path] = _key("sm_90a")
    assert keys["/usr/local/cuda/bin/nvcc"] == keys["/opt/cuda/bin/nvcc"]  # a copied install still hits
    assert keys["/opt/new/bin/nvcc"] != keys["/opt/cuda/bin/nvcc"]


def test_edited_spec_source_changes_the_key():
    edited = replace(SPEC, source_hash="f" * 16)
    assert _key("cpu", edited) != _key("cpu")
    assert _key("sm_90a", edited) != _key("sm_90a")


def test_every_key_input_matters():
    base = _key("cpu")
    cfg = SPEC.default_config(FULL, "cpu")
    assert _key("sm_90a") != base
    other_cfg = [c for c in SPEC.configs(FULL, "cpu") if c != cfg][0]
    assert _key("cpu", cfg=other_cfg) != base
    assert build.entry_key(SPEC, {**STATIC, "repeat": 11}, cfg, "cpu")[0] != base
    assert build.entry_key(SPEC, {**STATIC, "eps": 1e-7}, cfg, "cpu")[0] != base


def test_entry_of_an_old_toolchain_is_not_served_even_under_a_colliding_key(tmp_path, monkeypatch):
    """Defence in depth: the manifest's toolchain is checked against what is running now."""
    from reliability import fake_build

    cfg = SPEC.default_config(FULL, "cpu")
    key, material = build.entry_key(SPEC, STATIC, cfg, "cpu")
    meta = {"kernel": SPEC.name, "shape": STATIC, "config": cfg, "arch": "cpu",
            "toolchain": material["toolchain"], "spec_source": SPEC.source_hash}
    cache = Cache(tmp_path / "c")
    cache.get_or_build(key, meta, fake_build(key))
    monkeypatch.setattr(keymod, "tilelang_version", lambda: "9.9.9")
    new_tc = keymod.toolchain("cpu")
    with pytest.raises(CorruptEntry, match="toolchain"):
        cache.verify(key, {**meta, "toolchain": new_tc})
    calls = []
    cache.get_or_build(key, {**meta, "toolchain": new_tc}, fake_build(key, calls))
    assert calls == [key]


# -- key material --------------------------------------------------------------------------------
def _mkey(**over):
    spec = tkjit.get_spec("sinkhorn_fwd")
    full = spec.canonical_shape(SINK)
    args = dict(name=spec.name, source_hash=spec.source_hash, static_shape=spec.static_shape(full),
                config=spec.default_config(full), pass_configs={"x": 1}, arch="sm_90a")
    args.update(over)
    return key.key_of(key.key_material(**args))


def test_key_is_stable_across_processes():
    code = "import tkjit, tests.test_key as t; print(t._mkey())"
    outs = {
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env("/tmp/unused"), capture_output=True,
                       text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert outs == {_mkey()}


def test_any_input_change_gives_a_new_key(monkeypatch):
    base = _mkey()
    variants = [
        _mkey(name="other"), _mkey(source_hash="0" * 16), _mkey(static_shape={"n": 8, "repeat": 10, "eps": 1e-6}),
        _mkey(config={"layout": "smem"}), _mkey(pass_configs={"x": 2}), _mkey(arch="sm_100a"),
    ]
    assert len({base, *variants}) == len(variants) + 1
    for fn, value in [("tilelang_version", "9.9.9"), ("nvcc_version", "99.0")]:
        monkeypatch.setattr(key, fn, lambda v=value: v)
        assert _mkey() != base
        monkeypatch.undo()
    monkeypatch.setattr(key, "__version__", "9.9")
    assert _mkey() != base


def test_key_has_no_absolute_paths(cache_dir):
    material = json.dumps(key.key_material("s", "h", {}, {}, {}, "sm_90a"))
    assert str(cache_dir) not in material and "/work" not in material and "/usr" not in material


def _fake_nvcc(bin_dir, version, log):
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho ran >> {log}\necho "Cuda compilation tools, release X, V{version}"\n')
    nvcc.chmod(0o755)
    return str(nvcc)


def test_nvcc_version_from_the_wheel_record_without_running_it(tmp_path):
    from tkjit.key import nvcc_version_of

    log = tmp_path / "ran.log"
    # A toolkit assembled from the nvcc wheels (records in <home>/dist-info), and a pip install
    # (site-packages/nvidia/cu13/bin/nvcc beside site-packages/nvidia_cuda_nvcc-X.dist-info).
    merged = _fake_nvcc(tmp_path / "cuda" / "bin", "1.0.0", log)
    (tmp_path / "cuda" / "dist-info" / "nvidia_cuda_nvcc-13.0.88.dist-info").mkdir(parents=True)
    site = tmp_path / "site-packages"
    pip = _fake_nvcc(site / "nvidia" / "cu13" / "bin", "1.0.0", log)
    (site / "nvidia_cuda_nvcc-13.1.2.dist-info").mkdir()
    (site / "torch-2.11.0.dist-info").mkdir()
    assert nvcc_version_of(merged) == "13.0.88" and nvcc_version_of(pip) == "13.1.2"
    assert not log.exists()  # neither was started
    # Two records do not say which nvcc this is: it is asked.
    (site / "nvidia_cuda_nvcc_cu12-12.8.93.dist-info").mkdir()
    other = _fake_nvcc(site / "nvidia" / "cuda_nvcc" / "bin", "12.8.93", log)
    assert nvcc_version_of(other) == "12.8.93" and log.read_text().split() == ["ran"]
