"""tools/pretune.py pieces that need no compiler: manifest expansion, the shipped manifest, the table."""

import sys
from pathlib import Path

import tkjit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from tool_loader import load_tool  # noqa: E402

pretune = load_tool("pretune")


def test_expand_products_and_defaults():
    m = {"defaults": {"trials": 7}, "study": [
        {"kernel": "a", "shape": {"n": [1, 2], "t": [10, 20], "x": "s"}},
        {"kernel": "b", "shape": {"n": 3}, "trials": 2},
    ]}
    out = pretune.expand(m)
    assert [(s["kernel"], s["shape"]["n"], s["shape"].get("t"), s["trials"]) for s in out] == [
        ("a", 1, 10, 7), ("a", 1, 20, 7), ("a", 2, 10, 7), ("a", 2, 20, 7), ("b", 3, None, 2)]


def test_shipped_manifest_shapes_are_valid_for_the_catalog():
    with open(ROOT / "tools" / "manifest.toml", "rb") as f:
        studies = pretune.expand(pretune.tomllib.load(f))
    assert len(studies) >= 8
    known = {s.name for s in tkjit.all_specs()}
    for s in studies:
        if s["kernel"] in known:  # kernels still to land are skipped by pretune with a warning
            spec = tkjit.get_spec(s["kernel"])
            full = spec.canonical_shape(s["shape"])
            assert spec.configs(full, "sm_90a"), s


def test_summary_table():
    row = {"kernel": "k", "full_shape": {"n": 4}, "default_us": 10.0, "tuned_us": 8.0, "speedup": 1.25,
           "pct_copy": 71.0, "trials": 12, "won": True, "failed": {"x": "wrong"}, "elapsed_s": 3.2}
    text = pretune.summary_table([row, {"kernel": "z", "shape": {"n": 1}, "error": "boom"}])
    assert "1.250x" in text and "71" in text and "1 failed" in text and "boom" in text
