"""The benchmark worker: one long-lived spawned process that loads, checks and times candidates.

The parent (the tuner) never touches CUDA. It sends jobs over a pipe and waits with a timeout; a
candidate that kills the worker (segfault, illegal address, trap) or hangs past the timeout
fails its trial, the worker is replaced, and tuning goes on. A CUDA error that leaves the context
unusable makes the worker answer and exit, so the next job gets a fresh context.

Every candidate passes a correctness gate before it is timed:
  1. random inputs the candidate has not run on, at a check size (runtime dims shrunk), with poisoned
     outputs, against the spec's reference. The tuner draws each candidate's seed from a small pool per
     study (CHECK_SEEDS), and the worker keeps each seed's inputs and reference: the CPU reference is
     most of a check's cost (Sinkhorn at 131071 tokens: ~40 ms on a 16-core host, per candidate) and
     a seed's draw checks every candidate given it as well as a new one would;
  2. the timing inputs at the full size, poisoned outputs, against a reference computed once per
     study — so nothing is timed that did not produce the right answer at that size.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tkjit import timing
from tkjit.canon import canonical_json
from tkjit.memo import Memo
from tkjit.procs import die_with_parent, exit_status

CHECK_CAP = 1 << 21  # input elements of the fresh-seed check (runtime dims shrunk to fit)
STUDY_SEED = 20240601  # the timing inputs of a study


AUTO_ARCH = "auto"  # WorkerSetup.arch: the worker's GPU, whatever its arch (it reports it in its hello)


@dataclass
class WorkerSetup:
    arch: str  # "cpu" (the C target), an sm arch, or AUTO_ARCH
    timer: str | None = None  # "module:attr"; None: CUDA events on GPU, perf_counter on CPU
    timer_kwargs: dict[str, Any] = field(default_factory=dict)
    imports: tuple[str, ...] = ()  # modules to import first (test-only specs register themselves)
    budget_s: float = 0.08  # timing budget per candidate
    check_cap: int = CHECK_CAP
    copy_at_start: bool = False  # measure the copy ceiling right after the hello, before it is asked for


# ----------------------------------------------------------------------------------------------
# child side
# ----------------------------------------------------------------------------------------------
class _Child:
    def __init__(self, setup: WorkerSetup) -> None:
        self.setup = setup
        self.device = "cpu" if setup.arch == "cpu" else "cuda"
        for m in setup.imports:
            importlib.import_module(m)
        import torch  # noqa: F401

        import tkjit

        self.tkjit = tkjit
        self.timer = timing.load_timer(setup.timer, self.device, setup.timer_kwargs)
        self._study: tuple[str, Any] | None = None  # (study id, (inputs, refs))
        self._kernels: dict[str, Any] = {}
        self._copy: dict | None = None  # the copy ceiling's reply, once measured at start
        self._checks = Memo(8)  # (kernel, check shape, seed) -> (inputs, reference outputs on the device)

    def hello(self) -> dict[str, Any]:
        info: dict[str, Any] = {"device": self.device, "pid": os.getpid()}
        if self.device == "cuda":
            import torch

            from tkjit.arch import current_arch, device_limits

            info["arch"] = current_arch()  # None without a usable GPU: the parent says so
            if info["arch"]:
                info["gpu"] = torch.cuda.get_device_name()
                info["sms"] = (device_limits(info["arch"]) or {}).get("sms")  # what `tkjit.get` fits grids to
        return info

    def _kernel(self, name: str, shape: dict, config: dict, arch: str):
        k = self.tkjit.get(name, shape, arch=arch, config=config)
        if len(self._kernels) > 64:
            self._kernels.clear()
        self._kernels[k.key] = k
        return k

    def _study_data(self, spec, full: dict):
        sid = canonical_json([spec.name, full], default=str)
        if self._study is None or self._study[0] != sid:
            self._study = None  # free the previous study's tensors first
            self._study = (sid, self._drawn(spec, full, STUDY_SEED))
        return self._study[1]

    def _check_data(self, spec, small: dict, seed: int):
        """The check's inputs at seed and their reference, drawn once a seed (run_against_reference runs in-place
        kernels on copies, so the inputs stay as drawn)."""
        key = canonical_json([spec.name, small, seed], default=str)
        got = self._checks.get(key)
        return got if got is not None else self._checks.remember(key, self._drawn(spec, small, seed))

    def _drawn(self, spec, shape: dict, seed: int):
        """(inputs at seed, their reference outputs): computed on the CPU, as every reference, and kept on the
        device, where each candidate's outputs are then compared (tkjit.testing.run_against_reference) instead of
        being copied back."""
        from tkjit.testing import reference_outputs

        inputs = spec.make_inputs(shape, device=self.device, seed=seed)
        refs = tuple(r.to(self.device) if hasattr(r, "to") else r for r in reference_outputs(spec, shape, inputs))
        return inputs, refs

    def _check_shape(self, spec, full: dict) -> dict:
        """The fresh-seed check's shape: runtime dims shrunk until the inputs hold <= check_cap
        elements (the CPU reference stays cheap), then made odd so partial tiles are exercised."""
        small = dict(full)
        runtime = [p.name for p in spec.runtime_params]

        def numel(shape: dict) -> int:
            total = 0
            for t in spec.inputs:
                n = 1
                for d in t.resolve(shape)[1]:
                    n *= d
                total += n
            return total

        shrunk = set()
        try:
            while runtime and numel(small) > self.setup.check_cap:
                big = max(runtime, key=lambda k: small[k])
                if small[big] <= 2:
                    break
                small[big] //= 2
                shrunk.add(big)
            for k in shrunk:
                small[k] = max(1, small[k] - 1)
            return spec.canonical_shape(small)
        except Exception:
            return full

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def _prepare(self, name: str, full: dict, config: dict, arch: str, seed: int | None,
                 phases: dict[str, float] | None = None):
        """Load and gate a candidate; returns (run closure, None) or (None, failure reply). phases: seconds
        each step took (load, check, gate) are added to it, so a study shows where its time went."""
        from tkjit.testing import check, inout_copies, run_against_reference

        phases = {} if phases is None else phases
        t = time.perf_counter()
        spec = self.tkjit.get_spec(name)
        k = self._kernel(name, full, config, arch)
        phases["load_s"], t = time.perf_counter() - t, time.perf_counter()
        if seed is not None:
            small = self._check_shape(spec, full)
            msg = check(k, small, device=self.device, seed=seed, data=self._check_data(spec, small, seed))
            phases["check_s"], t = time.perf_counter() - t, time.perf_counter()
            if msg:
                return None, {"ok": False, "kind": "wrong", "error": f"fresh inputs (seed {seed}): {msg}"}
        inputs, refs = self._study_data(spec, full)
        # The outputs stay: the timed runs write into them again.
        outs, problem = run_against_reference(k, full, inputs, refs=refs, device=self.device)
        phases["gate_s"] = time.perf_counter() - t
        if problem:
            return None, {"ok": False, "kind": "wrong", "error": f"timing inputs: {problem}"}
        # The timed runs change in-place inputs (an accumulated gradient grows every run): they get their own
        # copies, so the study's inputs stay as drawn for the next candidate's gate.
        timed = inout_copies(spec, full, inputs)

        def run() -> None:
            k(*timed, out=outs)

        return run, None

    def study(self, job: dict) -> dict:
        """Draw a study's inputs and compute their reference outputs (kept for its candidates): a job of its own,
        under a longer time limit than a candidate's, as a reference at a large shape on the CPU can take minutes
        (mhc_multilayer_recompute's exact float32 replay: 5 min at 8192 tokens x 4 x 2560 x 10 layers, 2 cores)."""
        t = time.perf_counter()
        spec = self.tkjit.get_spec(job["kernel"])
        self._study_data(spec, job["shape"])
        return {"ok": True, "s": round(time.perf_counter() - t, 3)}

    def bench(self, job: dict) -> dict:
        phases: dict[str, float] = {}
        run, fail = self._prepare(job["kernel"], job["shape"], job["config"], job["arch"], job.get("seed"), phases)
        if fail:
            return fail
        t = time.perf_counter()
        ctx = {"kernel": job["kernel"], "config": job["config"], "shape": job["shape"], "device": self.device}
        if job.get("stop_above_us") is not None:
            ctx["stop_above_us"] = float(job["stop_above_us"])
        xs = self.timer.measure(run, budget_s=float(job.get("budget_s", self.setup.budget_s)), context=ctx)
        if not xs:
            return {"ok": False, "kind": "error", "error": "timer returned no samples"}
        phases["time_s"] = time.perf_counter() - t
        early = len(xs) == timing.EARLY_RUNS and timing.stops_early(xs, ctx)
        return {"ok": True, "us": timing.median(xs), "spread": timing.rel_spread(xs), "n": len(xs),
                "early_stop": early, "phases": {k: round(v, 4) for k, v in phases.items()}}

    def retime(self, job: dict) -> dict:
        """Interleaved rounds over the finalists: drift hits every candidate alike."""
        runs, out = [], []
        for cfg in job["configs"]:
            run, fail = self._prepare(job["kernel"], job["shape"], cfg, job["arch"], None)
            runs.append(run)
            out.append(fail)
        rounds: list[list[float]] = [[] for _ in runs]
        budget = float(job.get("budget_s", self.setup.budget_s)) / 2
        for _ in range(int(job.get("rounds", 5))):
            for i, (cfg, run) in enumerate(zip(job["configs"], runs)):
                if run is None:
                    continue
                ctx = {"kernel": job["kernel"], "config": cfg, "shape": job["shape"], "device": self.device}
                xs = self.timer.measure(run, budget_s=budget, context=ctx)
                rounds[i].append(timing.median(xs))
        res = []
        for fail, r in zip(out, rounds):
            if fail:
                res.append(fail)
            else:
                res.append({"ok": True, "us": timing.median(r), "spread": timing.rel_spread(r), "rounds": r})
        return {"ok": True, "results": res}

    def copy_bandwidth(self, job: dict) -> dict:
        import torch

        if self._copy is not None and "bytes" not in job:  # measured at start (WorkerSetup.copy_at_start)
            return self._copy
        # Far beyond the caches either way; on the CPU (the C target) 256 MB, not seconds of 1 GB copies.
        n = int(job.get("bytes", 1 << 30 if self.device == "cuda" else 1 << 28))
        src = torch.empty(n // 4, dtype=torch.float32, device=self.device).fill_(1.0)
        dst = torch.empty_like(src)
        xs = self.timer.measure(lambda: dst.copy_(src), budget_s=0.2,
                                context={"kernel": "copy", "config": {}, "shape": {"bytes": n}, "device": self.device})
        return {"ok": True, "gbps": 2 * n / (timing.median(xs) * 1e-6) / 1e9}

    def context_ok(self) -> bool:
        try:
            self._sync()
            return True
        except Exception:
            return False


def _main(conn, setup: WorkerSetup, parent: int) -> None:
    die_with_parent(parent)
    # The parent owns Ctrl-C: it stops the study and shuts us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = _Child(setup)
        conn.send({"ok": True, **child.hello()})
    except BaseException as e:
        conn.send({"ok": False, "kind": "error", "error": f"worker start failed: {type(e).__name__}: {e}"})
        return
    if setup.copy_at_start:  # while the parent opens its storage: the copy ceiling its first request asks for
        try:
            child._copy = child.copy_bandwidth({})
        except Exception:  # asked for later, it fails there with its message
            child._copy = None
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        op = job.get("op")
        if op == "exit":  # nothing left to do: skip the interpreter's teardown (torch, CUDA: ~0.5 s)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            if op == "bench":
                reply = child.bench(job)
            elif op == "retime":
                reply = child.retime(job)
            elif op == "study":
                reply = child.study(job)
            elif op == "copy_bw":
                reply = child.copy_bandwidth(job)
            elif op == "ping":
                reply = {"ok": True}
            else:
                reply = {"ok": False, "kind": "error", "error": f"unknown op {op!r}"}
        except Exception as e:
            tb = traceback.format_exc(limit=4)
            reply = {"ok": False, "kind": "error", "error": f"{type(e).__name__}: {e}", "traceback": tb}
        fatal = not child.context_ok()  # a sticky CUDA error (illegal address, trap): this context is done
        if fatal:
            reply = {**reply, "ok": False, "kind": "crash", "fatal": True,
                     "error": "CUDA context unusable after the launch: " + str(reply.get("error", ""))}
        conn.send(reply)
        if fatal:
            os._exit(3)


# ----------------------------------------------------------------------------------------------
# parent side
# ----------------------------------------------------------------------------------------------
class BenchWorker:
    """Parent-side handle; restarts the child after a crash or timeout (lazily, on the next job)."""

    def __init__(self, setup: WorkerSetup, *, timeout_s: float = 60.0, start_timeout_s: float = 180.0) -> None:
        self.setup = setup
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._proc = None
        self._conn = None
        self.info: dict[str, Any] = {}
        self.restarts = 0

    def spawn(self) -> None:
        """Start the child without waiting for it (it imports torch and starts CUDA: seconds the caller can
        spend on its own start-up); `start` waits for its hello."""
        if self._proc is not None and self._proc.is_alive():
            return
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_main, args=(child, self.setup, os.getpid()), daemon=True, name="tkjit-bench")
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self.info = {}

    def start(self) -> dict[str, Any]:
        if self._proc is not None and self._proc.is_alive() and self.info:
            return self.info
        self.spawn()
        proc, parent = self._proc, self._conn
        if not parent.poll(self.start_timeout_s):
            self._kill()
            raise RuntimeError(f"bench worker did not start within {self.start_timeout_s:.0f}s")
        try:
            hello = parent.recv()
        except EOFError:
            proc.join(5)
            code = proc.exitcode
            self._kill()
            raise RuntimeError(f"bench worker died while starting ({exit_status(code)})") from None
        if not hello.get("ok"):
            self._kill()
            raise RuntimeError(hello.get("error", "bench worker failed to start"))
        self.info = hello
        return hello

    def request(self, job: Mapping[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send a job; a crash or a timeout comes back as a failed reply, never as an exception."""
        self.start()
        assert self._conn is not None and self._proc is not None
        timeout = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        try:
            self._conn.send(dict(job))
            ready = self._conn.poll(timeout)
        except (OSError, EOFError, BrokenPipeError):
            ready = True
        if not ready:
            self._kill()
            self.restarts += 1
            return {"ok": False, "kind": "timeout", "error": f"no answer within {timeout:.0f}s (hang); worker replaced"}
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            code = self._proc.exitcode
            self._kill()
            self.restarts += 1
            return {"ok": False, "kind": "crash", "error": f"bench worker died ({exit_status(code)}); replaced"}
        if reply.get("fatal"):
            self._kill()
            self.restarts += 1
        reply["wall_s"] = time.perf_counter() - t0
        return reply

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(10)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None and self.info:
            with contextlib.suppress(Exception):
                self._conn.send({"op": "exit"})
                self._proc.join(5)
        self._kill()

    def __enter__(self) -> BenchWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bench_job(kernel: str, shape: dict, config: dict, arch: str, seed: int | None, **extra: Any) -> dict:
    return {"op": "bench", "kernel": kernel, "shape": shape, "config": config, "arch": arch, "seed": seed, **extra}


def retime_job(kernel: str, shape: dict, configs: Sequence[dict], arch: str, rounds: int = 5, **extra: Any) -> dict:
    return {"op": "retime", "kernel": kernel, "shape": shape, "configs": list(configs), "arch": arch,
            "rounds": rounds, **extra}
