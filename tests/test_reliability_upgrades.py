"""A new tilelang, nvcc, C compiler, tkjit, artifact format or edited spec never reuses an old binary."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

import tkjit.key as keymod  # noqa: E402
from tkjit import build  # noqa: E402
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
