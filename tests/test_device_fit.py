"""Cooperative grids fit the GPU they run on: a spec's `device_constraint` against the SM count
(`tkjit.arch.device_limits`: TKJIT_NUM_SMS, else the current GPU's) when a config is chosen."""

import subprocess
import sys

import pytest

from tkjit import tuning_db
from tkjit.arch import device_limits
from tkjit.errors import ConfigError
from tkjit.registry import get_spec

GFM = get_spec("get_fused_mapping")
GFM_FULL = GFM.canonical_shape(
    {"num_tokens": 8192, "num_expanded_tokens": 131072, "num_topk": 8, "num_experts": 256, "alignment": 64})
GC = get_spec("group_count")
GC_FULL = GC.canonical_shape({"num_tokens": 65536, "num_topk": 8, "num_groups": 256})
WIDE = {"threads": 1024, "blocks": 132, "count": "match", "reduce": "loop", "pad": "after"}  # 1024 threads x 132 SMs


@pytest.fixture
def user_db(tmp_path, monkeypatch, cache_dir):
    monkeypatch.setenv("TKJIT_TUNING_DB", str(tmp_path / "shipped"))  # no shipped entries
    monkeypatch.setenv("TKJIT_GPU_NAME", "NVIDIA H200")
    monkeypatch.delenv("TKJIT_NO_TUNED_DB", raising=False)
    monkeypatch.delenv("TKJIT_NUM_SMS", raising=False)
    tuning_db.clear_memo()
    return tuning_db.user_db_dir()


def tuned(root, config):
    e = {"kernel": "get_fused_mapping", "shape": GFM.static_shape(GFM_FULL), "bucket": GFM.bucket(GFM_FULL),
         "config": config, "tuned_us": 10.0, "default_us": 12.0, "speedup": 1.2, "spread": 0.01,
         "versions": {"tilelang": "0.1.15", "tkjit": "0.1.0"}, "date": "2026-12-05", "gpu": "NVIDIA H200"}
    tuning_db.write_entries(tuning_db.db_path(root, "sm_90a", "NVIDIA H200"), [e], arch="sm_90a", gpu="NVIDIA H200")


def test_limits_come_from_the_env_else_the_gpu(monkeypatch):
    monkeypatch.delenv("TKJIT_NUM_SMS", raising=False)
    assert device_limits("cpu") is None
    assert device_limits("sm_90a") is None  # no GPU here: the specs' own H200 bounds apply
    monkeypatch.setenv("TKJIT_NUM_SMS", "78")
    assert device_limits("sm_90a") == {"sms": 78}
    assert device_limits("cpu") is None
    for bad in ("0", "many", "-3"):
        monkeypatch.setenv("TKJIT_NUM_SMS", bad)
        with pytest.raises(ConfigError, match="TKJIT_NUM_SMS"):
            device_limits("sm_90a")


def test_an_h200_sized_tuned_config_is_not_served_on_fewer_sms(user_db, monkeypatch):
    tuned(user_db, WIDE)
    assert tuning_db.choose_config(GFM, GFM_FULL, "sm_90a", None) == (WIDE, "tuned:user")
    monkeypatch.setenv("TKJIT_NUM_SMS", "132")
    assert tuning_db.choose_config(GFM, GFM_FULL, "sm_90a", None) == (WIDE, "tuned:user")
    monkeypatch.setenv("TKJIT_NUM_SMS", "114")  # an H100 PCIe: 132 blocks of 1024 threads cannot all be resident
    cfg, source = tuning_db.choose_config(GFM, GFM_FULL, "sm_90a", None)
    # the default (512 threads, reduce="unroll": one block an SM) does not fit 114 SMs either: its nearest that does
    assert source == "default+fit" and cfg != GFM.default_config(GFM_FULL, "sm_90a")
    assert not GFM.device_constraint(GFM_FULL, cfg, {"sms": 114})


def test_an_explicit_config_that_does_not_fit_is_refused_by_name(user_db, monkeypatch):
    assert tuning_db.choose_config(GFM, GFM_FULL, "sm_90a", WIDE) == (WIDE, "explicit")
    monkeypatch.setenv("TKJIT_NUM_SMS", "78")
    with pytest.raises(ConfigError, match=r"does not fit this GPU \(78 SMs\).*blocks=132 > 78 SMs"):
        tuning_db.choose_config(GFM, GFM_FULL, "sm_90a", WIDE)


def test_a_default_that_does_not_fit_becomes_the_nearest_config_that_does(user_db, monkeypatch):
    default = GC.default_config(GC_FULL, "sm_90a")
    assert default["blocks"] * default["threads"] > 20 * 1024
    monkeypatch.setenv("TKJIT_NUM_SMS", "20")
    cfg, source = tuning_db.choose_config(GC, GC_FULL, "sm_90a", None)
    assert source == "default+fit"
    # Every tunable but the grid kept; the largest grid that fits (not the first in the space: 1 block).
    assert cfg == {**default, "blocks": 132} and cfg["blocks"] * cfg["threads"] <= 20 * 1024


def test_specs_without_a_device_constraint_ignore_the_sm_count(user_db, monkeypatch):
    spec = get_spec("sinkhorn_fwd")
    full = spec.canonical_shape({"num_tokens": 4096})
    monkeypatch.setenv("TKJIT_NUM_SMS", "1")
    assert tuning_db.choose_config(spec, full, "sm_90a", None) == (spec.default_config(full, "sm_90a"), "default")


def test_db_show_says_what_a_smaller_gpu_is_served(user_db, monkeypatch):
    monkeypatch.setenv("TKJIT_NUM_SMS", "20")
    r = subprocess.run([sys.executable, "-m", "tkjit.cli", "db", "show", "group_count", "--arch", "sm_90a",
                        "--shape", "num_tokens=65536", "num_topk=8", "num_groups=256"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "blocks=132" in r.stdout and "(default+fit)" in r.stdout and "heuristic default" in r.stdout


def test_tuning_on_a_smaller_gpu_measures_only_what_it_can_launch(user_db):
    import optuna
    from helpers.fakes import TableEvaluator

    from tkjit.tuning import config_id, tune

    class SmallGPU(TableEvaluator):
        def device_info(self):
            return {"gpu": "Small GPU", "arch": "sm_90a", "sms": 20}

    ev = SmallGPU(lambda c: 100.0 / c["blocks"] + c["threads"] / 1000)  # the widest grids are fastest
    r = tune(GC, GC_FULL, arch="sm_90a", evaluator=ev, storage=optuna.storages.InMemoryStorage(),
             mode="exhaustive")
    fits = [c for c in GC.configs(GC_FULL, "sm_90a") if not GC.device_constraint(GC_FULL, c, {"sms": 20})]
    assert set(ev.benched) == {config_id(c) for c in fits} and len(fits) < len(GC.configs(GC_FULL, "sm_90a"))
    assert ev.benched[0] == config_id({**GC.default_config(GC_FULL, "sm_90a"), "blocks": 132})  # the served default
    assert r.config["blocks"] * r.config["threads"] <= 20 * 1024


def test_a_config_tuned_before_tunables_were_added_is_still_served(user_db):
    """An entry written before the space gained tunables (`KernelSpec.added`: get_fused_mapping's count, reduce,
    pad) is served with their values of before, not dropped for the default; one with a key the space never had
    is still refused (a warning, the default)."""
    old = {"threads": 1024, "blocks": 66}
    tuned(user_db, old)
    cfg, source = tuning_db.choose_config(GFM, GFM_FULL, "sm_90a", None)
    assert source == "tuned:user" and cfg == {**old, "count": "match", "reduce": "loop", "pad": "after"}
    assert tuning_db.neighbour_configs(GFM, GFM_FULL, "sm_90a")[0] == cfg
    tuned(user_db, {**old, "warps": 4})
    tuning_db.clear_memo()
    with pytest.warns(UserWarning, match="ignoring tuned config"):
        assert tuning_db.choose_config(GFM, GFM_FULL, "sm_90a", None)[1] == "default"


def test_a_bundle_ships_the_tuned_entry_of_before_the_added_tunables(user_db, tmp_path):
    """`tkjit bundle export` pairs an old entry with the binary `get` serves for it (its config with the added
    tunables filled in), so the importing host serves that binary instead of compiling or falling back."""
    from tkjit.bundle import _selecting_tuned
    from tkjit.cache import Entry

    old = {"threads": 1024, "blocks": 66}
    tuned(user_db, old)
    served = tuning_db.choose_config(GFM, GFM_FULL, "sm_90a", None)[0]
    built = Entry("k" * 64, tmp_path, {"meta": {"kernel": "get_fused_mapping", "shape": GFM.static_shape(GFM_FULL),
                                                "config": served}})
    picked = _selecting_tuned("sm_90a", [built])
    assert [t["config"] for t in picked] == [old]


def test_the_unrolled_reduction_takes_one_block_an_sm():
    """reduce="unroll" holds its block-count loads in registers (86 a thread at 512 threads: one 512-thread block an
    SM): 132 such blocks launch on 132 SMs, not on an H100 PCIe's 114, where the rolled loop's 54 registers leave
    room for two a SM."""
    unrolled = {"threads": 512, "blocks": 132, "count": "match", "reduce": "unroll", "pad": "after"}
    assert GFM.device_constraint(GFM_FULL, unrolled, {"sms": 132}) is None
    assert "resident" in GFM.device_constraint(GFM_FULL, unrolled, {"sms": 114})
    assert GFM.device_constraint(GFM_FULL, {**unrolled, "reduce": "loop"}, {"sms": 114}) is None
    assert GFM.device_constraint(GFM_FULL, {**unrolled, "blocks": 66}, {"sms": 114}) is None
