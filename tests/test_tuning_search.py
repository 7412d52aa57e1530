"""Search logic of the tuner with fake evaluators: no compiler, no kernels, fast."""

import json
import sys
from pathlib import Path

import optuna
import pytest

from tkjit.tuning import Space, config_id, tune

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

from fakes import TableEvaluator, fake_spec, synthetic_table  # noqa: E402
from tool_loader import SCRIPTS, load_tool  # noqa: E402

SPACE = {"block": (32, 64, 128, 256), "threads": (32, 64, 128), "unroll": (False, True)}


def constraint(shape, c):
    return "threads > block" if c["threads"] > c["block"] else None


DEFAULT = {"block": 128, "threads": 64, "unroll": False}


@pytest.fixture
def spec():
    return fake_spec(SPACE, default=DEFAULT, constraint=constraint)


def table_for(spec, fast=None, slow_default=2.0):
    """Every combo (allowed or not) gets a time; `fast` config ids are much faster."""
    import itertools

    out = {}
    for i, combo in enumerate(itertools.product(*SPACE.values())):
        cfg = dict(zip(SPACE, combo))
        out[config_id(cfg)] = 100.0 + i
    out[config_id(DEFAULT)] = 100.0 * slow_default
    for cid, us in (fast or {}).items():
        out[cid] = us
    return out


def mem():
    return optuna.storages.InMemoryStorage()


def test_default_first_and_exhaustive_covers_all_allowed(spec):
    ev = TableEvaluator(table_for(spec))
    r = tune(spec, {"num_tokens": 5000}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem())
    allowed = {config_id(c) for c in spec.configs({"num_tokens": 8192}, "sm_90a")}
    assert r.mode == "exhaustive"
    assert ev.compiled[0] == config_id(DEFAULT)
    assert ev.benched[0] == config_id(DEFAULT)
    assert set(ev.compiled) == allowed and len(ev.compiled) == len(allowed)
    assert r.trials == len(allowed)
    assert r.bucket == {"num_tokens": 8192}  # 5000 tunes as its power-of-two bucket
    best = min(allowed, key=lambda c: ev._time(json.loads(c)))
    assert config_id(r.config) == best and r.won and r.speedup > 1.5


def test_invalid_configs_never_compiled_in_tpe(spec):
    ev = TableEvaluator(table_for(spec))
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem(), mode="tpe",
             trials=12, seed=3)
    allowed = {config_id(c) for c in spec.configs({"num_tokens": 4096}, "sm_90a")}
    assert ev.compiled and set(ev.compiled) <= allowed
    assert len(ev.compiled) == len(set(ev.compiled)) == 12  # nothing measured twice; pruned not counted
    assert ev.compiled[0] == config_id(DEFAULT)
    assert r.trials == 12


def test_tpe_proposals_that_repeat_or_break_the_constraints_are_not_stored(spec, tmp_path):
    """Regression: TPE in a small space mostly proposes configs already measured or refused by the
    constraints; each was a stored trial (a row, its params and attributes) that nothing measured: the
    session-20 fleet run's 43-config study wrote 331 of them beside its 43 (its tuner time through SQLite, table
    timings on the CPU host: 8.4-13.7 s, now 2.9-3.0). The sampler now proposes in memory; the shared study
    holds measured configs only."""
    storage = f"sqlite:///{tmp_path}/s.db"
    ev = TableEvaluator(table_for(spec))
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=storage, mode="tpe",
             trials=16, seed=3)
    assert r.pruned_invalid > 0  # the sampler did propose refused configs
    stored = optuna.load_study(study_name=r.study, storage=storage).get_trials(deepcopy=False)
    assert len(stored) == r.trials == len(set(ev.benched)) == 16
    assert {t.state for t in stored} == {optuna.trial.TrialState.COMPLETE}


def test_planted_wrong_and_crashing_configs_never_win(spec):
    wrong = config_id({"block": 256, "threads": 32, "unroll": True})
    crash = config_id({"block": 64, "threads": 64, "unroll": True})
    ev = TableEvaluator(table_for(spec, {wrong: 1.0, crash: 2.0}), wrong=[wrong], crash=[crash])
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem())
    assert config_id(r.config) not in (wrong, crash)
    assert config_id(r.best_config) not in (wrong, crash)
    assert r.failed[wrong].startswith("wrong") and r.failed[crash].startswith("crash")
    assert all(wrong not in f and crash not in f for f in ev.retimed)


def test_compile_failures_fail_their_trial_only(spec):
    bad = config_id({"block": 32, "threads": 32, "unroll": True})
    ev = TableEvaluator(table_for(spec, {bad: 1.0}), compile_fail=[bad])
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem())
    assert bad not in ev.benched and r.failed[bad].startswith("compile")
    assert config_id(r.config) != bad


def test_winner_within_noise_keeps_the_default(spec):
    near = config_id({"block": 256, "threads": 128, "unroll": False})
    t = table_for(spec, slow_default=1.0)  # default 100 us
    for k in t:
        t[k] = max(t[k], 101.0)
    t[config_id(DEFAULT)] = 100.0
    t[near] = 99.0  # 1% faster: noise
    ev = TableEvaluator(t)
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem())
    assert config_id(r.best_config) == near
    assert r.config == DEFAULT and not r.won and r.speedup == 1.0


def test_resume_in_process_measures_nothing_twice(spec, tmp_path):
    storage = f"journal:{tmp_path}/j.log"
    ev = TableEvaluator(table_for(spec))
    r1 = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=storage, trials=5)
    assert r1.trials == 5 and len(ev.benched) == 5
    r2 = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=storage)
    assert len(ev.benched) == len(set(ev.benched)) == r2.trials
    assert r2.new_trials == r2.trials - 5
    # --no-resume starts over
    ev3 = TableEvaluator(table_for(spec))
    r3 = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev3, storage=storage, resume=False,
              trials=3)
    assert r3.new_trials == 3 == len(ev3.benched)


def test_time_budget_stops_between_batches(spec):
    ev = TableEvaluator(table_for(spec), delay_s=0.05)
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem(), batch=2,
             time_budget=0.15)
    allowed = spec.configs({"num_tokens": 4096}, "sm_90a")
    assert 2 <= r.trials < len(allowed)


def test_space_encoding_roundtrip(spec):
    s = Space(spec, {"num_tokens": 4096}, "sm_90a")
    for c in s.allowed:
        params = s.to_params(c)
        assert isinstance(params["block_index"], int) and params["block_index"] < 4  # TPE: an ordinal index
        assert params["unroll"] in (False, True)
    s.ordinal = False  # an exhaustive study: the real values
    for c in s.allowed:
        assert s.to_params(c) == c
    s2 = Space(spec, {"num_tokens": 4096}, "sm_90a", max_configs=3)
    assert len(s2) == 3 and s2.is_allowed(DEFAULT)


def test_exhaustive_measures_the_defaults_neighbours_first(spec):
    """An exhaustive study cut short by its time budget has measured what is nearest the default (a study of
    mhc_pre_norm_fn_bwd measured its other layout's configs, listed first, and none of the default's own
    layout's, where the winner was)."""
    ev = TableEvaluator(table_for(spec))
    tune(spec, {"num_tokens": 5000}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem())
    searched = list(dict.fromkeys(ev.compiled))
    distance = [sum(json.loads(c)[k] != v for k, v in DEFAULT.items()) for c in searched]
    assert distance[0] == 0 and distance == sorted(distance) and distance[-1] > 1


def test_sampler_reaches_exhaustive_best_with_30pct_of_trials():
    sampler_eval = load_tool("sampler_eval", SCRIPTS)

    spec = fake_spec(sampler_eval.SYNTHETIC_SPACE, constraint=sampler_eval.synthetic_constraint)
    table = synthetic_table(sampler_eval.SYNTHETIC_SPACE, seed=1)
    res = sampler_eval.evaluate(spec, {"num_tokens": 4096}, table, frac=0.3, seeds=3, tol=0.02)
    assert res["allowed"] >= 200
    assert res["budget"] <= 0.3 * res["allowed"]
    assert all(r["trials"] <= res["budget"] for r in res["runs"])
    assert res["within_tol"] >= 2, res


def test_two_workers_share_a_study(spec, tmp_path):
    """Two tuners on one storage split the work: together they cover the space, mostly without overlap."""
    import threading

    storage = f"journal:{tmp_path}/shared.log"
    evs = [TableEvaluator(table_for(spec), delay_s=0.1) for _ in range(2)]
    results = [None, None]

    def run(i):
        results[i] = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=evs[i], storage=storage,
                          batch=2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results), "a worker raised (see the thread exception above)"
    allowed = {config_id(c) for c in spec.configs({"num_tokens": 4096}, "sm_90a")}
    benched = evs[0].benched + evs[1].benched
    assert set(benched) == allowed
    # Racing asks may measure a config twice; two unshared studies would measure everything twice.
    assert len(benched) <= 1.5 * len(allowed)
    assert evs[0].benched and evs[1].benched
    # A third run on the finished study measures nothing and serves the global best.
    ev = TableEvaluator(table_for(spec))
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=storage)
    assert r.new_trials == 0 and not ev.benched
    assert config_id(r.config) == min(allowed, key=lambda c: ev._time(json.loads(c)))


def _second_worker_while_first_measures(spec, storage, first_batch: int, second_batch: int, **kw):
    """Two workers on one study: the first starts (bench delay 0.05 s a config) and, once its batch's trials are
    RUNNING, the second runs to its end. Returns both results (or the exception each raised) and evaluators."""
    import threading
    import time

    evs = {"first": TableEvaluator(table_for(spec), delay_s=0.05), "second": TableEvaluator(table_for(spec))}
    results: dict[str, object] = {}

    def run(name, batch):
        try:
            results[name] = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=evs[name],
                                 storage=storage, batch=batch, **kw)
        except Exception as e:  # noqa: BLE001  (the callers' assertions name it)
            results[name] = e

    first = threading.Thread(target=run, args=("first", first_batch))
    first.start()
    deadline = time.time() + 30
    while not evs["first"].benched and time.time() < deadline:  # its trials are RUNNING once it measures
        time.sleep(0.01)
    run("second", second_batch)
    first.join()
    for name, r in results.items():
        assert not isinstance(r, Exception), (name, r)
    return results, evs


def test_a_worker_whose_configs_another_holds_waits_for_them(spec, tmp_path):
    """Regression: two workers starting together pick the same first configs; the later one's batch is all
    dups, and without a heartbeat (a journal) it stopped at once: no trial of its own finished, so it raised
    "no config passed the correctness gate". Here the first worker holds every config RUNNING when the second
    starts: the second waits for them and serves the study's best."""
    results, evs = _second_worker_while_first_measures(spec, f"journal:{tmp_path}/shared.log", 100, 2)  # (first:
    # one batch, the whole space)
    assert not evs["second"].benched  # it measured nothing twice
    assert results["second"].config == results["first"].config


def test_workers_sharing_a_study_stop_at_its_budget(spec, tmp_path):
    """Regression: a worker sized its batch by the configs measured so far, not counting those other workers
    were measuring: two workers on a 43-config budget measured 58 distinct configs (the session-20 fleet
    run). Here the first holds its whole 12-config budget RUNNING when the second (same budget) starts: the
    second measures nothing and serves the study's best."""
    results, evs = _second_worker_while_first_measures(spec, f"journal:{tmp_path}/shared.log", 12, 4, mode="tpe",
                                                       trials=12, seed=1)
    assert len(set(evs["first"].benched) | set(evs["second"].benched)) == 12
    assert not evs["second"].benched
    assert results["second"].config == results["first"].config


def test_a_trial_is_stored_with_its_owner_from_the_start(spec, tmp_path, monkeypatch):
    """Regression: a trial was asked first and given its owner after, and a second tuner of the same process
    that loaded the study in between took it for one left by a killed run and failed it (the first then
    raised UpdateFinishedTrialError). A trial is now created RUNNING with its config, owner, host and pid in
    one write: no reader ever sees it without them."""
    from optuna.storages import JournalStorage

    storage = f"journal:{tmp_path}/shared.log"
    seen: list[dict] = []
    real = JournalStorage.create_new_trial

    def create_new_trial(self, study_id, template_trial=None):
        trial_id = real(self, study_id, template_trial)
        seen.append(dict(self.get_trial(trial_id).user_attrs))  # what any other reader sees at this moment
        return trial_id

    monkeypatch.setattr(JournalStorage, "create_new_trial", create_new_trial)
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=TableEvaluator(table_for(spec)),
             storage=storage)
    assert len(seen) == r.trials == len(spec.configs({"num_tokens": 4096}, "sm_90a"))
    assert all({"config", "owner", "host", "pid"} <= a.keys() for a in seen), seen[0]


def test_a_worker_never_takes_a_trial_another_worker_enqueued(spec, tmp_path):
    """Regression: the tuner enqueued a config and called `ask`, which pops the oldest WAITING trial, another
    worker's as well as its own; on SQLite that pop is not exclusive, so two workers held one trial and the one
    that told it second raised UpdateFinishedTrialError (session 21's two-worker fleet run on one GPU). A
    WAITING trial here (another worker's, between its enqueue and its ask) is left alone, and its config is
    still measured once, under a trial of this worker's own."""
    from tkjit.tuning.tuner import open_storage

    storage = f"sqlite:///{tmp_path}/s.db"
    n = len(spec.configs({"num_tokens": 4096}, "sm_90a"))
    ev = TableEvaluator(table_for(spec))
    tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=storage, trials=1)
    store = open_storage(storage)
    (name,) = optuna.get_all_study_names(store)
    study = optuna.load_study(study_name=name, storage=store)
    other = next(c for c in spec.configs({"num_tokens": 4096}, "sm_90a") if config_id(c) not in ev.benched)
    study.enqueue_trial(dict(other), user_attrs={"config": config_id(other)})
    ev2 = TableEvaluator(table_for(spec))
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev2, storage=storage)
    assert r.trials == n and sorted(ev.benched + ev2.benched) == sorted(set(ev.benched + ev2.benched))
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["config"] for t in waiting] == [config_id(other)]  # still the other worker's


def test_a_config_whose_worker_keeps_dying_is_given_up(spec, tmp_path):
    """Optuna fails a dead worker's RUNNING trial (no heartbeat) and its config is measured again by the next
    batch; after MAX_DEATHS such failures the config is recorded failed ("killed"), not retried forever."""
    from tkjit.tuning.tuner import MAX_DEATHS, open_storage

    storage = f"sqlite:///{tmp_path}/s.db"
    ev = TableEvaluator(table_for(spec))
    tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=storage, trials=1)
    store = open_storage(storage)
    (name,) = optuna.get_all_study_names(store)
    study = optuna.load_study(study_name=name, storage=store)
    victims = [c for c in spec.configs({"num_tokens": 4096}, "sm_90a") if config_id(c) not in ev.benched][:2]
    for c, deaths in ((victims[0], MAX_DEATHS), (victims[1], MAX_DEATHS - 1)):
        for _ in range(deaths):  # as fail_stale_trials leaves them: FAIL, no kind of the tuner's
            study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL,
                                                      user_attrs={"config": config_id(c)}))
    ev2 = TableEvaluator(table_for(spec))
    tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev2, storage=storage)
    assert config_id(victims[0]) not in ev2.benched  # given up
    assert config_id(victims[1]) in ev2.benched  # retried


def test_trials_left_running_by_a_failed_run_are_retried(spec, tmp_path):
    storage = f"journal:{tmp_path}/j.log"

    class Boom(TableEvaluator):
        def bench(self, *a, **k):
            if len(self.benched) == 3:
                raise KeyboardInterrupt
            return super().bench(*a, **k)

    ev = Boom(table_for(spec))
    with pytest.raises(KeyboardInterrupt):
        tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=storage)
    ev2 = TableEvaluator(table_for(spec))
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev2, storage=storage)
    assert r.trials == len(spec.configs({"num_tokens": 4096}, "sm_90a"))
    assert not set(ev.benched[:3]) & set(ev2.benched)


def test_warm_start_configs_are_measured_right_after_the_default(spec):
    """Given warm-start configs are benched after the heuristic default and before any sampler proposal;
    one outside the space (threads > block) is dropped, not compiled."""
    fast = {"block": 256, "threads": 128, "unroll": True}
    other = {"block": 64, "threads": 32, "unroll": True}
    ev = TableEvaluator(table_for(spec, fast={config_id(fast): 10.0}))
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem(), mode="tpe",
             trials=6, warm_start=[fast, {"block": 32, "threads": 128, "unroll": False}, other])
    assert ev.benched[:3] == [config_id(DEFAULT), config_id(fast), config_id(other)]
    assert config_id({"block": 32, "threads": 128, "unroll": False}) not in ev.compiled
    assert config_id(r.config) == config_id(fast)


def test_warm_start_takes_the_winners_of_neighbouring_shapes_from_the_tuned_db(spec, tmp_path, monkeypatch):
    """A study at 65536 tokens starts from the winner tuned at 4096 (the user DB), nearest bucket first."""
    from tkjit import tuning_db

    monkeypatch.setenv("TKJIT_CACHE_DIR", str(tmp_path))
    tuning_db.clear_memo()
    fast = {"block": 256, "threads": 128, "unroll": True}
    ev = TableEvaluator(table_for(spec, fast={config_id(fast): 10.0}))
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem(), warm_start=False)
    assert r.won and config_id(r.config) == config_id(fast)
    path = tuning_db.user_db_path("sm_90a", "G")
    tuning_db.write_entries(path, [r.db_entry()], arch="sm_90a", gpu="G")
    assert tuning_db.neighbour_configs(spec, {"num_tokens": 65536}, "sm_90a") == [fast]

    ev2 = TableEvaluator(table_for(spec, fast={config_id(fast): 10.0}))
    tune(spec, {"num_tokens": 65536}, arch="sm_90a", gpu="G", evaluator=ev2, storage=mem(), mode="tpe", trials=4)
    assert ev2.benched[:2] == [config_id(DEFAULT), config_id(fast)]
    ev3 = TableEvaluator(table_for(spec, fast={config_id(fast): 10.0}))
    tune(spec, {"num_tokens": 65536}, arch="sm_90a", gpu="G", evaluator=ev3, storage=mem(), mode="tpe", trials=4,
         warm_start=False)
    assert ev3.benched[0] == config_id(DEFAULT)


def test_sampler_eval_reports_trials_to_the_best_with_and_without_warm_start():
    """The replay tool's warm-start comparison (the H200 figure comes from measured tables): on a
    synthetic landscape whose neighbour shape is the same landscape with more noise, starting from the
    neighbour's winner needs at most half the trials to come within 2% of the best."""
    sampler_eval = load_tool("sampler_eval", SCRIPTS)

    spec = fake_spec(sampler_eval.SYNTHETIC_SPACE, constraint=sampler_eval.synthetic_constraint)
    table = synthetic_table(sampler_eval.SYNTHETIC_SPACE, seed=1)
    neighbour = synthetic_table(sampler_eval.SYNTHETIC_SPACE, seed=1, noise=0.03)
    w = sampler_eval.warm_start_eval(spec, {"num_tokens": 4096}, table, neighbour, top=2, seeds=3)
    m = w["median_trials_to_tol"]
    assert len(w["warm"]) == 2
    assert m["warm"] <= 3 and m["warm"] * 2 <= m["cold"], m
    assert all(r["trials_to_tol"] is None or r["trials_to_tol"] <= r["trials"] for r in w["cold"]["runs"])


def test_each_bench_after_the_first_may_stop_early_above_1_5x_the_best_so_far(spec):
    """The tuner asks the timer to stop early on a config clearly slower than the best so far."""
    from tkjit.tuning.tuner import EARLY_STOP

    ev = TableEvaluator(table_for(spec))
    tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage=mem(), warm_start=False)
    assert ev.stops[0] is None  # nothing measured yet: the default gets the full budget
    best = ev._time(json.loads(ev.benched[0]))
    for cid, stop in zip(ev.benched[1:], ev.stops[1:]):
        assert stop == pytest.approx(best * EARLY_STOP)
        best = min(best, ev._time(json.loads(cid)))


def test_perf_counter_timer_stops_after_a_few_runs_when_clearly_slower():
    import time

    from tkjit.timing import EARLY_RUNS, PerfCounterTimer

    def run():
        time.sleep(0.002)

    timer = PerfCounterTimer(warmup=0, min_reps=10, max_reps=50)
    early = timer.measure(run, budget_s=0.05, context={"stop_above_us": 500.0})
    full = timer.measure(run, budget_s=0.05, context={"stop_above_us": 1e6})
    assert len(early) == EARLY_RUNS and len(full) >= 10
    assert len(timer.measure(run, budget_s=0.05, context={})) >= 10


@pytest.mark.parametrize("kind", ["journal:", "sqlite:///"])
def test_a_storage_in_a_folder_not_made_yet_is_opened(spec, tmp_path, kind):
    """Regression: `--storage sqlite:///DIR/a.db` with DIR missing was "internal error: OperationalError: unable
    to open database file"; its folder is made, as a journal's is."""
    storage = f"{kind}{tmp_path}/new/folder/s.{'log' if kind == 'journal:' else 'db'}"
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=TableEvaluator(table_for(spec)),
             storage=storage, trials=2)
    assert r.trials == 2
