"""One Optuna study per (kernel, static shape, runtime bucket, arch, GPU model).

    result = tune("sinkhorn_fwd", {"num_tokens": 65536, "n": 4}, arch="sm_90a")

Search: small spaces (<= exhaustive_max allowed configs) are enumerated, nearest the heuristic default first
(so a study its time budget cuts short has searched the default's neighbourhood), large ones use TPE over
ordinal encodings of the tunables. The heuristic default is always the first trial. A suggested
config the constraints reject is pruned before compiling and not counted; a config already
measured is not measured again. Candidates compile in parallel batches, then run one at a time in
the isolated bench worker (correctness gate, then timing). Each trial is written to the study's
storage as it finishes (a journal file in the cache by default), so a killed run resumes where it
stopped. The finalists are re-timed interleaved at the end; a winner within noise of the default is
"no win" and the default is kept.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import socket
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from tkjit.canon import canonical_json
from tkjit.registry import get_spec
from tkjit.spec import KernelSpec
from tkjit.tuning.space import Space, config_id

log = logging.getLogger("tkjit.tuning")

EVAL_FAILS = ("compile", "wrong", "crash", "timeout", "error")  # a measured config that failed
EXHAUSTIVE_MAX = 64
EARLY_STOP = 1.5  # a config whose first timed runs are this much slower than the best so far stops early
CHECK_SEEDS = 4  # seeds of the candidates' correctness check a study draws (the worker keeps their references)
_LIVE_OWNERS: set[str] = set()  # tuners running in this process (their RUNNING trials are not stale)


# ----------------------------------------------------------------------------------------------
# evaluators
# ----------------------------------------------------------------------------------------------
class Evaluator(Protocol):
    def compile(self, spec: KernelSpec, static: dict, configs: list[dict], arch: str) -> list[str | None]:
        """Compile (and publish) each config; an error message per config, None when it built."""

    def bench(self, spec: KernelSpec, full: dict, config: dict, arch: str, seed: int,
              stop_above_us: float | None = None) -> dict:
        """{"ok": True, "us": median} or {"ok": False, "kind": ..., "error": ...}. stop_above_us: the
        timing may stop after a few runs whose median is above it (the config is clearly slower)."""

    def retime(self, spec: KernelSpec, full: dict, configs: list[dict], arch: str) -> list[dict]:
        """Interleaved re-timing: per config {"ok", "us", "spread"}."""


class LocalEvaluator:
    """The real one: a persistent compile pool plus the isolated bench worker."""

    def __init__(
        self,
        arch: str,
        *,
        jobs: int | None = None,
        timer: str | None = None,
        timer_kwargs: Mapping[str, Any] | None = None,
        imports: Sequence[str] = (),
        timeout_s: float = 60.0,
        study_timeout_s: float = 1800.0,
        budget_s: float | None = None,
        retime_rounds: int = 5,
        copy_at_start: bool = False,
    ) -> None:
        import importlib

        from tkjit.pool import CompilePool
        from tkjit.tuning.worker import BenchWorker, WorkerSetup

        for m in imports:  # the parent needs the specs too (registration, constraints)
            importlib.import_module(m)
        setup = WorkerSetup(arch=arch, timer=timer, timer_kwargs=dict(timer_kwargs or {}), imports=tuple(imports),
                            copy_at_start=copy_at_start)
        if budget_s is not None:
            setup.budget_s = budget_s
        self.arch = arch
        self.pool = CompilePool(jobs, imports)
        self.worker = BenchWorker(setup, timeout_s=timeout_s)
        self.retime_rounds = retime_rounds
        # A study's inputs and reference are drawn by a job of their own under study_timeout_s, not inside its first
        # candidate's (timeout_s): a slow reference there was a "hang" that replaced the worker, which drew it again
        # for the next candidate, and so on (every candidate of mhc_multilayer_recompute's studies, 62 s each).
        self.study_timeout_s = study_timeout_s

    def device_info(self) -> dict[str, Any]:
        return self.worker.start()

    def compile(self, spec, static, configs, arch):
        return [err for _, err in self.pool.compile([(spec.name, static, c, arch, "tuning") for c in configs])]

    def compile_iter(self, spec, static, configs, arch):
        """Errors in order, each as its compile finishes (benchmarks overlap the later compiles)."""
        for _, err in self.pool.compile_iter([(spec.name, static, c, arch, "tuning") for c in configs]):
            yield err

    def _study_data(self, spec, full) -> dict[str, Any] | None:
        """Have the worker hold this study's inputs and reference (it keeps the current study's: drawn once a
        worker, an immediate reply after); None when it does, else the failed reply, which the candidate about
        to run takes as its own."""
        r = self.worker.request({"op": "study", "kernel": spec.name, "shape": full}, timeout_s=self.study_timeout_s)
        if not r.get("ok"):
            return {**r, "error": f"drawing the study's inputs and reference: {r.get('error', '')}"}
        return None

    def bench(self, spec, full, config, arch, seed, stop_above_us=None):
        from tkjit.tuning.worker import bench_job

        fail = self._study_data(spec, full)
        if fail is not None:
            return fail
        return self.worker.request(bench_job(spec.name, full, config, arch, seed, stop_above_us=stop_above_us))

    def retime(self, spec, full, configs, arch):
        from tkjit.tuning.worker import retime_job

        fail = self._study_data(spec, full)
        if fail is not None:
            return [fail] * len(configs)
        r = self.worker.request(retime_job(spec.name, full, configs, arch, self.retime_rounds),
                                timeout_s=self.worker.timeout_s * max(1, len(configs)))
        if not r.get("ok"):
            return [r] * len(configs)
        return r["results"]

    def copy_bandwidth_gbps(self) -> float | None:
        r = self.worker.request({"op": "copy_bw"})
        return r.get("gbps") if r.get("ok") else None

    def close(self) -> None:
        self.worker.close()
        self.pool.close()

    def __enter__(self) -> LocalEvaluator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------
@dataclass
class TuneResult:
    kernel: str
    shape: dict[str, Any]  # static shape
    bucket: dict[str, Any]
    arch: str
    gpu: str
    config: dict[str, Any]  # the one to serve (the default when the winner was within noise)
    default_config: dict[str, Any]
    tuned_us: float | None
    default_us: float | None
    speedup: float | None
    spread: float
    won: bool
    best_config: dict[str, Any]  # fastest measured, even when not adopted
    trials: int  # distinct configs measured (this run and resumed ones)
    new_trials: int  # measured by this run
    failed: dict[str, str] = field(default_factory=dict)  # config id -> reason
    pruned_invalid: int = 0
    elapsed_s: float = 0.0  # the search (before the finalists are re-timed)
    retime_s: float = 0.0  # re-timing the finalists
    study: str = ""
    mode: str = ""
    full_shape: dict[str, Any] = field(default_factory=dict)
    spec_source: str = ""
    # where the search's seconds went (this run): proposing and claiming configs (the sampler and the storage),
    # waiting on their compiles, the bench worker (loading, checking, gating, timing each), telling the storage
    search_phases: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def db_entry(self) -> dict[str, Any]:
        from tkjit.tuning_db import make_entry

        return make_entry(self)


def study_identity(spec: KernelSpec, static: Mapping, bucket: Mapping, arch: str, gpu: str,
                   versions: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything a study's trials depend on. Workers share a study only when all of it matches:
    timings from another spec source, compiler or GPU model are not comparable."""
    return {"kernel": spec.name, "spec_source": spec.source_hash, "static": dict(static), "bucket": dict(bucket),
            "arch": arch, "gpu": gpu, "versions": dict(versions or {})}


def study_name(spec: KernelSpec, static: Mapping, bucket: Mapping, arch: str, gpu: str,
               versions: Mapping[str, str] | None = None) -> str:
    """A short name readable in optuna-dashboard, unique per identity through a hash of all of it:
    `sinkhorn_fwd n=4 repeat=10 num_tokens~1024 on cpu (cpu-x86_64) #1a2b3c4d5e`.
    The identity itself is in the study's user attributes (see `study_identity`)."""
    import hashlib

    ident = study_identity(spec, static, bucket, arch, gpu, versions)
    digest = hashlib.sha256(canonical_json(ident).encode()).hexdigest()[:10]
    words = [f"{k}={v}" for k, v in dict(static).items()] + [f"{k}~{v}" for k, v in dict(bucket).items()]
    return f"{spec.name} {' '.join(words)} on {arch} ({gpu}) #{digest}".replace("  ", " ")


def default_storage() -> Any:
    """The journal in the user's cache: `<cache>/v1/tuned/journal.log`."""
    import optuna

    from tkjit.build import cache

    c = cache()
    c.ensure()
    path = c.base / "tuned" / "journal.log"
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))


HEARTBEAT_S = 10  # RDB storages: a worker's heartbeat interval; its trials are failed after 3x this silent
MAX_DEATHS = 3  # a config whose trial was left RUNNING by a dead worker this often is recorded failed, not retried
STALL_S = 600  # storages without a heartbeat: how long a worker waits on others' trials that make no progress
RDB_SCHEMES = ("sqlite", "postgresql", "mysql")


def _rdb_url(url: str) -> str:
    """postgresql:// means psycopg 3 (what `tkjit[distributed]` installs); SQLAlchemy's own default for
    it is psycopg2. A URL naming its driver (postgresql+psycopg2://) is kept as given."""
    scheme, sep, rest = url.partition("://")
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+psycopg{sep}{rest}"
    return url


def _check_driver(url: str) -> None:
    scheme = url.partition("://")[0]
    driver = scheme.partition("+")[2]
    if scheme.startswith("postgresql") and driver in ("psycopg", ""):
        mod, extra = "psycopg", "tkjit[distributed]"
    elif scheme.startswith("postgresql") and driver == "psycopg2":
        mod, extra = "psycopg2", "psycopg2-binary"
    else:
        return
    import importlib.util

    if importlib.util.find_spec(mod) is None:
        from tkjit.errors import TkjitError

        raise TkjitError(f"storage {scheme}:// needs the {mod} driver: pip install '{extra}'")


def open_storage(storage: Any = None, *, heartbeat_s: int | None = HEARTBEAT_S) -> Any:
    """None: the cache's journal; journal:PATH (or a .log path): a journal file; an RDB URL
    (sqlite:///PATH, postgresql://user@host/db, mysql://...): Optuna's RDBStorage, with its heartbeat
    so the RUNNING trials of a worker that died are failed and retried by the others within
    3 * heartbeat_s (None: no heartbeat). Any other object is taken as an Optuna storage."""
    if storage is None:
        return default_storage()
    if not isinstance(storage, str):
        return storage
    if storage.startswith("journal:") or storage.endswith(".log"):
        import optuna
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        path = storage.removeprefix("journal:")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))
    if storage.partition("://")[0].partition("+")[0] in (*RDB_SCHEMES, "postgres"):
        import optuna

        url = _rdb_url(storage)
        _check_driver(url)
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            # as for a journal: the file's folder is made (SQLite makes only the file)
            os.makedirs(os.path.dirname(os.path.abspath(url.removeprefix("sqlite:///"))), exist_ok=True)
        kw: dict[str, Any] = {}
        with warnings.catch_warnings():
            # The heartbeat and its retry callback have been "experimental" since Optuna 2.8/2.9.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if heartbeat_s:
                # No retry callback: its WAITING copy of a stale trial is for `ask` to pop, and the tuner
                # never pops (see _Study._ask). A stale trial's config is untried again, so the next batch of
                # any worker measures it; _load gives up on a config after MAX_DEATHS such failures.
                kw = dict(heartbeat_interval=int(heartbeat_s), grace_period=3 * int(heartbeat_s))
            return _rdb_storage(url, kw)
    from tkjit.errors import UsageError

    raise UsageError(f"unknown storage {storage!r}: journal:PATH, sqlite:///PATH or postgresql://USER@HOST/DB")


def _rdb_storage(url: str, kw: dict[str, Any]) -> Any:
    """RDBStorage, retried: workers started together on an empty database all create Optuna's tables,
    and the losers of that race get a duplicate-key error from the server (the tables then exist), or
    from SQLite "table ... already exists" / "database is locked"."""
    import optuna
    import sqlalchemy.exc

    races = (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError)
    if url.startswith("sqlite"):
        races += (sqlalchemy.exc.OperationalError,)
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url), **kw)
        except races:
            if attempt == 4:
                raise
            time.sleep(0.2 + random.random() * 0.5)
    raise AssertionError("unreachable")


def _engine_kwargs(url: str) -> dict[str, Any]:
    # Each worker holds a few connections at most (its loop, the heartbeat thread): a small pool, and
    # pre-ping so a connection the server dropped (restart, idle timeout) is replaced, not raised.
    if url.startswith("sqlite"):
        return {}
    return {"pool_size": 2, "max_overflow": 2, "pool_pre_ping": True}


def heartbeat_enabled(storage: Any) -> bool:
    """An RDB storage opened with a heartbeat interval (what Optuna's own check tests)."""
    get = getattr(storage, "get_heartbeat_interval", None)
    return callable(get) and get() is not None


class _Heartbeat:
    """Records the heartbeat of this tuner's RUNNING trials. Optuna's own heartbeat thread runs inside
    `Study.optimize`, one per trial; the tuner asks and tells itself (batches of trials in flight at
    once), so one thread beats for all of them through the storage's `record_heartbeat`."""

    def __init__(self, storage: Any) -> None:
        import threading

        self.storage = storage
        self.interval = storage.get_heartbeat_interval()
        self.live: set[int] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tkjit-heartbeat", daemon=True)
        self.thread.start()

    def add(self, trial_id: int) -> None:
        self.storage.record_heartbeat(trial_id)  # at once: a RUNNING trial without one is never stale
        with self.lock:
            self.live.add(trial_id)

    def done(self, trial_id: int) -> None:
        with self.lock:
            self.live.discard(trial_id)

    def _loop(self) -> None:
        while not self.stop.wait(self.interval):
            with self.lock:
                ids = sorted(self.live)
            for tid in ids:
                try:
                    self.storage.record_heartbeat(tid)
                except Exception as e:  # a DB hiccup: the next beat retries; the grace is 3 beats
                    log.warning("heartbeat of trial %d failed: %s", tid, e)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tuning_shape(spec: KernelSpec, shape: Mapping[str, Any]) -> tuple[dict, dict, dict]:
    """(full shape at the bucket's own size, static shape, bucket): a study times its bucket's size."""
    full = spec.canonical_shape(shape)
    bucket = spec.bucket(full)
    at = dict(full)
    at.update(bucket)
    try:
        at = spec.canonical_shape(at)
    except Exception:
        at = full
    return at, spec.static_shape(full), bucket


# ----------------------------------------------------------------------------------------------
# the study loop
# ----------------------------------------------------------------------------------------------
def tune(
    kernel: str | KernelSpec,
    shape: Mapping[str, Any],
    *,
    arch: str,
    gpu: str | None = None,
    evaluator: Evaluator | None = None,
    storage: Any = None,
    trials: int | None = None,
    time_budget: float | None = None,
    exhaustive_max: int = EXHAUSTIVE_MAX,
    mode: str = "auto",
    batch: int | None = None,
    seed: int = 0,
    resume: bool = True,
    only: Sequence[Mapping[str, Any]] | None = None,
    max_configs: int | None = None,
    finalists: int = 4,
    min_gain: float = 0.02,
    progress: Callable[[int, int, float | None], None] | None = None,
    study_prefix: str = "",
    warm_start: bool | Sequence[Mapping[str, Any]] = True,
) -> TuneResult:
    """Tune one study; see the module doc. `trials` counts distinct measured configs.

    `storage`: an Optuna storage, or what `open_storage` takes. `study_prefix` goes before the study's
    name (a campaign's label): only workers given the same prefix share a study. `warm_start`: configs
    measured right after the heuristic default, before the sampler proposes any (True: the tuned winners
    of neighbouring shapes in the tuned DBs, `tuning_db.neighbour_configs`; False: none); those outside
    this study's space are dropped."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = get_spec(kernel) if isinstance(kernel, str) else kernel
    full, static, bucket = tuning_shape(spec, shape)
    space = Space(spec, full, arch, only=only, max_configs=max_configs)  # bad `only` configs fail here, early
    own_eval = evaluator is None
    if evaluator is None:
        evaluator = LocalEvaluator(arch)
    try:
        info = evaluator.device_info() if hasattr(evaluator, "device_info") else {}
        if gpu is None:
            from tkjit.tuning_db import gpu_model

            if arch != "cpu" and info.get("arch") and info["arch"] != arch:
                raise RuntimeError(f"tuning for {arch} but the bench GPU is {info['arch']} ({info.get('gpu')})")
            gpu = gpu_model(arch, info.get("gpu"))
        if info.get("sms") and spec.device_constraint is not None:  # what the bench GPU can launch
            space = Space(spec, full, arch, only=only, max_configs=max_configs, device={"sms": info["sms"]})
        n_allowed = len(space)
        if mode == "auto":
            mode = "exhaustive" if n_allowed <= exhaustive_max else "tpe"
        budget = n_allowed if trials is None and mode == "exhaustive" else (
            trials if trials is not None else max(20, math.ceil(0.3 * n_allowed)))
        budget = min(budget, n_allowed)
        space.ordinal = mode == "tpe"  # an exhaustive study records real values (see tkjit.tuning.space)
        opts = StudyOptions(mode=mode, budget=budget, time_budget=time_budget, batch=batch, seed=seed,
                            resume=resume, finalists=finalists, min_gain=min_gain, progress=progress,
                            study_prefix=study_prefix, warm=_warm_configs(spec, full, arch, space, warm_start))
        return _Study(spec, space, evaluator, open_storage(storage), opts,
                      full=full, static=static, bucket=bucket, arch=arch, gpu=gpu).run()
    finally:
        if own_eval:
            evaluator.close()


def _warm_configs(spec: KernelSpec, full: dict, arch: str, space: Space,
                  warm_start: bool | Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The warm-start configs of a study that its space allows, in order, without repeats."""
    if warm_start is True:
        from tkjit.tuning_db import neighbour_configs

        given: Sequence[Mapping[str, Any]] = neighbour_configs(spec, full, arch)
    else:
        given = warm_start or ()
    out: dict[str, dict[str, Any]] = {}
    for c in given:
        try:
            cfg = spec.check_config(full, c, arch)
        except Exception:  # a winner from an older space, or another static shape's: not this study's
            continue
        if config_id(cfg) in space.allowed_ids:
            out.setdefault(config_id(cfg), cfg)
    return tuple(out.values())


@dataclass(frozen=True)
class StudyOptions:
    """How one study searches and decides. `tune` fills every field from its arguments (the
    defaults live there, once)."""

    mode: str  # "exhaustive" or "tpe" ("auto" is resolved before)
    budget: int  # distinct configs to measure, this run and resumed ones together
    time_budget: float | None  # seconds; no new batch starts past it
    batch: int | None  # configs compiled together; None: the evaluator's compile jobs, else 8
    seed: int
    resume: bool  # False: the study's stored trials are deleted first
    finalists: int  # fastest configs re-timed (interleaved) at the end, plus the default
    min_gain: float  # a winner must beat the default by this much (and by the noise)
    progress: Callable[[int, int, float | None], None] | None  # (measured, budget, best µs)
    study_prefix: str = ""
    warm: tuple[dict[str, Any], ...] = ()  # measured after the default, before the sampler's proposals


class _Study:
    def __init__(self, spec: KernelSpec, space: Space, evaluator: Evaluator, storage: Any, opts: StudyOptions,
                 *, full: dict, static: dict, bucket: dict, arch: str, gpu: str) -> None:
        import optuna

        self.spec, self.full, self.static, self.bucket = spec, full, static, bucket
        self.arch, self.gpu, self.space, self.ev = arch, gpu, space, evaluator
        self.mode, self.budget, self.time_budget = opts.mode, opts.budget, opts.time_budget
        self.batch = opts.batch or getattr(getattr(evaluator, "pool", None), "n_jobs", None) or 8
        self.seed, self.finalists, self.min_gain = opts.seed, opts.finalists, opts.min_gain
        self.progress = opts.progress
        self.warm = opts.warm
        self.rng = random.Random(opts.seed)
        self.check_seeds = [self.rng.randrange(1 << 31) for _ in range(CHECK_SEEDS)]
        from tkjit.tuning_db import versions

        self.versions = versions(arch)
        self.identity = study_identity(spec, static, bucket, arch, gpu, self.versions)
        self.name = opts.study_prefix + study_name(spec, static, bucket, arch, gpu, self.versions)
        self.storage = storage
        if not opts.resume:
            try:
                optuna.delete_study(study_name=self.name, storage=storage)
            except KeyError:
                pass
        # Every trial of the stored study is asked with its config fixed (the default, the warm start, the
        # exhaustive queue, or what the proposer below picked), so its sampler never samples.
        self.study = optuna.create_study(study_name=self.name, storage=storage,
                                         sampler=optuna.samplers.RandomSampler(seed=self.seed),
                                         direction="minimize", load_if_exists=True)
        # TPE proposes in an in-memory study that mirrors the stored one's results (_load): in a space of
        # a few hundred configs most proposals repeat a measured config or one the constraints refuse, and
        # each of those cost a trial in the shared storage (a row, its params and attributes: ~30 ms through
        # SQLite, the TPE sample reading every trial back) that nothing ever measured. Only a new, allowed
        # proposal becomes a stored trial.
        self.proposer = None
        self._mirrored: set[int] = set()  # stored trial numbers the proposer holds
        self._proposed: dict[str, Any] = {}  # config id -> the proposer's trial, until its result is stored
        if self.mode == "tpe":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.TPESampler(
                    seed=self.seed, multivariate=True, constant_liar=True,
                    n_startup_trials=max(8, min(16, self.budget // 4)),
                )
            self.proposer = optuna.create_study(sampler=sampler, direction="minimize")
        if self.study.user_attrs.get("identity") != self.identity:
            # What the short name stands for, for optuna-dashboard and `tkjit db export`.
            self.study.set_user_attr("identity", self.identity)
            self.study.set_user_attr("mode", self.mode)
            self.study.set_user_attr("default_config", self.space.default)
        self.heartbeat = _Heartbeat(storage) if heartbeat_enabled(storage) else None
        self.records: dict[str, dict] = {}  # config id -> {"ok", "us"} or {"ok": False, "kind", "error"}
        self.inflight: set[str] = set()
        self.pruned = 0
        self.new = 0
        self.phases: dict[str, float] = {}  # the search's seconds by phase (TuneResult.search_phases)
        self.host = socket.gethostname()
        self.owner = f"{self.host}:{os.getpid()}:{uuid.uuid4().hex[:12]}"  # this tuner, among workers

    # -- bookkeeping --------------------------------------------------------------------
    def _load(self) -> None:
        import optuna
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import Trial, TrialState

        if self.heartbeat is not None:
            # Optuna fails the RUNNING trials whose worker stopped beating (killed, host lost); other
            # RUNNING trials belong to live workers.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(self.study)
        deaths: Counter[str] = Counter()  # config -> trials of it whose worker died (failed with no kind of ours)
        for t in self.study.get_trials(deepcopy=False):
            cid = t.user_attrs.get("config")
            if cid is None:
                continue
            if t.state == TrialState.FAIL and t.user_attrs.get("kind") in (None, "stale"):
                deaths[cid] += 1
            if t.state == TrialState.COMPLETE:
                self.records[cid] = {"ok": True, "us": t.value}
                self._mirror(t, cid)
            elif t.state == TrialState.FAIL and t.user_attrs.get("kind") in EVAL_FAILS:
                self.records.setdefault(cid, {"ok": False, "kind": t.user_attrs["kind"],
                                              "error": t.user_attrs.get("error", "")})
                self._mirror(t, cid)
            elif t.state == TrialState.RUNNING and self.heartbeat is not None:
                if t.user_attrs.get("owner") != self.owner:
                    self.inflight.add(cid)
            elif t.state == TrialState.RUNNING and t.user_attrs.get("owner") != self.owner:
                # No heartbeat (a journal): a dead process of this host is found by its pid.
                pid = t.user_attrs.get("pid")
                owner = t.user_attrs.get("owner")
                mine_dead = pid == os.getpid() and owner not in _LIVE_OWNERS
                if t.user_attrs.get("host") != self.host or not isinstance(pid, int) or (
                        _pid_alive(pid) and not mine_dead):
                    self.inflight.add(cid)  # another live worker on a shared study is measuring it
                else:
                    # Killed mid-trial: not measured, so it is measured again (nothing completed is lost).
                    try:
                        Trial(self.study, t._trial_id).set_user_attr("kind", "stale")
                        self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
                    except UpdateFinishedTrialError:
                        pass  # its worker finished it after our read (a thread of this process whose
                        # tune just returned): not stale; the next _load records its result
        for cid, n in deaths.items():
            if n >= MAX_DEATHS and cid not in self.records:  # (a config that kills its worker is not retried forever)
                self.records[cid] = {"ok": False, "kind": "killed", "error": f"its worker died {n} times measuring it"}

    def _mirror(self, t: Any, cid: str) -> None:
        """A stored result (once) into the proposer, if there is one: its own proposal of that config is told it;
        a config another worker (or an earlier run, or a fixed pick) measured comes in as a finished trial."""
        import optuna
        from optuna.trial import TrialState

        if self.proposer is None or t.number in self._mirrored:
            return
        self._mirrored.add(t.number)
        value = t.value if t.state == TrialState.COMPLETE else None
        mine = self._proposed.pop(cid, None)
        if mine is not None:
            self.proposer.tell(mine, value, state=t.state)
        elif t.params:
            self.proposer.add_trial(optuna.trial.create_trial(
                params=t.params, distributions=t.distributions, value=value, state=t.state))

    def _counted(self) -> int:
        return sum(1 for cid in self.records if cid in self.space.allowed_ids)

    def _ask(self, fixed: dict):
        """A stored trial for this config, created RUNNING with its params and owner in one write. Not
        `enqueue_trial` + `ask`: `ask` pops the oldest WAITING trial, which may be another worker's just
        enqueued one, and on SQLite that pop is not exclusive (the read of WAITING and the write of RUNNING
        are two statements): two workers took one trial, and the one that told it second raised
        UpdateFinishedTrialError (session 21's two-worker fleet run)."""
        import optuna
        from optuna.trial import TrialState

        cid = config_id(fixed)
        frozen = optuna.trial.create_trial(
            state=TrialState.RUNNING, params=self.space.to_params(fixed), distributions=self.space.distributions(),
            user_attrs={"config": cid, "owner": self.owner, "host": self.host, "pid": os.getpid()})
        trial_id = self.storage.create_new_trial(self.study._study_id, template_trial=frozen)
        if self.heartbeat is not None:
            self.heartbeat.add(trial_id)
        trial = optuna.trial.Trial(self.study, trial_id)
        return trial, self.space.suggest(trial)  # (the stored params: a check that they decode to `fixed`)

    def _tell_fail(self, trial, kind: str, error: str = "") -> None:
        from optuna.trial import TrialState

        trial.set_user_attr("kind", kind)
        if error:
            trial.set_user_attr("error", error[:2000])
        self._tell(trial, state=TrialState.FAIL)

    def _tell(self, trial: Any, value: float | None = None, state: Any = None) -> None:
        self.study.tell(trial, value, state=state)
        if self.heartbeat is not None:
            self.heartbeat.done(trial._trial_id)

    def _next_batch(self) -> list[tuple[Any, dict]]:
        from optuna.trial import TrialState

        size = self.batch * 2 if self.mode == "exhaustive" else self.batch  # no feedback needed: bigger
        out: list[tuple[Any, dict]] = []
        taken: set[str] = set()
        self.inflight.clear()
        self._load()  # a shared study: pick up what other workers measured meanwhile
        busy = self.records.keys() | self.inflight
        # What other workers are measuring counts against the budget too: without it, workers sharing a study
        # each filled their batches up to the budget and together measured past it.
        want = min(size, self.budget - self._counted() - len(self.inflight & self.space.allowed_ids))
        untried = [c for c in self.space.allowed if config_id(c) not in busy]
        did = config_id(self.space.default)
        queue: list[dict] = []
        if did not in busy:
            queue.append(self.space.default)  # the heuristic default is always the first trial
        # Then the warm start (neighbouring shapes' winners), before the sampler's first proposal.
        queue += [c for c in self.warm if config_id(c) not in busy and config_id(c) != did]
        if self.mode == "exhaustive":
            queue += self.space.nearest_first([c for c in untried if config_id(c) != did])
        misses = 0
        while len(out) < want:
            fixed = None
            if queue:
                fixed = queue.pop(0)
            elif self.mode == "exhaustive":
                break  # the queue held every untried config
            elif misses >= 16:
                # TPE: the sampler keeps proposing known or invalid configs: a random untried one instead.
                left = [c for c in untried if config_id(c) not in taken]
                if not left:
                    break
                fixed = self.rng.choice(left)
                misses = 0
            else:
                # TPE: the proposer picks; a config it repeats or the constraints refuse is told there and
                # never becomes a stored trial.
                proposal = self.proposer.ask()
                cfg = self.space.suggest(proposal)
                cid = config_id(cfg)
                if cid not in self.space.allowed_ids:
                    self.proposer.tell(proposal, state=TrialState.PRUNED)  # never compiled, not counted
                    self.pruned += 1
                    misses += 1
                    continue
                if cid in busy or cid in self.records or cid in taken or cid in self._proposed:
                    self.proposer.tell(proposal, state=TrialState.FAIL)  # known: neutral for the sampler
                    misses += 1
                    continue
                self._proposed[cid] = proposal  # RUNNING there until its result is stored: the liar
                fixed = cfg
            cid = config_id(fixed)
            if cid in taken:
                continue
            if cid not in self.space.allowed_ids:  # a warm-start config outside this study's space
                log.info("%s: %s not tuned here: %s", self.spec.name, cid, self.space.why_not(fixed))
                self.pruned += 1  # never compiled, not counted
                continue
            trial, cfg = self._ask(fixed)
            misses = 0
            taken.add(cid)
            out.append((trial, cfg))
        return self._drop_claimed(out)

    def _drop_claimed(self, out: list[tuple[Any, dict]]) -> list[tuple[Any, dict]]:
        """Workers sharing a study may pick one config at the same moment (each read the study before
        the other asked). Now that this batch's trials are RUNNING and visible, the lowest-numbered live
        trial of a config keeps it; a later one is told "dup" and not measured: a config is measured
        once, whichever worker sees the other first."""
        from optuna.trial import TrialState

        if not out:
            return out
        first: dict[str, int] = {}
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE,
                                                                TrialState.FAIL)):
            cid = t.user_attrs.get("config")
            if cid is None or (t.state == TrialState.FAIL and t.user_attrs.get("kind") not in EVAL_FAILS):
                continue
            first[cid] = min(first.get(cid, t.number), t.number)
        keep = []
        for trial, cfg in out:
            if first.get(config_id(cfg), trial.number) < trial.number:
                self._tell_fail(trial, "dup")
                self.inflight.add(config_id(cfg))  # another worker measures it: wait for it (see _run)
            else:
                keep.append((trial, cfg))
        return keep

    def _lap(self, phase: str, since: float) -> float:
        """Add the seconds since `since` to a search phase; now."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - since
        return now

    def _measure(self, batch: list[tuple[Any, dict]]) -> None:
        configs = [c for _, c in batch]
        t = time.perf_counter()
        if self.arch != "cpu" and hasattr(self.ev, "compile_iter"):
            # GPU: time candidate i while i+1.. compile (events time the GPU; the host is free to work).
            # The C target times on the host, so there everything compiles first.
            errors = self.ev.compile_iter(self.spec, self.static, configs, self.arch)
        else:
            errors = self.ev.compile(self.spec, self.static, configs, self.arch)
        for (trial, cfg), err in zip(batch, errors):
            t = self._lap("compile", t)  # (since the last candidate: waiting for this one's compile)
            cid = config_id(cfg)
            self.new += 1
            if err:
                self.records[cid] = {"ok": False, "kind": "compile", "error": err}
                self._tell_fail(trial, "compile", err)
                log.info("%s %s: compile failed: %s", self.spec.name, cid, err)
            else:
                seed = self.check_seeds[self.new % CHECK_SEEDS]  # (the worker keeps each seed's reference)
                best = self._best_us()
                # Clearly slower than the best so far (EARLY_STOP x): a few runs say so, the full budget
                # would not change the ranking. Finalists are re-timed in full at the end anyway.
                r = self.ev.bench(self.spec, self.full, cfg, self.arch, seed,
                                  stop_above_us=None if best is None else best * EARLY_STOP)
                t = self._lap("bench", t)
                if r.get("ok"):
                    self.records[cid] = {"ok": True, "us": float(r["us"])}
                    trial.set_user_attr("spread", float(r.get("spread", 0.0)))
                    if r.get("phases"):  # seconds the worker spent loading, checking, gating, timing it
                        trial.set_user_attr("phases", r["phases"])
                    if r.get("early_stop"):
                        trial.set_user_attr("early_stop", True)
                    self._tell(trial, float(r["us"]))
                else:
                    kind = r.get("kind") if r.get("kind") in EVAL_FAILS else "error"
                    self.records[cid] = {"ok": False, "kind": kind, "error": r.get("error", "")}
                    self._tell_fail(trial, kind, r.get("error", ""))
                    log.info("%s %s: %s: %s", self.spec.name, cid, kind, r.get("error"))
            t = self._lap("store", t)
            if self.progress:
                self.progress(self._counted(), self.budget, self._best_us())
            t = time.perf_counter()

    def _best_us(self) -> float | None:
        oks = [r["us"] for r in self.records.values() if r["ok"]]
        return min(oks) if oks else None

    # -- the run ------------------------------------------------------------------------
    def run(self) -> TuneResult:
        _LIVE_OWNERS.add(self.owner)
        try:
            return self._run()
        finally:
            _LIVE_OWNERS.discard(self.owner)
            if self.heartbeat is not None:
                self.heartbeat.close()

    def _run(self) -> TuneResult:
        t0 = time.perf_counter()
        self._load()
        if self.progress:
            self.progress(self._counted(), self.budget, self._best_us())
        last = 0.0
        stalled: tuple[int, float] | None = None  # (trials counted, since when) while waiting on others
        while self._counted() < self.budget:
            # Stop before a batch that would likely run past the budget (the first always runs).
            if self.time_budget is not None and self.new and time.perf_counter() - t0 + last > self.time_budget:
                log.info("%s: time budget reached after %d trials", self.name, self._counted())
                break
            tp = time.perf_counter()
            batch = self._next_batch()
            self._lap("propose", tp)
            if not batch:
                # Other workers measure the rest (or took this batch's configs a moment before it: two workers
                # starting together pick the same first configs): wait for them, so this worker's result covers
                # the whole study. With a heartbeat a dead worker's trials are failed and re-asked within its
                # grace; without one, a dead worker of this host is found by its pid.
                stalled = self._wait_for_others(stalled) if self.inflight else None
                if stalled is not None:
                    time.sleep(min(1.0, self.heartbeat.interval / 2) if self.heartbeat is not None else 0.2)
                    continue
                break
            stalled = None
            tb = time.perf_counter()
            self._measure(batch)
            last = time.perf_counter() - tb
        return self._finish(time.perf_counter() - t0)

    def _wait_for_others(self, stalled: tuple[int, float] | None) -> tuple[int, float] | None:
        """Whether to keep waiting on other workers' RUNNING trials: the (trials counted, since when) to wait
        on, or None to stop. With a heartbeat, always (a dead worker's trials fail within its grace); without
        one (a journal: another host's dead worker is not seen), until STALL_S pass with no trial finished,
        then the study ends with what it has."""
        counted = self._counted()
        if stalled is None or stalled[0] != counted:  # the first wait, or progress: the clock starts again
            return counted, time.perf_counter()
        if self.heartbeat is not None or time.perf_counter() - stalled[1] < STALL_S:
            return stalled
        log.warning("%s: %d trials of other workers made no progress in %d s; finishing without them",
                    self.name, len(self.inflight), STALL_S)
        return None

    def _finish(self, elapsed: float) -> TuneResult:
        self._load()
        did = config_id(self.space.default)
        ok = sorted(((r["us"], cid) for cid, r in self.records.items() if r["ok"] and cid in self.space.allowed_ids))
        failed = {cid: f"{r['kind']}: {r.get('error', '')}"[:500] for cid, r in self.records.items() if not r["ok"]}
        base = dict(kernel=self.spec.name, shape=self.static, bucket=self.bucket, arch=self.arch, gpu=self.gpu,
                    default_config=self.space.default, trials=self._counted(), new_trials=self.new, failed=failed,
                    pruned_invalid=self.pruned, study=self.name, mode=self.mode, full_shape=self.full,
                    spec_source=self.spec.source_hash)
        if not ok:
            raise RuntimeError(f"{self.name}: no config passed the correctness gate; failures: {failed}")
        finalists = [cid for _, cid in ok[: self.finalists]]
        if did in self.records and self.records[did]["ok"] and did not in finalists:
            finalists.append(did)
        cfgs = [json.loads(c) for c in finalists]
        timed: dict[str, dict] = {}
        t_retime = time.perf_counter()
        if len(cfgs) > 1:
            for cid, r in zip(finalists, self.ev.retime(self.spec, self.full, cfgs, self.arch)):
                if r.get("ok"):
                    timed[cid] = {"us": float(r["us"]), "spread": float(r.get("spread", 0.0))}
        if not timed:  # a single candidate, or the re-time failed: the search's numbers stand
            timed = {cid: {"us": self.records[cid]["us"], "spread": 0.0} for cid in finalists}
        best = min(timed, key=lambda c: timed[c]["us"])
        d = timed.get(did)
        chosen, won = best, True
        spread = max(v["spread"] for v in timed.values())
        if d is not None:
            gain = (d["us"] - timed[best]["us"]) / d["us"]
            if best == did or gain < max(self.min_gain, timed[best]["spread"], d["spread"]):
                chosen, won = did, False
        elif did in self.records:
            log.warning("%s: the heuristic default failed: %s", self.name, failed.get(did))
        tuned_us = timed[chosen]["us"]
        default_us = d["us"] if d is not None else None
        result = TuneResult(
            **base, config=json.loads(chosen), tuned_us=tuned_us, default_us=default_us,
            speedup=(default_us / tuned_us) if default_us and tuned_us else None, spread=spread, won=won,
            best_config=json.loads(best), elapsed_s=round(elapsed, 3),
            retime_s=round(time.perf_counter() - t_retime, 3),
            search_phases={k: round(v, 3) for k, v in self.phases.items()},
        )
        # The re-timed winner lives with its trials: `tkjit db export` reads it from any storage.
        # Several workers finishing one study each write theirs; the last one stands.
        self.study.set_user_attr("winner", result.db_entry())
        return result
