"""per_token_cast on the GPU: the default and every config of the space, bit-exact, poisoned outputs."""

import pytest
import torch

import tkjit
from tkjit.compiler import compile_many
from tkjit.testing import check

pytestmark = pytest.mark.gpu
NAME = "per_token_cast"
STATIC = [
    {"hidden": 7168, "group": 128},
    {"hidden": 7168, "group": 128, "round_scale": True},
    {"hidden": 4096, "group": 128, "in_dtype": "float32"},
    {"hidden": 4096, "group": 64},
    {"hidden": 576, "group": 32},
    {"hidden": 576, "group": 64, "in_dtype": "float32", "round_scale": True},
    {"hidden": 576, "group": 576},
    {"hidden": 7168, "group": 7168},
    {"hidden": 7168, "group": 7168, "in_dtype": "float32"},
    {"hidden": 1152, "group": 1152, "in_dtype": "float32", "round_scale": True},
    {"hidden": 16, "group": 16},
]
EVERY = [
    {"hidden": 7168, "group": 128},
    {"hidden": 7168, "group": 7168, "in_dtype": "float32"},
    {"hidden": 576, "group": 576, "round_scale": True},
    {"hidden": 576, "group": 32, "in_dtype": "float32"},
    {"hidden": 4096, "group": 64, "round_scale": True},
]


@pytest.mark.parametrize("static", STATIC, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_default_config_every_size(static):
    tokens = (1, 7, 4001, 65536) if static["hidden"] <= 1152 else (1, 7, 4001)
    for t in tokens:
        kern = tkjit.get(NAME, {**static, "num_tokens": t})
        for seed in (0, 1):
            assert check(kern, {**static, "num_tokens": t}, seed=seed) is None


def test_deepseek_size():
    static = {"hidden": 7168, "group": 128}
    kern = tkjit.get(NAME, {**static, "num_tokens": 32768})
    assert check(kern, {**static, "num_tokens": 32768}, seed=5) is None


def test_every_config_in_the_space():
    spec = tkjit.get_spec(NAME)
    jobs = []
    for static in EVERY:
        full = spec.canonical_shape({**static, "num_tokens": 7})
        jobs += [(NAME, spec.static_shape(full), c, "sm_90a", "explicit") for c in spec.configs(full, "sm_90a")]
    errors = compile_many(jobs)
    assert all(err is None for _, err in errors), [err for _, err in errors if err][:5]
    failures = []
    for i, (_, static, cfg, _, _) in enumerate(jobs):
        kern = tkjit.get(NAME, {**static, "num_tokens": 7}, config=cfg)
        for t in (1, 7, 4001):
            msg = check(kern, {**static, "num_tokens": t}, seed=i)
            if msg:
                failures.append(msg)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_bad_tensors_raise():
    kern = tkjit.get(NAME, {"num_tokens": 64, "hidden": 576, "group": 64})
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.float())  # compiled for bf16
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 576"):
        kern(torch.randn(64, 512, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        kern(torch.randn(576, 64, device="cuda", dtype=torch.bfloat16).t())
    out = torch.empty(64, 576, device="cuda", dtype=torch.float8_e4m3fn)
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 9"):
        kern(x, out=(out, torch.empty(64, 8, device="cuda")))
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x, out=(out.view(torch.uint8), torch.empty(64, 9, device="cuda")))
    with pytest.raises(tkjit.TensorError, match="other tensors say"):
        kern(x, out=(torch.empty(32, 576, device="cuda", dtype=torch.float8_e4m3fn), torch.empty(32, 9, device="cuda")))


def test_returns_values_and_scales():
    kern = tkjit.get(NAME, {"num_tokens": 5, "hidden": 4096, "group": 128})
    x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    q, s = kern(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 4096)
    assert s.dtype == torch.float32 and s.shape == (5, 32)
    deq = q.float() * s.repeat_interleave(128, 1)
    assert torch.allclose(deq, x.float(), rtol=0.07, atol=1e-3)


def test_report_time_at_target():
    """Not a gate: prints the default config's time at 32768 x 7168 bf16 (target <= 170 us on H200)."""
    kern = tkjit.get(NAME, {"num_tokens": 32768, "hidden": 7168, "group": 128})
    x = torch.randn(32768, 7168, device="cuda", dtype=torch.bfloat16)
    out = kern(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        kern(x, out=out)
    start.record()
    for _ in range(50):
        kern(x, out=out)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 20
    gbs = kern.spec.bytes_moved(kern.shape | {"num_tokens": 32768}) / us / 1e3
    print(f"\nper_token_cast 32768x7168 bf16 g128 {kern.config}: {us:.1f} us/call, {gbs:.0f} GB/s")
