"""topk_gate on the GPU: the default and every config of the space against the stable-sort reference.

Odd seeds draw rounded scores (ties everywhere, signed zeros, infinities); outputs are poisoned.
Any expert count 1..1024 (a partial last chunk row when lanes*vec does not divide it) and any
k <= num_experts (rounds beyond 32 run as a loop).
"""

import pytest
import torch

import tkjit
from tkjit.pool import compile_many
from tkjit.testing import check
from tkjit.timing import median, time_cuda
from tkjit_kernels.moe.topk_gate import layout

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME = "topk_gate"
TOKENS = (1, 7, 4001, 65536)
STATIC = [(256, 8), (64, 6), (16, 16), (16, 3), (32, 4), (128, 8), (384, 8), (512, 16), (256, 1), (64, 2)]
EVERY = [(256, 8), (64, 6), (16, 16)]  # every config of the space at these (416 configs)
ODD_EXPERTS = (1, 3, 72, 96, 144, 160, 288, 1000, 1024)
ODD = [(e, k) for e in ODD_EXPERTS for k in sorted({1, 6, 8, 32, e}) if k <= e]
EVERY_ODD = [(72, 6), (1000, 8)]  # every config at counts lanes*vec need not divide (240 configs)
# non-power-of-two counts and the power of two their time per token is held to (<= 1.10x)
VS_POW2 = [(72, 128), (96, 128), (144, 256), (160, 256), (288, 512)]


def _shape(e, k, t=4001):
    return {"num_tokens": t, "num_experts": e, "k": k}


@pytest.mark.parametrize("e,k", STATIC)
def test_default_config_every_size(e, k):
    for t in TOKENS:
        kern = tkjit.get(NAME, _shape(e, k, t))
        for seed in (0, 1):
            assert check(kern, _shape(e, k, t), seed=seed) is None


def _compile_defaults(pairs, tokens=4001):
    """The default configs of (num_experts, k) pairs, compiled in parallel (one get() at a time is serial)."""
    spec = tkjit.get_spec(NAME)
    jobs = []
    for e, k in pairs:
        full = spec.canonical_shape(_shape(e, k, tokens))
        jobs.append((NAME, spec.static_shape(full), spec.default_config(full, "sm_90a"), "sm_90a", "default"))
    errors = compile_many(jobs)
    assert all(err is None for _, err in errors), [err for _, err in errors if err][:5]


@pytest.fixture(scope="module")
def odd_defaults():
    _compile_defaults(ODD)


@pytest.mark.parametrize("e,k", ODD, ids=lambda v: str(v))
def test_default_config_any_expert_count(odd_defaults, e, k):
    for t in (1, 7, 4001):
        kern = tkjit.get(NAME, _shape(e, k, t))
        for seed in (0, 1):
            assert check(kern, _shape(e, k, t), seed=seed) is None, (kern.config, t, seed)
    out = kern(torch.empty(0, e, device="cuda"))
    assert out.shape == (0, k) and out.dtype == torch.int64
    # Every score equal: all ties, the answer is 0..k-1 in order on every row.
    x = torch.full((33, e), 0.5, device="cuda")
    x[::2] = -0.0
    x[1::4] = 0.0
    assert torch.equal(kern(x).cpu(), torch.arange(k).expand(33, k)), kern.config


@pytest.mark.parametrize("pairs", [EVERY, EVERY_ODD], ids=["pow2", "odd"])
def test_every_config_in_the_space(pairs):
    spec = tkjit.get_spec(NAME)
    jobs = []
    for e, k in pairs:
        full = spec.canonical_shape(_shape(e, k))
        jobs += [(NAME, spec.static_shape(full), c, "sm_90a", "explicit") for c in spec.configs(full, "sm_90a")]
    errors = compile_many(jobs)
    assert all(err is None for _, err in errors), [err for _, err in errors if err][:5]
    failures = []
    for i, (_, static, cfg, _, _) in enumerate(jobs):
        kern = tkjit.get(NAME, {**static, "num_tokens": 7}, config=cfg)
        for t in (1, 7, 4001):
            for seed in (2 * i, 2 * i + 1):
                msg = check(kern, {**static, "num_tokens": t}, seed=seed)
                if msg:
                    failures.append(msg)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def _one_lane_wins(e, k, t, cfg):
    """Scores where a single lane owns all k winners: forces the head-list fallback."""
    lanes, vec = cfg["lanes"], cfg["vec"]
    x = torch.randn(t, e)
    per_lane = layout(e, lanes, vec)[0]  # lane 0 holds a chunk of the partial row too, if there is one
    own = [((j * lanes) * vec + v) for j in range(per_lane // vec) for v in range(vec)]  # lane 0's experts
    x[:, own] = 10 + torch.rand(t, len(own))
    if len(own) > 1:
        x[::3, own[1]] = x[::3, own[0]]  # and ties inside that lane
    return x


@pytest.mark.parametrize("e,k", [(256, 8), (64, 6), (512, 16), (128, 8), (72, 6), (160, 8), (1000, 32)])
def test_head_list_fallback(e, k):
    spec = tkjit.get_spec(NAME)
    full = spec.canonical_shape(_shape(e, k))
    cfgs = [c for c in spec.configs(full, "sm_90a") if c["cache"]]
    cfgs = cfgs[:: max(1, len(cfgs) // 12)] + [spec.default_config(full, "sm_90a")]
    # in parallel up front: one get() at a time compiles serially (~5 s each)
    errors = compile_many([(NAME, spec.static_shape(full), c, "sm_90a", "explicit") for c in cfgs])
    assert all(err is None for _, err in errors), [err for _, err in errors if err][:3]
    for cfg in cfgs:
        x = _one_lane_wins(e, k, 4001, cfg).cuda()
        kern = tkjit.get(NAME, full, config=cfg)
        out = kern(x)
        ref = spec.reference(full, x.cpu())
        assert torch.equal(out.cpu(), ref), cfg


def test_bad_tensors_raise():
    kern = tkjit.get(NAME, _shape(256, 8, 64))
    x = torch.randn(64, 256, device="cuda")
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.double())
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.bfloat16())
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 256"):
        kern(torch.randn(64, 128, device="cuda"))
    with pytest.raises(tkjit.TensorError, match="dims"):
        kern(x.view(64, 16, 16))
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        kern(torch.randn(256, 64, device="cuda").t())
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x, out=torch.empty(64, 8, dtype=torch.int32, device="cuda"))
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 8"):
        kern(x, out=torch.empty(64, 6, dtype=torch.int64, device="cuda"))
    with pytest.raises(tkjit.TensorError, match="needs cuda"):
        kern(x.cpu())


def test_empty_batch():
    kern = tkjit.get(NAME, _shape(64, 6, 1))
    out = kern(torch.empty(0, 64, device="cuda"))
    assert out.shape == (0, 6) and out.dtype == torch.int64


def test_report_time_at_target():
    """Not a gate: prints the default config's time at 65536 x 256, k=8 (target <= 25 us on H200)."""
    kern = tkjit.get(NAME, _shape(256, 8, 65536))
    x = torch.randn(65536, 256, device="cuda")
    out = kern(x)
    us = median(time_cuda(lambda: kern(x, out=out)))
    print(f"\ntopk_gate 65536x256 k=8 {kern.config}: {us:.1f} us/call (median, L2 flushed)")


def _best_median(fns, rounds=3):
    """Per fn, the lowest of `rounds` medians, the fns interleaved so drift hits them alike."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], median(time_cuda(fn, reps=100)))
    return best


@pytest.mark.parametrize("k", [6, 8])
def test_report_time_per_token_vs_next_power_of_two(k):
    """A gate: a count that is not a power of two costs at most 1.10x the next power of two per token."""
    t = 65536
    _compile_defaults([(e, k) for pair in VS_POW2 for e in pair], tokens=t)
    lines, slow = [], []
    for odd, pow2 in VS_POW2:
        kerns = [tkjit.get(NAME, _shape(e, k, t)) for e in (odd, pow2)]
        xs = [torch.randn(t, e, device="cuda") for e in (odd, pow2)]
        outs = [kern(x) for kern, x in zip(kerns, xs)]
        us = _best_median([lambda kn=kn, x=x, o=o: kn(x, out=o) for kn, x, o in zip(kerns, xs, outs)])
        ratio = us[0] / us[1]
        lines.append(
            f"k={k} {odd:4d} experts: {us[0]:6.1f} us ({1e3 * us[0] / t:.3f} ns/token) {kerns[0].config} | "
            f"{pow2:4d}: {us[1]:6.1f} us ({1e3 * us[1] / t:.3f} ns/token) {kerns[1].config} | ratio {ratio:.3f}"
        )
        if ratio > 1.10:
            slow.append(lines[-1])
    print(f"\ntopk_gate {t} tokens, default configs, median of 100 (L2 flushed), best of 3:\n" + "\n".join(lines))
    assert not slow, "slower than 1.10x the next power of two:\n" + "\n".join(slow)
