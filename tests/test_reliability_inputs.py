"""Bad input gives a clear tkjit error; fuzzed shapes and configs never escape as anything else."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tkjit
from tkjit.errors import ConfigError, ShapeError, TensorError, TkjitError, UnknownKernelError
from tkjit.registry import all_specs, get_spec

SPEC = get_spec("sinkhorn_fwd")
FULL = SPEC.canonical_shape({"num_tokens": 64})
OK_CFG = SPEC.default_config(FULL, "cpu")


def test_unknown_kernel():
    with pytest.raises(UnknownKernelError, match="unknown kernel 'nope'.*sinkhorn_fwd"):
        tkjit.get("nope", {"num_tokens": 1}, arch="cpu")
    with pytest.raises(TkjitError):
        tkjit.get("../../etc/passwd", arch="cpu")


@pytest.mark.parametrize(
    "shape, match",
    [
        ({"num_tokens": 0}, "below its minimum"),
        ({"num_tokens": -5}, "below"),
        ({"num_tokens": 1 << 40}, "above its maximum"),
        ({"num_tokens": "many"}, "must be an int"),
        ({"num_tokens": 3.5}, "must be an int"),
        ({"num_tokens": True}, "must be an int"),
        ({"num_tokens": 8, "n": 0}, "below"),
        ({"num_tokens": 8, "n": 17}, "above"),
        ({"num_tokens": 8, "eps": float("nan")}, "finite"),
        ({"num_tokens": 8, "eps": "small"}, "float"),
        ({"num_tokens": 8, "bogus": 1}, "unknown shape params"),
        ({}, "missing shape params"),
        ([1, 2], "mapping"),
    ],
)
def test_wrong_shape_params(shape, match):
    with pytest.raises(ShapeError, match=match):
        tkjit.get("sinkhorn_fwd", shape, arch="cpu")


@pytest.mark.parametrize(
    "config, match",
    [
        ({**OK_CFG, "block_tokens": 3}, "not in the space"),
        ({**OK_CFG, "block_tokens": 64.0}, "not in the space"),
        ({**OK_CFG, "fast_math": 0}, "not in the space"),
        ({**OK_CFG, "layout": "smem"}, "C target"),
        ({**OK_CFG, "unroll": 2}, "unknown"),
        ({k: v for k, v in OK_CFG.items() if k != "threads"}, "missing"),
        ({**OK_CFG, "block_tokens": 64, "threads": 128}, "multiple of threads"),
        ("fast", "mapping"),
    ],
)
def test_configs_outside_the_space(config, match):
    with pytest.raises(ConfigError, match=match):
        tkjit.get("sinkhorn_fwd", {"num_tokens": 64}, arch="cpu", config=config)


def test_bad_arch():
    for arch in ("sm_9", "gpu", "../cpu", "", 90, 0):
        with pytest.raises(TkjitError, match="invalid arch"):
            tkjit.get("sinkhorn_fwd", {"num_tokens": 64}, arch=arch)


def test_arch_with_trailing_newline():
    from tkjit.arch import check_arch

    with pytest.raises(TkjitError, match="invalid arch"):
        check_arch("cpu\n")


@pytest.mark.slow
def test_wrong_tensors(cache_dir):
    k = tkjit.get("sinkhorn_fwd", {"num_tokens": 64}, arch="cpu")
    x = torch.randn(64, 4, 4)
    cases = [
        (x.double(), "dtype"),
        (x.half(), "dtype"),
        (torch.randn(64, 4, 5), "shape"),
        (torch.randn(64, 16), "dims"),
        (torch.randn(64, 4, 4, device="meta"), "fake/meta tensor"),
        (torch.randn(4, 4, 64).permute(2, 0, 1), "contiguous"),
        (torch.randn(64, 8, 4)[:, ::2], "contiguous"),
        (x.numpy(), "torch.Tensor"),
        ([[1.0]], "torch.Tensor"),
    ]
    for t, match in cases:
        with pytest.raises(TensorError, match=match):
            k(t)
    with pytest.raises(TensorError, match="expected 1 input"):
        k(x, x)
    with pytest.raises(TensorError, match="output"):
        k(x, out=torch.empty(64, 4, 4, dtype=torch.float64))
    with pytest.raises(TensorError, match="other tensors say"):
        k(x, out=torch.empty(32, 4, 4))
    assert k(x).shape == x.shape  # and the kernel still works afterwards


# -- fuzzing ----------------------------------------------------------------------------------

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-10, 300), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["4", " 4 ", "1e3", "0x10", "4.0", "١٢", "1_0", "9" * 5000]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.binary(max_size=4), st.complex_numbers(),
)
PARAM_NAMES = st.sampled_from([p.name for s in all_specs() for p in s.params] + ["x", "", "n\n"])
CFG_NAMES = st.sampled_from([k for s in all_specs() for k in s.space] + ["x", ""])
EXAMPLES = {"shape": 0, "config": 0}


@settings(max_examples=1500, deadline=None)
@given(shape=st.dictionaries(st.one_of(PARAM_NAMES, st.text(max_size=8)), VALUES, max_size=6),
       need_runtime=st.booleans())
def test_fuzz_canonical_shape(shape, need_runtime):
    EXAMPLES["shape"] += 1
    for spec in all_specs():
        try:
            out = spec.canonical_shape(shape, need_runtime=need_runtime)
        except TkjitError:
            continue
        assert set(out) <= {p.name for p in spec.params}
        for p in spec.params:
            if p.name in out:
                assert p.check(out[p.name]) == out[p.name]


@settings(max_examples=1500, deadline=None)
@given(
    shape=st.fixed_dictionaries({}, optional={p.name: VALUES for p in SPEC.params}),
    config=st.one_of(
        st.dictionaries(st.one_of(CFG_NAMES, st.text(max_size=6)), VALUES, max_size=6),
        st.fixed_dictionaries({k: st.one_of(st.sampled_from(v), VALUES) for k, v in SPEC.space.items()}),
    ),
    arch=st.sampled_from([None, "cpu", "sm_90a", "sm_100a"]),
)
def test_fuzz_check_config(shape, config, arch):
    """The path get() takes: canonical shape first, then the config against it."""
    EXAMPLES["config"] += 1
    for spec in all_specs():
        try:
            full = spec.canonical_shape({"num_tokens": 64, **shape})
            cfg = spec.check_config(full, config, arch)
        except TkjitError:
            continue
        assert cfg == {k: config[k] for k in spec.space}
        assert spec.static_shape(full)


def test_fuzz_example_counts():
    print(f"\nfuzz examples: canonical_shape {EXAMPLES['shape']}, check_config {EXAMPLES['config']}")


@pytest.mark.parametrize("where", ["shape", "config"])
def test_mixed_type_keys(where):
    with pytest.raises(TkjitError):
        if where == "shape":
            SPEC.canonical_shape({1: 2, "a": 3})
        else:
            SPEC.check_config(FULL, {1: 2, "a": 3})


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
