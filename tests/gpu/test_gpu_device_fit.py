"""Cooperative grids against the SM count on the GPU: a config fitted to fewer SMs (TKJIT_NUM_SMS) runs
and is exact, one that does not fit is refused before any launch, and the tuning worker reports the
count `tkjit.get` fits to."""

import pytest
import torch

import tkjit
from tkjit.errors import ConfigError
from tkjit.testing import check

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
SHAPE = {"num_tokens": 65536, "num_topk": 8, "num_groups": 256}


def test_the_gpus_own_count():
    from tkjit.arch import current_arch, device_limits

    assert device_limits(current_arch()) == {"sms": torch.cuda.get_device_properties(0).multi_processor_count}


def test_a_grid_fitted_to_fewer_sms_runs_exact(monkeypatch):
    monkeypatch.setenv("TKJIT_NUM_SMS", "20")
    tkjit.reset()
    k = tkjit.get("group_count", SHAPE)
    assert k.config_source in ("default+fit", "default") and k.config["blocks"] * k.config["threads"] <= 20 * 1024
    for seed in (0, 1):
        assert check(k, SHAPE, seed=seed) is None
    with pytest.raises(ConfigError, match=r"does not fit this GPU \(20 SMs\)"):
        tkjit.get("group_count", SHAPE, config={"layout": "grid", "blocks": 264, "threads": 128, "vec": 2})
    tkjit.reset()


def test_the_tuning_worker_reports_the_count_get_fits_to(monkeypatch):
    from tkjit.tuning.worker import BenchWorker, WorkerSetup

    monkeypatch.setenv("TKJIT_NUM_SMS", "78")
    w = BenchWorker(WorkerSetup(arch="sm_90a"))
    try:
        info = w.start()
    finally:
        w.close()
    assert info["sms"] == 78 and info["arch"] == "sm_90a"
