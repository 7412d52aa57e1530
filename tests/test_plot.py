"""Charts: the bench chart from a bench JSON (the committed H200 one), a study's trials from its journal.
Reading the data needs no matplotlib; drawing is skipped where matplotlib is not installed."""

from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from fakes import TableEvaluator, fake_spec  # noqa: E402

from tkjit import cli, plot  # noqa: E402
from tkjit.errors import TkjitError  # noqa: E402
from tkjit.tuning import config_id, tune  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "benchmarks" / "h200" / "2026-12-02_bench_tuned.json"
PNG = b"\x89PNG\r\n\x1a\n"


def _png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000, (path, len(data))


# -- bench ----------------------------------------------------------------------------------------
def test_bench_groups_of_the_h200_run():
    groups = plot.bench_groups(plot.load_bench(H200))
    by = {(g.kernel, g.shape): g for g in groups}
    g = by[("sinkhorn_bwd", "num_tokens=262144,n=4")]
    assert set(g.us) == {"tkjit default", "tkjit tuned", "TileKernels", "torch.compile", "torch eager"}
    assert g.tuned_source.startswith("tkjit tuned:")
    assert g.us["tkjit tuned"] < g.us["tkjit default"] < g.us["TileKernels"]
    assert 0 < g.pct("torch eager") < g.pct("tkjit tuned") <= 100
    assert all(g.floor_us > 0 for g in groups) and len(groups) >= 8


def test_bench_groups_skip_failed_rows_and_groups_without_a_floor():
    rows = [
        {"kernel": "k", "shape": "n=1", "impl": "copy floor", "us": 1.0},
        {"kernel": "k", "shape": "n=1", "impl": "tkjit default", "us": 2.0},
        {"kernel": "k", "shape": "n=1", "impl": "TileKernels", "us": None, "note": "failed: X"},
        {"kernel": "k", "shape": "n=2", "impl": "tkjit default", "us": 2.0},  # no floor
    ]
    (g,) = plot.bench_groups({"rows": rows})
    assert g.us == {"tkjit default": 2.0} and g.pct("tkjit default") == 50.0


def test_not_a_bench_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"results": []}')
    with pytest.raises(TkjitError, match="not a bench JSON"):
        plot.load_bench(bad)
    bad.write_text("{")
    with pytest.raises(TkjitError, match="not a bench JSON"):
        plot.load_bench(bad)


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(TkjitError, match=r"pip install 'tkjit\[plot\]'"):
        plot.bench_chart(plot.load_bench(H200), tmp_path / "x.png")
    assert cli.main(["plot", "bench", str(H200), "-o", str(tmp_path / "y.png")]) == 1
    assert not (tmp_path / "y.png").exists()


def test_bench_chart_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sub" / "bench.png"
    assert cli.main(["plot", "bench", str(H200), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    _png(out)
    with pytest.raises(TkjitError, match="must end in .png"):
        plot.bench_chart(plot.load_bench(H200), tmp_path / "bench.txt")


def test_plot_bench_missing_file_is_one_error_line(tmp_path, capsys):
    assert cli.main(["plot", "bench", str(tmp_path / "none.json"), "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tkjit: error: ") and "none.json" in err and err.count("\n") == 1


# -- studies ----------------------------------------------------------------------------------------
SPACE = {"block": (32, 64, 128, 256), "threads": (32, 64, 128), "unroll": (False, True)}
DEFAULT = {"block": 128, "threads": 64, "unroll": False}


def _study(tmp_path, n_tokens=5000, name="fake_kernel"):
    """A finished study in a journal file: 24 configs of a fake kernel timed from a table, one failing."""
    import itertools

    spec = fake_spec(SPACE, default=DEFAULT, name=name)
    combos = [dict(zip(SPACE, c)) for c in itertools.product(*SPACE.values())]
    table = {config_id(c): 100.0 + 7 * i for i, c in enumerate(combos)}
    table[config_id(DEFAULT)] = 180.0
    fail = config_id({"block": 32, "threads": 32, "unroll": True})
    journal = tmp_path / "journal.log"
    r = tune(spec, {"num_tokens": n_tokens}, arch="sm_90a", gpu="G", evaluator=TableEvaluator(table,
             compile_fail=[fail]), storage=f"journal:{journal}")
    return journal, r, table


def test_study_trials_from_the_journal(tmp_path):
    journal, r, table = _study(tmp_path)
    storage = plot.open_journal(str(journal))
    name = plot.pick_study(storage)
    assert name == r.study
    trials = plot.study_trials(storage, name)
    assert len(trials) == 24 and trials[0].config == DEFAULT and trials[0].us == 180.0  # the default first
    failed = [t for t in trials if t.us is None]
    assert len(failed) == 1 and failed[0].failure == "compile"
    for t in trials:
        if t.us is not None:
            assert t.us == table[config_id(t.config)]
    curve = plot.best_so_far(trials)
    assert curve[0] == 180.0 and curve[-1] == min(t.us for t in trials if t.us is not None)
    assert all(a >= b for a, b in zip(curve, curve[1:]))
    assert plot.study_title(name) == "fake_kernel num_tokens~8192 on sm_90a (G)"


def test_pick_study_filters_and_ambiguity(tmp_path):
    journal, r, _ = _study(tmp_path, 5000)
    _study(tmp_path, 100)  # a second study (another bucket) in the same journal
    storage = plot.open_journal(str(journal))
    with pytest.raises(TkjitError, match="2 tuning studies match"):
        plot.pick_study(storage, kernel="fake_kernel")
    assert plot.pick_study(storage, kernel="fake_kernel", shape={"num_tokens": 8192}) == r.study
    with pytest.raises(TkjitError, match="no tuning study matches .*--arch cpu"):
        plot.pick_study(storage, arch="cpu")


def test_no_journal_is_an_error_not_created(tmp_path, cache_dir):
    with pytest.raises(TkjitError, match="no tuning journal at"):
        plot.open_journal(None)
    with pytest.raises(TkjitError, match="no tuning journal at"):
        plot.open_journal(str(tmp_path / "nope.log"))
    assert not (tmp_path / "nope.log").exists()
    assert not (cache_dir / "v1" / "tuned" / "journal.log").exists()


def test_study_chart_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    journal, r, _ = _study(tmp_path)
    out = tmp_path / "study.png"
    assert cli.main(["plot", "study", "--storage", str(journal), "-o", str(out)]) == 0, capsys.readouterr().err
    assert "24 trials of fake_kernel" in capsys.readouterr().out
    _png(out)


def test_plot_study_cli_errors(tmp_path, capsys):
    journal, _, _ = _study(tmp_path)
    assert cli.main(["plot", "study", "sinkhorn_fw", "--storage", str(journal), "-o", str(tmp_path / "s.png")]) == 1
    assert "did you mean sinkhorn_fwd" in capsys.readouterr().err
    assert cli.main(["plot", "study", "sinkhorn_fwd", "--storage", str(journal), "-o", str(tmp_path / "s.png")]) == 1
    err = capsys.readouterr().err
    assert "no tuning study matches sinkhorn_fwd" in err and "fake_kernel" in err
    assert cli.main(["plot", "study", "--storage", str(journal)]) == 2  # -o is required


def test_committed_h200_chart_is_current():
    """The README's chart is drawn from the committed bench JSON (`tkjit plot bench ... -o ...`)."""
    png = ROOT / "benchmarks" / "h200" / "bench.png"
    assert png.exists() and png.read_bytes().startswith(PNG)
    assert json.loads(H200.read_text())["meta"]["gpu"] == "NVIDIA H200"


def test_bench_tool_redraws_from_json(tmp_path):
    import subprocess

    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--from-json", str(H200), "--plot", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "NVIDIA H200" in r.stdout and "sinkhorn_bwd" in r.stdout and f"wrote {out}" in r.stdout
    _png(out)
