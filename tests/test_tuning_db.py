"""tkjit.tuning_db: schema validation, lookup order, nearest bucket, GPU-model fallback, writing, malformed files."""

import json
import re

import pytest

import tkjit
from tkjit import tuning_db
from tkjit.errors import TuningDBError
from tkjit.registry import get_spec

SPEC = get_spec("sinkhorn_fwd")
FULL = SPEC.canonical_shape({"num_tokens": 64})
STATIC = {"n": 4, "repeat": 10, "eps": 1e-06}


def entry(bucket, config, **kw):
    e = {
        "kernel": "sinkhorn_fwd", "shape": dict(STATIC), "bucket": {"num_tokens": bucket}, "config": config,
        "tuned_us": 10.0, "default_us": 12.0, "speedup": 1.2, "spread": 0.01,
        "versions": {"tilelang": "0.1.15", "tkjit": "0.1.0"}, "date": "2026-12-02", "gpu": "NVIDIA H200",
    }
    e.update(kw)
    return e


def cfg(bt, th=32, recip=True):
    return {"layout": "thread", "block_tokens": bt, "threads": th, "fast_math": False, "recip": recip}


@pytest.fixture
def dbs(tmp_path, monkeypatch, cache_dir):
    shipped = tmp_path / "shipped"
    monkeypatch.setenv("TKJIT_TUNING_DB", str(shipped))
    monkeypatch.delenv("TKJIT_GPU_NAME", raising=False)
    monkeypatch.delenv("TKJIT_NO_TUNED_DB", raising=False)
    tuning_db.clear_memo()
    return tuning_db.user_db_dir(), shipped


def write(root, arch, model, entries):
    return tuning_db.write_entries(tuning_db.db_path(root, arch, model), entries, arch=arch, gpu=model)


def spec():
    return tkjit.get_spec("sinkhorn_fwd")


def full(tokens):
    return spec().canonical_shape({"num_tokens": tokens, "n": 4})


def test_lookup_order_user_shipped_nearest_none(dbs, monkeypatch):
    user, shipped = dbs
    monkeypatch.setenv("TKJIT_GPU_NAME", "NVIDIA H200")
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") is None
    write(shipped, "sm_90a", "NVIDIA H200", [entry(4096, cfg(64)), entry(65536, cfg(128))])
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") == (cfg(64), "tuned:shipped")
    assert tuning_db.lookup(spec(), full(3000), "sm_90a") == (cfg(64), "tuned:shipped")  # same bucket
    write(user, "sm_90a", "NVIDIA H200", [entry(4096, cfg(256))])
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") == (cfg(256), "tuned:user")
    # 65536 only in shipped: exact shipped beats a nearest user bucket
    assert tuning_db.lookup(spec(), full(65536), "sm_90a") == (cfg(128), "tuned:shipped")
    # 1M: nearest tuned bucket of the same static shape (65536 is 4 octaves away, 4096 is 8)
    assert tuning_db.lookup(spec(), full(1 << 20), "sm_90a") == (
        cfg(128), "tuned:nearest(shipped, num_tokens=65536)")
    # 8192: user 4096 and shipped 4096 tie on distance; the user's wins
    assert tuning_db.lookup(spec(), full(8192), "sm_90a") == (cfg(256), "tuned:nearest(user, num_tokens=4096)")
    # another static shape: nothing
    other = spec().canonical_shape({"num_tokens": 4096, "n": 8})
    assert tuning_db.lookup(spec(), other, "sm_90a") is None
    monkeypatch.setenv("TKJIT_NO_TUNED_DB", "1")
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") is None


def test_gpu_model_file_names_and_fallback(dbs, monkeypatch):
    _, shipped = dbs
    assert tuning_db.file_stem("NVIDIA H200") == "NVIDIA_H200"
    assert tuning_db.file_stem("../../etc/x y") == "_.._etc_x_y"
    p = write(shipped, "sm_90a", "NVIDIA H100 80GB HBM3", [entry(4096, cfg(64))])
    assert p.name == "NVIDIA_H100_80GB_HBM3.json"
    monkeypatch.setenv("TKJIT_GPU_NAME", "NVIDIA H200")  # no file of its own: any file of the arch
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") == (cfg(64), "tuned:shipped")
    monkeypatch.delenv("TKJIT_GPU_NAME")  # CPU-only host, named arch: falls back to the arch's files
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") == (cfg(64), "tuned:shipped")
    assert tuning_db.lookup(spec(), full(4096), "sm_100a") is None
    write(shipped, "sm_90a", "NVIDIA H200", [entry(4096, cfg(128))])
    monkeypatch.setenv("TKJIT_GPU_NAME", "NVIDIA H200")  # its own file first
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") == (cfg(128), "tuned:shipped")


def test_file_is_sorted_diffable_and_merges(dbs):
    user, _ = dbs
    p = write(user, "sm_90a", "G", [entry(65536, cfg(64)), entry(4096, cfg(32))])
    write(user, "sm_90a", "G", [entry(4096, cfg(128))])  # replaces the 4096 entry
    text = p.read_text()
    doc = json.loads(text)
    assert text == json.dumps(doc, indent=1, sort_keys=True) + "\n"
    assert [e["bucket"]["num_tokens"] for e in doc["entries"]] == [4096, 65536]
    assert doc["entries"][0]["config"] == cfg(128)
    assert doc["schema"] == 1 and doc["arch"] == "sm_90a"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["entries"][1].pop("config"), "entry 1 (sinkhorn_fwd"),
        (lambda d: d["entries"][0].update(tuned_us="fast"), "'tuned_us' has the wrong type"),
        (lambda d: d["entries"][0].update(extra=1), "unknown field 'extra'"),
        (lambda d: d["entries"][0].update(bucket={"num_tokens": 0}), "bucket.num_tokens"),
        (lambda d: d["entries"][0]["config"].update(layout=["x"]), "config.layout must be a scalar"),
        (lambda d: d["entries"].append(dict(d["entries"][0])), "duplicates entry 0"),
        (lambda d: d.update(schema=99), "schema 99"),
        (lambda d: d.update(entries={}), "'entries' must be a list"),
        (lambda d: d["entries"][0].update(speedup=float("nan")), "NaN is not allowed"),
    ],
)
def test_bad_files_raise_naming_file_and_entry(dbs, monkeypatch, mutate, message):
    _, shipped = dbs
    monkeypatch.setenv("TKJIT_GPU_NAME", "G")
    p = write(shipped, "sm_90a", "G", [entry(4096, cfg(64)), entry(65536, cfg(64))])
    doc = json.loads(p.read_text())
    mutate(doc)
    p.write_text(json.dumps(doc))
    with pytest.raises(TuningDBError) as ei:
        tuning_db.load_db(p)
    assert str(p) in str(ei.value) and message in str(ei.value)
    with pytest.warns(UserWarning, match=re.escape(message)):  # serving skips the file: see test_tuning_db_hostile
        assert tuning_db.lookup(spec(), full(4096), "sm_90a") is None


def test_not_json_raises(dbs, monkeypatch):
    _, shipped = dbs
    p = shipped / "sm_90a" / "G.json"
    p.parent.mkdir(parents=True)
    p.write_text("{not json")
    monkeypatch.setenv("TKJIT_GPU_NAME", "G")
    with pytest.raises(TuningDBError, match="not valid JSON"):
        tuning_db.load_db(p)


def test_parsed_once_per_process_until_changed(dbs, monkeypatch):
    _, shipped = dbs
    monkeypatch.setenv("TKJIT_GPU_NAME", "G")
    p = write(shipped, "sm_90a", "G", [entry(4096, cfg(64))])
    a = tuning_db.load_db(p)
    assert tuning_db.load_db(p) is a
    write(shipped, "sm_90a", "G", [entry(4096, cfg(128))])
    assert tuning_db.load_db(p) is not a
    assert tuning_db.lookup(spec(), full(4096), "sm_90a")[0] == cfg(128)


@pytest.mark.slow
def test_get_reports_config_source(dbs, monkeypatch):
    """get(...).config_source: user > shipped > nearest > default (one CPU kernel per config)."""
    user, shipped = dbs
    model = tuning_db.gpu_model("cpu")
    shape = {"num_tokens": 1000, "n": 4}
    assert tkjit.get("sinkhorn_fwd", shape, arch="cpu").config_source == "default"
    write(shipped, "cpu", model, [entry(1024, cfg(64))])
    tkjit.reset()
    k = tkjit.get("sinkhorn_fwd", shape, arch="cpu")
    assert (k.config_source, k.config) == ("tuned:shipped", cfg(64))
    write(user, "cpu", model, [entry(1024, cfg(64, recip=False))])
    tkjit.reset()
    k = tkjit.get("sinkhorn_fwd", shape, arch="cpu")
    assert (k.config_source, k.config) == ("tuned:user", cfg(64, recip=False))
    tkjit.reset()
    k = tkjit.get("sinkhorn_fwd", {"num_tokens": 3000, "n": 4}, arch="cpu")
    assert k.config_source == "tuned:nearest(user, num_tokens=1024)"
    # a DB config outside the space (spec changed since): warned, default served
    write(user, "cpu", model, [entry(1024, {**cfg(64), "layout": "gone"})])
    tkjit.reset()
    with pytest.warns(UserWarning, match="ignoring tuned config"):
        k = tkjit.get("sinkhorn_fwd", shape, arch="cpu")
    assert k.config_source == "default"


def test_entry_that_kept_the_default_serves_the_current_default(dbs, monkeypatch, capsys):
    """A study that found nothing better than the default stores the default of that day. After the spec's
    default changes, the entry must not pin the old one: the current default serves (and `db show` says why).
    While it is still the default, the entry serves as tuned."""
    user, shipped = dbs
    monkeypatch.setenv("TKJIT_GPU_NAME", "NVIDIA H200")
    old = cfg(16, th=64)
    assert old != spec().default_config(full(4096), "sm_90a")
    write(shipped, "sm_90a", "NVIDIA H200", [
        entry(4096, old, won=False, default_config=old),
        entry(65536, cfg(128), won=True, default_config=old),  # a win pins its config
    ])
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") is None
    assert tuning_db.choose_config(spec(), full(4096), "sm_90a", None) == (
        spec().default_config(full(4096), "sm_90a"), "default")
    # the exact bucket said "default": the nearest other bucket does not stand in for it
    assert tuning_db.lookup(spec(), full(1 << 20), "sm_90a") == (
        cfg(128), "tuned:nearest(shipped, num_tokens=65536)")
    # an entry without its default_config (or a kept config that differs from it) is served as written
    write(shipped, "sm_90a", "NVIDIA H200", [entry(4096, old, won=False)])
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") == (old, "tuned:shipped")
    write(shipped, "sm_90a", "NVIDIA H200", [entry(4096, old, won=False, default_config=old)])
    from tkjit import cli

    capsys.readouterr()
    assert cli.main(["db", "show", "sinkhorn_fwd", "--shape", "n=4", "num_tokens=4096", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert "(default)" in out and "none beat the default of then" in out, out
    # while the entry's config is still the default, it serves as tuned (the tuning confirmed it)
    now = spec().default_config(full(4096), "sm_90a")
    write(shipped, "sm_90a", "NVIDIA H200", [entry(4096, now, won=False, default_config=now)])
    assert tuning_db.lookup(spec(), full(4096), "sm_90a") == (now, "tuned:shipped")
    assert cli.main(["db", "show", "sinkhorn_fwd", "--shape", "n=4", "num_tokens=4096", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert "(tuned:shipped)" in out and "none beat" not in out, out


MALFORMED_DBS = {
    "not JSON": "{schema: 1",
    "empty": "",
    "not UTF-8": b"\xff\xfe\x00{",
    "a list": "[]",
    "wrong schema": '{"schema": 99, "entries": []}',
    "entries not a list": '{"schema": 1, "entries": {}}',
    "entry not an object": '{"schema": 1, "entries": [3]}',
    "entry missing fields": '{"schema": 1, "entries": [{"kernel": "sinkhorn_fwd"}]}',
}


@pytest.mark.parametrize("what", list(MALFORMED_DBS))
def test_malformed_tuning_db(cache_dir, monkeypatch, what):
    from tkjit import tuning_db
    from tkjit.errors import TuningDBError

    monkeypatch.setenv("TKJIT_TUNING_DB", str(cache_dir.parent / "no-shipped-db"))
    path = tuning_db.user_db_path("cpu", tuning_db.gpu_model("cpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    data = MALFORMED_DBS[what]
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    tuning_db.clear_memo()
    try:  # serving warns once, naming the file, and falls back; tools that read the DB get the error
        with pytest.warns(UserWarning, match=re.escape(str(path))):
            assert tuning_db.choose_config(SPEC, FULL, "cpu", None)[1] == "default"
        with pytest.raises(TuningDBError, match=re.escape(str(path))):
            tuning_db.load_db(path)
        assert tkjit.get("sinkhorn_fwd", {"num_tokens": 64}, arch="cpu").config_source == "default"
    finally:
        tuning_db.clear_memo()
