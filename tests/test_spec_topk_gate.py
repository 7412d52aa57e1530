"""topk_gate spec on the CPU: shapes, constraints, reference semantics, sm_90a cross-compiles."""

import re

import pytest
import torch

import tkjit
from tkjit.errors import ConfigError, ShapeError
from tkjit.registry import get_spec
from tkjit.spec import validate
from tkjit_kernels.moe import topk_gate as mod

NAME = "topk_gate"
ODD_EXPERTS = (1, 3, 72, 96, 144, 160, 288, 1000, 1024)  # counts lanes*vec need not divide, and the bounds


@pytest.fixture(scope="module")
def spec():
    return get_spec(NAME)


def test_spec_validates(spec):
    validate(spec)
    assert spec.family == "moe"
    assert spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.configs(full, "sm_90a"), ex
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")


def test_every_expert_count_has_configs_and_a_valid_default(spec):
    for e in (16, 32, 64, 128, 256, 384, 512):
        for k in sorted({1, 2, 6, 8, 16} & set(range(1, min(e, 16) + 1))):
            full = spec.canonical_shape({"num_tokens": 100, "num_experts": e, "k": k})
            cfg = spec.default_config(full, "sm_90a")
            assert spec.check_config(full, cfg, "sm_90a") == cfg


def test_bad_shapes(spec):
    assert spec.check_shape({"num_tokens": 4, "num_experts": 16, "k": 17}) == "k=17 must be <= num_experts=16"
    with pytest.raises(ShapeError, match="k=17 must be <= num_experts=16"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 16, "k": 17})
    with pytest.raises(ShapeError, match="k=4 must be <= num_experts=3"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 3, "k": 4})
    with pytest.raises(ShapeError, match="'num_experts'=1025 above its maximum 1024"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 1025, "k": 4})
    with pytest.raises(ShapeError, match="'k'=1025 above its maximum 1024"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 1024, "k": 1025})
    with pytest.raises(ShapeError, match="'num_experts'=0 below its minimum"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 0, "k": 1})
    with pytest.raises(ShapeError, match="'k'=0 below its minimum"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 8, "k": 0})
    with pytest.raises(ShapeError, match="below its minimum"):
        spec.canonical_shape({"num_tokens": 0, "num_experts": 64, "k": 4})
    with pytest.raises(ShapeError, match="must be an int"):
        spec.canonical_shape({"num_tokens": 4, "num_experts": 64, "k": 2.5})


def test_bad_configs(spec):
    full = spec.canonical_shape({"num_tokens": 8, "num_experts": 64, "k": 6})
    base = spec.default_config(full)
    with pytest.raises(ConfigError, match="redux"):
        spec.check_config(full, {**base, "lanes": 8, "reduce": "redux"})
    with pytest.raises(ConfigError, match="spill"):
        spec.check_config(
            spec.canonical_shape({"num_tokens": 8, "num_experts": 512, "k": 6}), {**base, "lanes": 4, "cache": 0}
        )
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, base, "cpu")
    odd = spec.canonical_shape({"num_tokens": 8, "num_experts": 70, "k": 6})
    with pytest.raises(ConfigError, match="vec=4 loads need num_experts=70 to be a multiple of 4"):
        spec.check_config(odd, {**base, "vec": 4})
    with pytest.raises(ConfigError, match="lanes\\*vec=128 > num_experts=72: some lanes would hold no expert"):
        spec.check_config(spec.canonical_shape({"num_tokens": 8, "num_experts": 72, "k": 6}), {**base, "lanes": 32})
    big = spec.canonical_shape({"num_tokens": 8, "num_experts": 256, "k": 33})
    with pytest.raises(ConfigError, match="k > 32 runs its rounds as a loop"):
        spec.check_config(big, {**spec.default_config(big), "cache": 2})


def test_todays_expert_counts_keep_their_default_layout(spec):
    # The fast path for the counts served before arbitrary counts: these layouts are what was tuned.
    want = {16: (2, 4), 32: (4, 4), 64: (8, 4), 128: (16, 4), 256: (32, 4), 384: (32, 4), 512: (32, 4)}
    for e, (lanes, vec) in want.items():
        for k in (1, 6, 8, 16):
            c = mod.default({"num_experts": e, "k": k})
            assert (c["lanes"], c["vec"]) == (lanes, vec), (e, k, c)
            assert mod.layout(e, lanes, vec) == (e // lanes, e // (lanes * vec), 0)  # no partial row
    assert mod.default({"num_experts": 256, "k": 8})["cache"] == 2
    assert mod.default({"num_experts": 64, "k": 6})["cache"] == 4


def test_default_is_valid_for_every_expert_count_and_k(spec):
    """Every num_experts in 1..1024 and every k in 1..num_experts: an allowed default config that does
    no more per-lane work than the next power of two's (the basis of the time-per-token promise)."""
    for e in range(1, 1025):
        pow2 = 1 << (e - 1).bit_length()
        for k in range(1, e + 1):
            shape = {"num_tokens": 1, "num_experts": e, "k": k}
            assert mod.check_shape(shape) is None
            c = mod.default(shape)
            problem = mod.constraint(shape, c)
            assert problem is None, (e, k, c, problem)
        cp = mod.default({"num_experts": pow2, "k": min(k, pow2)})
        assert c["lanes"] == cp["lanes"], (e, c, cp)
        assert mod.layout(e, c["lanes"], c["vec"])[0] <= mod.layout(pow2, cp["lanes"], cp["vec"])[0], (e, c, cp)
        if e in ODD_EXPERTS or e % 97 == 0:  # the whole spec path (canonical shape, arch rules) on a sample
            for k in sorted({1, min(e, 8), min(e, 32), e}):
                full = spec.canonical_shape({"num_tokens": 100, "num_experts": e, "k": k})
                cfg = spec.default_config(full, "sm_90a")
                assert spec.check_config(full, cfg, "sm_90a") == cfg
                assert cfg in spec.configs(full, "sm_90a")


def test_layout_covers_every_expert_once(spec):
    """Each allowed (lanes, vec) places experts 0..E-1 on exactly one (lane, slot) each; the slots the
    kernel pads (partial row, lanes >= valid_lanes) are exactly those past the row's end."""
    for e in range(1, 1025):
        for lanes in spec.space["lanes"]:
            for vec in spec.space["vec"]:
                c = {"lanes": lanes, "vec": vec, "threads": 128, "tokens_per_group": 1, "cache": 0, "reduce": "shfl"}
                if mod.constraint({"num_experts": e, "k": 1}, c):
                    continue
                per_lane, rows, valid_lanes = mod.layout(e, lanes, vec)
                slot = torch.arange(per_lane)
                lane = torch.arange(lanes)[:, None]
                idx = (slot // vec * lanes + lane) * vec + slot % vec  # the kernel's slot_index + lane * vec
                padded = (slot >= rows * vec) & (lane >= valid_lanes)
                assert torch.equal(padded, idx >= e), (e, lanes, vec)
                assert sorted(idx[~padded].tolist()) == list(range(e)), (e, lanes, vec)
                assert vec == 1 or e % vec == 0  # vector loads stay inside the row and aligned


def _keys(x):
    """The kernel's order-preserving uint32 keys (as int64), -0 folded into +0."""
    b = (x + 0.0).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(b >= 1 << 31, b ^ 0xFFFFFFFF, b | (1 << 31))


def _model_rounds(e, k, lanes, vec, x):
    """The kernel's cache=0 rounds on its register layout, padded slots holding key 0."""
    per_lane, rows, valid_lanes = mod.layout(e, lanes, vec)
    slot = torch.arange(per_lane)
    lane = torch.arange(lanes)[:, None]
    idx = ((slot // vec * lanes + lane) * vec + slot % vec).reshape(-1)
    padded = ((slot >= rows * vec) & (lane >= valid_lanes)).reshape(-1)
    keys = torch.where(padded, 0, _keys(x)[:, idx.clamp(max=e - 1)])
    out = []
    for _ in range(k):
        # larger key first, then the smaller index: one max over (key, 2047 - index)
        best = (keys * 2048 + (2047 - idx)).argmax(-1)
        win = idx[best]
        out.append(win)
        keys = torch.where(idx == win[:, None], 0, keys)
    return torch.stack(out, -1)


@pytest.mark.parametrize("e", ODD_EXPERTS)
def test_padded_slots_never_win_in_a_model_of_the_rounds(spec, e):
    # Tie-heavy inputs (odd seed: rounded scores, signed zeros, infinities) and k up to num_experts.
    c = mod.default({"num_experts": e, "k": 1})
    for k in sorted({1, min(e, 6), min(e, 33), e}):
        shape = spec.canonical_shape({"num_tokens": 64, "num_experts": e, "k": k})
        for seed in (0, 1):
            (x,) = spec.make_inputs(shape, "cpu", seed)
            assert torch.equal(_model_rounds(e, k, c["lanes"], c["vec"], x), spec.reference(shape, x)), (k, seed)


def test_reference_hand_checked(spec):
    s = {"num_tokens": 2, "num_experts": 16, "k": 4}
    x = torch.zeros(2, 16)
    x[0, :] = torch.arange(16.0)  # increasing: best are 15, 14, 13, 12
    x[1, :] = 1.0
    x[1, 9] = 3.0
    x[1, 4] = 2.0
    x[1, 7] = 2.0  # tie 2.0 at 4 and 7 -> 4 first; then the 1.0s from index 0
    out = spec.reference(s, x)
    assert out.dtype == torch.int64 and out.shape == (2, 4)
    assert out.tolist() == [[15, 14, 13, 12], [9, 4, 7, 0]]


def test_reference_signed_zero_and_inf_ties(spec):
    s = {"num_tokens": 1, "num_experts": 16, "k": 6}
    x = torch.full((1, 16), float("-inf"))
    x[0, 3] = -0.0
    x[0, 1] = 0.0
    x[0, 12] = float("inf")
    # -0 == +0 (stable: index 1 before 3); then -inf in index order.
    assert spec.reference(s, x).tolist() == [[12, 1, 3, 0, 2, 4]]


def test_make_inputs_have_ties_on_odd_seeds(spec):
    s = spec.canonical_shape({"num_tokens": 64, "num_experts": 64, "k": 8})
    (a,) = spec.make_inputs(s, "cpu", 0)
    (b,) = spec.make_inputs(s, "cpu", 1)
    assert a.dtype == torch.float32 and a.shape == (64, 64)
    assert a.unique().numel() > 0.99 * a.numel()
    assert b.unique().numel() < 0.1 * b.numel()  # rounded values: many ties
    assert torch.isinf(b).any() and (torch.signbit(b) & (b == 0)).any()
    (a2,) = spec.make_inputs(s, "cpu", 0)
    assert torch.equal(a, a2)


def test_bytes_moved(spec):
    s = {"num_tokens": 65536, "num_experts": 256, "k": 8}
    assert spec.bytes_moved(s) == 65536 * (256 * 4 + 8 * 8)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,config",
    [
        ({"num_experts": 256, "k": 8}, None),  # default: warp per token, redux, head lists
        ({"num_experts": 64, "k": 6}, None),
        (
            {"num_experts": 256, "k": 8},
            {"lanes": 8, "vec": 4, "threads": 256, "tokens_per_group": 2, "cache": 4, "reduce": "shfl"},
        ),
        (
            {"num_experts": 16, "k": 16},
            {"lanes": 1, "vec": 1, "threads": 128, "tokens_per_group": 1, "cache": 0, "reduce": "shfl"},
        ),
        (
            {"num_experts": 384, "k": 6},
            {"lanes": 32, "vec": 4, "threads": 128, "tokens_per_group": 1, "cache": 0, "reduce": "shfl"},
        ),
    ],
)
def test_compiles_for_sm90a(cache_dir, shape, config):
    k = tkjit.get(NAME, {"num_tokens": 4001, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "topk_gate" in src
    if k.config["reduce"] == "redux":
        assert "__reduce_max_sync" in src
    else:
        assert "__reduce_max_sync" not in src
    assert not _looped_rounds(src)  # rounds unrolled (k <= 32): results stay in registers


def _looped_rounds(src):
    """Bounds of the round loops (`for (int r...`) the source leaves rolled (no `#pragma unroll`)."""
    loops = re.finditer(r"(#pragma unroll\s*)?for \(int r(?:_\d+)? = 0; r\S* < (\d+);", src)
    return [int(m[2]) for m in loops if not m[1]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "e,k", [(e, k) for e in ODD_EXPERTS for k in sorted({1, 6, 8, 32, e}) if k <= e], ids=lambda v: str(v)
)
def test_any_expert_count_compiles_for_sm90a(module_cache, spec, e, k):
    shape = {"num_tokens": 4001, "num_experts": e, "k": k}
    kern = tkjit.get(NAME, shape, arch="sm_90a")
    src = (kern.path / "kernel.cu").read_text()
    c = kern.config
    per_lane, rows, valid_lanes = mod.layout(e, c["lanes"], c["vec"])
    # A partial row is guarded by the lane test; a divided one compiles without it.
    assert (f"& {c['lanes'] - 1}) < {valid_lanes})" in src) == (per_lane > rows * c["vec"]), src
    # More than 32 rounds run as a loop that stores each winner at once.
    assert _looped_rounds(src) == ([k] if k > mod.MAX_UNROLLED_K else [])
