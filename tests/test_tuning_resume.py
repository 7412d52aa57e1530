"""A tuning run killed with SIGKILL resumes from its journal: no completed trial lost or repeated."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import sys
    from tkjit.tuning import tune
    from fakes import TableEvaluator, fake_spec

    space = {"block": (32, 64, 128, 256), "threads": (32, 64, 128), "unroll": (False, True)}
    spec = fake_spec(space, constraint=lambda s, c: "no" if c["threads"] > c["block"] else None)
    ev = TableEvaluator(lambda c: 100.0 + c["block"] / c["threads"], log_path=sys.argv[2], delay_s=float(sys.argv[3]))
    r = tune(spec, {"num_tokens": 4096}, arch="sm_90a", gpu="G", evaluator=ev, storage="journal:" + sys.argv[1],
             batch=2)
    print("DONE", r.trials, r.new_trials)
    """
)


def completed(journal: Path) -> list[str]:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    return [t.user_attrs["config"] for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE]


def test_sigkill_then_resume(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    journal, log1, log2 = tmp_path / "j.log", tmp_path / "b1.txt", tmp_path / "b2.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers")])}
    p = subprocess.Popen([sys.executable, str(script), str(journal), str(log1), "0.2"], env=env)
    deadline = time.time() + 60
    while time.time() < deadline:
        if log1.exists() and len(log1.read_text().split()) >= 6:
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    done1 = completed(journal)
    assert 5 <= len(done1) < 18, "the kill should land mid-run"
    out = subprocess.run([sys.executable, str(script), str(journal), str(log2), "0"], env=env, check=True,
                         capture_output=True, text=True).stdout
    benched2 = log2.read_text().split()
    assert not set(done1) & set(benched2), "a completed trial was measured again"
    final = Counter(completed(journal))
    assert len(final) == 18 and set(final.values()) == {1}  # every allowed config, once
    assert set(done1) | set(benched2) == set(final)
    assert f"DONE 18 {len(benched2)}" in out
