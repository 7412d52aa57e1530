"""The real tuning loop on TileLang's C target (no GPU): compile pool, isolated bench worker,
correctness gate, timing, journal, DB write; then a fresh process serves the tuned config."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tkjit.tuning import LocalEvaluator, config_id, open_storage, tune

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _env(cache_dir, **extra):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "gpu")]),
            "TKJIT_CACHE_DIR": str(cache_dir), **extra}


def test_pretune_cpu_then_fresh_process_serves_it(tmp_path):
    cache_dir = tmp_path / "cache"
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[defaults]\ntrials = 4\n\n[[study]]\nkernel = "sinkhorn_fwd"\nshape = { n = 4, num_tokens = 1000 }\n\n'
        '[[study]]\nkernel = "no_such_kernel"\nshape = { n = 4 }\n'
    )
    out_json = tmp_path / "out.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "pretune.py"), "--manifest", str(manifest), "--arch", "cpu",
         "--max-configs", "4", "--jobs", "2", "--json", str(out_json), "--quiet", "--bench-budget", "0.02"],
        env=_env(cache_dir), capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no_such_kernel" in r.stderr  # skipped with a warning
    assert "sinkhorn_fwd" in r.stdout and "% copy" in r.stdout
    res = json.loads(out_json.read_text())["results"]
    assert len(res) == 1 and res[0]["trials"] == 4 and res[0]["new_trials"] == 4
    assert res[0]["bucket"] == {"num_tokens": 1024}
    tuned = res[0]["config"]
    (db,) = (cache_dir / "v1" / "tuned" / "cpu").glob("*.json")
    doc = json.loads(db.read_text())
    (entry,) = doc["entries"]
    assert entry["config"] == tuned and entry["kernel"] == "sinkhorn_fwd" and entry["tuned_us"] > 0
    assert (cache_dir / "v1" / "tuned" / "journal.log").stat().st_size > 0

    code = (
        "import json, tkjit\n"
        "k = tkjit.get('sinkhorn_fwd', num_tokens=777, n=4, arch='cpu')\n"
        "print(json.dumps([k.config_source, k.config]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_env(cache_dir), capture_output=True, text=True,
                         check=True, timeout=120).stdout
    source, config = json.loads(out.strip().splitlines()[-1])
    assert source == "tuned:user" and config == tuned

    # Resume: the same run again measures nothing new.
    r2 = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "pretune.py"), "--manifest", str(manifest), "--arch", "cpu",
         "--max-configs", "4", "--jobs", "2", "--json", str(out_json), "--quiet", "--bench-budget", "0.02"],
        env=_env(cache_dir), capture_output=True, text=True, timeout=300,
    )
    assert r2.returncode == 0, r2.stderr
    assert json.loads(out_json.read_text())["results"][0]["new_trials"] == 0


def test_planted_wrong_crashing_and_hanging_configs_never_win(tmp_path, monkeypatch):
    monkeypatch.setenv("TKJIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "helpers"))  # fakes: the spawned worker imports it
    import tkjit

    tkjit.reset()
    c = {name: {"variant": v, "block": b} for name, v, b in [
        ("default", "good", 128), ("fast_good", "good2", 128), ("hang", "good2", 64),
        ("wrong", "wrong", 64), ("segv", "segv", 64)]}
    table = {config_id(c["wrong"]): 1.0, config_id(c["segv"]): 2.0, config_id(c["hang"]): 3.0,
             config_id(c["fast_good"]): 50.0}
    with LocalEvaluator("cpu", jobs=2, imports=["planted_specs"], timer="fakes:FakeTimer",
                        timer_kwargs={"table": table, "hang": [config_id(c["hang"])]}, timeout_s=8) as ev:
        r = tune("planted_scale", {"n": 3000}, arch="cpu", evaluator=ev, storage=f"journal:{tmp_path}/j.log",
                 only=list(c.values()))
        assert ev.worker.restarts >= 2  # the segfault and the hang each cost a worker
    assert r.config == c["fast_good"] and r.won and r.speedup == pytest.approx(2.0)
    kinds = {cid: why.split(":")[0] for cid, why in r.failed.items()}
    assert kinds == {config_id(c["wrong"]): "wrong", config_id(c["segv"]): "crash", config_id(c["hang"]): "timeout"}
    assert r.trials == 5
    # Each measured trial records where the worker's time went (load, fresh-input check, gate, timing).
    import optuna

    done = [t for t in optuna.load_study(study_name=r.study, storage=open_storage(f"journal:{tmp_path}/j.log"))
            .get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 2
    for t in done:
        assert set(t.user_attrs["phases"]) == {"load_s", "check_s", "gate_s", "time_s"}
        assert all(v >= 0 for v in t.user_attrs["phases"].values())
    tkjit.reset()


def test_a_study_whose_reference_outlasts_a_candidates_time_limit_measures_every_candidate(tmp_path, monkeypatch):
    """The worker drew a study's inputs and reference inside its first candidate's job, under the candidate's time
    limit: a reference slower than that (mhc_multilayer_recompute's, minutes on the CPU) made the job a "hang", the
    worker was replaced and drew them again for the next candidate, and every candidate failed (62 s each on an
    H100 host). The study's data is now a job of its own, under a longer limit, drawn once."""
    monkeypatch.setenv("TKJIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    import planted_specs

    import tkjit

    tkjit.reset()
    configs = [{"variant": v, "block": b} for v in ("good", "good2") for b in (64, 128)]
    n = 3 << 20  # (its bucket: 4M) > SLOW_REFERENCE_N; the fresh-input check shrinks it to that or below
    assert n > planted_specs.SLOW_REFERENCE_N
    with LocalEvaluator("cpu", jobs=2, imports=["planted_specs"], timeout_s=planted_specs.SLOW_REFERENCE_S / 2,
                        budget_s=0.02) as ev:
        r = tune("planted_slow_reference", {"n": n}, arch="cpu", evaluator=ev, storage=f"journal:{tmp_path}/j.log",
                 only=configs)
        assert ev.worker.restarts == 0
    assert r.failed == {} and r.trials == len(configs)
    tkjit.reset()


def test_a_run_cut_short_keeps_the_winners_of_the_studies_it_finished(tmp_path, monkeypatch):
    """Winners are written as each study ends: a pretune killed in its second study (here an interrupt,
    on the GPU host a time limit) still leaves the first study's winner in the DB."""
    import tkjit.tuning as tuning
    from tkjit.tuning.pretune import PretuneOptions, run_studies

    monkeypatch.setenv("TKJIT_CACHE_DIR", str(tmp_path / "cache"))
    real, calls = tuning.tune, []

    def tune_then_interrupt(*a, **kw):
        calls.append(a[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(tuning, "tune", tune_then_interrupt)
    studies = [{"kernel": "sinkhorn_fwd", "shape": {"n": 4, "num_tokens": 1000}},
               {"kernel": "sinkhorn_fwd", "shape": {"n": 4, "num_tokens": 5000}}]
    opts = PretuneOptions(arch="cpu", max_configs=2, jobs=1, bench_budget_s=0.02, progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_studies(studies, opts)
    assert len(calls) == 2
    (db,) = (tmp_path / "cache" / "v1" / "tuned" / "cpu").glob("*.json")
    (entry,) = json.loads(db.read_text())["entries"]
    assert entry["kernel"] == "sinkhorn_fwd" and entry["bucket"] == {"num_tokens": 1024}


def test_a_worker_closed_before_it_started_is_stopped_at_once():
    """`tkjit tune` spawns the bench worker first (it imports torch and starts CUDA while the CLI reads the
    specs): a run that then stops on a bad study must not wait for that start."""
    import time

    from tkjit.tuning.worker import BenchWorker, WorkerSetup

    w = BenchWorker(WorkerSetup(arch="cpu"))
    w.spawn()
    proc = w._proc
    t0 = time.perf_counter()
    w.close()
    assert time.perf_counter() - t0 < 2.0 and not proc.is_alive()
    w = BenchWorker(WorkerSetup(arch="cpu"))  # spawn, then start: the same worker, up
    w.spawn()
    pid = w._proc.pid
    try:
        assert w.start()["pid"] == pid
    finally:
        w.close()


def test_check_reference_computed_once_a_seed(tmp_path, monkeypatch):
    """The candidates' correctness check: a study draws a few seeds (tuner.CHECK_SEEDS) and the worker keeps each
    seed's inputs and reference, so a candidate's check costs its own run, not the CPU reference again; a wrong
    candidate still fails it, with the seed and the config named."""
    import tkjit.testing
    from tkjit.tuning import tuner
    from tkjit.tuning.worker import WorkerSetup, _Child

    monkeypatch.setenv("TKJIT_CACHE_DIR", str(tmp_path))
    calls = []
    real = tkjit.testing.reference_outputs

    def counted(spec, full, inputs):
        calls.append(full["num_tokens"])
        return real(spec, full, inputs)

    monkeypatch.setattr(tkjit.testing, "reference_outputs", counted)
    child = _Child(WorkerSetup(arch="cpu", budget_s=0.005))
    shape = {"num_tokens": 300, "n": 4, "repeat": 3, "eps": 1e-6}
    spec = child.tkjit.get_spec("sinkhorn_fwd")
    config = spec.default_config(spec.canonical_shape(shape), "cpu")
    for seed in (11, 12, 11, 12, 11):
        reply = child.bench({"kernel": "sinkhorn_fwd", "shape": shape, "config": config, "arch": "cpu", "seed": seed})
        assert reply["ok"], reply
    assert len(calls) == 3  # the study's timing inputs once, then once per seed
    assert tuner.CHECK_SEEDS >= 2

    def wrong(spec, full, inputs):  # a reference the kernel cannot match, for a seed not seen yet
        return tuple(r + 1 for r in real(spec, full, inputs))

    monkeypatch.setattr(tkjit.testing, "reference_outputs", wrong)
    reply = child.bench({"kernel": "sinkhorn_fwd", "shape": shape, "config": config, "arch": "cpu", "seed": 13})
    assert not reply["ok"] and reply["kind"] == "wrong" and "seed 13" in reply["error"], reply


def test_timed_runs_of_an_in_place_kernel_leave_the_study_inputs_as_drawn(monkeypatch):
    """An in-place kernel (mhc_pre_norm_fn_bwd adds into x_grad) changes its inputs on every timed run. Those
    runs used the study's inputs themselves, so every candidate after the first failed its gate on inputs the
    earlier candidates had changed ("timing inputs: x_grad: relative error 1.389e+01", 29 of 30 configs of
    each mhc_pre_norm_fn_bwd study on an H100). Now each candidate's timed runs change copies of their own."""
    import torch

    from tkjit.spec import KernelSpec, Runtime, TensorArg, Tolerance
    from tkjit.tuning.worker import WorkerSetup, _Child

    spec = KernelSpec(
        name="accumulate_probe", family="test", doc="", params=(Runtime("n"),),
        space={"variant": (0, 1)}, default=lambda s: {"variant": 0}, constraint=lambda s, c: None,
        build=lambda s, c: None,
        inputs=(TensorArg("x", "float32", ("n",)), TensorArg("acc", "float32", ("n",), inout=True)),
        outputs=(TensorArg("y", "float32", ("n",)),),
        make_inputs=lambda s, device="cpu", seed=0: (torch.arange(s["n"], dtype=torch.float32),
                                                     torch.ones(s["n"])),
        reference=lambda s, x, acc: (acc + x, 2 * x), tolerance=Tolerance(exact=True),
        bytes_moved=lambda s: 0, examples=({"n": 8},), source_hash="x",
    )

    class Kernel:  # the real worker path around it; the kernel itself is what a C-target build cannot be
        def __init__(self, config: dict) -> None:
            self.spec, self.config, self.key = spec, config, str(config)
            self.shape = spec.canonical_shape({"n": 8})

        def __call__(self, x, acc, out):
            acc += x
            out[0].copy_(2 * x)

    child = _Child(WorkerSetup(arch="cpu", budget_s=0.002))
    monkeypatch.setattr(child.tkjit, "get_spec", lambda name: spec)
    monkeypatch.setattr(child, "_kernel", lambda name, shape, config, arch: Kernel(config))
    for variant in (0, 1, 0):
        reply = child.bench({"kernel": spec.name, "shape": {"n": 8}, "config": {"variant": variant}, "arch": "cpu"})
        assert reply["ok"] and reply["n"] > 1, reply
    inputs, _ = child._study_data(spec, spec.canonical_shape({"n": 8}))
    assert torch.equal(inputs[1], torch.ones(8))  # as drawn, after hundreds of timed runs
