"""sinkhorn_fwd on the GPU: every config of the space against the reference, poisoned outputs."""

import pytest
import torch

import tkjit
from tkjit.pool import compile_many
from tkjit.testing import check

pytestmark = pytest.mark.gpu
TOKENS = (1, 7, 4001, 65536, 1048576)


def _all_configs(spec, shape):
    return spec.configs(spec.canonical_shape(shape), "sm_90a")


def test_default_config_every_size():
    for t in TOKENS:
        k = tkjit.get("sinkhorn_fwd", {"num_tokens": t})
        assert k.config_source in ("default", "tuned:user", "tuned:shipped") or k.config_source.startswith("tuned")
        for seed in (0, 1):
            assert check(k, {"num_tokens": t}, seed=seed) is None


def test_every_config_in_the_space():
    spec = tkjit.get_spec("sinkhorn_fwd")
    base = {"num_tokens": 4001, "n": 4}
    cfgs = _all_configs(spec, base)
    full = spec.canonical_shape(base)
    errors = compile_many([(spec.name, spec.static_shape(full), c, "sm_90a", "explicit") for c in cfgs])
    assert all(e is None for _, e in errors), [e for _, e in errors if e]
    failures = []
    for i, c in enumerate(cfgs):
        k = tkjit.get("sinkhorn_fwd", base, config=c)
        for t in TOKENS:
            msg = check(k, {**base, "num_tokens": t}, seed=100 + i)
            if msg:
                failures.append(msg)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("n", [2, 8])
def test_other_n(n):
    for t in (5, 4001):
        k = tkjit.get("sinkhorn_fwd", {"num_tokens": t, "n": n})
        assert check(k, {"num_tokens": t, "n": n}, seed=n) is None


def test_bad_tensors_raise():
    k = tkjit.get("sinkhorn_fwd", {"num_tokens": 64})
    x = torch.randn(64, 4, 4, device="cuda")
    with pytest.raises(tkjit.TensorError, match="dtype"):
        k(x.double())
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 4"):
        k(torch.randn(64, 3, 4, device="cuda"))
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        k(x.transpose(1, 2))
    with pytest.raises(tkjit.TensorError, match="needs cuda"):
        k(x.cpu())


def test_ops_form_and_second_process(tmp_path):
    x = torch.randn(4001, 4, 4, device="cuda")
    y = tkjit.ops.sinkhorn_fwd(x)
    ref = tkjit.get_spec("sinkhorn_fwd").reference(tkjit.get_spec("sinkhorn_fwd").canonical_shape(
        {"num_tokens": 4001}), x.cpu())
    assert torch.allclose(y.cpu(), ref, rtol=1e-5, atol=1e-6)


def test_exact_math_variant_keeps_to_the_float32_reference(monkeypatch):
    """TKJIT_EXACT_MATH=1: the shipped config without fast math or reciprocals, within 1e-6 of float32 torch
    (the fast default stays within its 1e-5 gate)."""
    from tkjit import api

    monkeypatch.setenv("TKJIT_EXACT_MATH", "1")
    api.reset()
    try:
        for t in (1, 4096, 1 << 20):
            k = tkjit.get("sinkhorn_fwd", {"num_tokens": t, "n": 4})
            assert not k.config["fast_math"] and not k.config["recip"]
            x = torch.randn(t, 4, 4, device="cuda")
            ref = k.spec.reference(k.shape, x, dtype=torch.float32)
            torch.testing.assert_close(k(x), ref, rtol=1e-6, atol=1e-7)
    finally:
        monkeypatch.delenv("TKJIT_EXACT_MATH")
        api.reset()
