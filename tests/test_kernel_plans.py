"""Plans for kernels with run-time scalars and zeroed outputs (C target): the second call of a signature
skips the full checks, yet each call's scalars reach the kernel, zeroed outputs start at zero on every
call, and a scalar of the wrong type or range still gets the full checks' error naming it."""

import pytest
import torch

import tkjit
from tkjit.errors import TensorError

pytestmark = pytest.mark.usefixtures("module_cache")  # one cache: each kernel compiles once


def _mask_reference(x, per_gpu, tp_rank, num_tp_ranks):
    spec = tkjit.get_spec("mask_indices_by_tp")
    return spec.reference({}, x, per_gpu, tp_rank, num_tp_ranks)


def test_scalar_kernel_is_planned_and_each_call_takes_its_scalars():
    k = tkjit.get("mask_indices_by_tp", {"num_tokens": 64, "num_topk": 8, "dtype": "int64"}, arch="cpu")
    x = torch.randint(-1, 64, (64, 8), dtype=torch.int64)
    assert torch.equal(k(x, 8, 0, 2), _mask_reference(x, 8, 0, 2))
    assert len(k._plans) == 1
    calls = []
    real = k._call
    k._call = lambda *a: calls.append(a) or real(*a)  # the full checks: only when no plan serves
    for per_gpu, rank, ranks in ((8, 1, 2), (4, 3, 4), (16, 0, 1)):
        assert torch.equal(k(x, per_gpu, rank, ranks), _mask_reference(x, per_gpu, rank, ranks))
    assert not calls and len(k._plans) == 1


@pytest.mark.parametrize("scalars, match", [
    ((2**31, 0, 2), "does not fit int32"),
    ((8.0, 0, 2), "scalar per_gpu must be a int, got 8.0"),
    ((True, 0, 2), "scalar per_gpu must be a int, got True"),
    (("8", 0, 2), "scalar per_gpu must be a int, got '8'"),
    ((8, 0), "missing scalar num_tp_ranks"),
])
def test_a_planned_signature_still_refuses_bad_scalars(scalars, match):
    k = tkjit.get("mask_indices_by_tp", {"num_tokens": 64, "num_topk": 8, "dtype": "int64"}, arch="cpu")
    x = torch.randint(-1, 64, (64, 8), dtype=torch.int64)
    k(x, 8, 0, 2)
    assert len(k._plans) == 1
    with pytest.raises(TensorError, match=match):
        k(x, *scalars)


def test_zeroed_outputs_start_at_zero_on_every_planned_call():
    k = tkjit.get("aux_fi", {"num_tokens": 100, "num_topk": 8, "num_experts": 72}, arch="cpu")
    idx = torch.randint(-1, 72, (100, 8), dtype=torch.int64)
    first = k(idx, 8)
    assert len(k._plans) == 1
    for _ in range(3):  # a plan that reused or forgot to zero its outputs would accumulate counts
        again = k(idx, 8)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    assert torch.equal(first[0], tkjit.get_spec("aux_fi").reference({"num_experts": 72}, idx, 8)[0])


def test_caller_sized_outputs_are_planned_per_size_given():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    import abi_specs  # noqa: F401  (registers bincount_scaled: a zeroed output sized by num_bins)

    k = tkjit.get("bincount_scaled", {"n": 64, "num_bins": 8}, arch="cpu")
    idx, w = torch.randint(-2, 14, (64,), dtype=torch.int32), torch.randn(64)
    for bins in (5, 13):
        k(idx, w, 1, True, num_bins=bins)
    assert len(k._plans) == 2
    calls = []
    real = k._call
    k._call = lambda *a: calls.append(a) or real(*a)
    for bins, scale in ((5, 2), (13, -1), (5, 3)):  # each size its own plan; scalars and zeroing per call
        want = abi_specs.bincount_reference(idx, w, bins, scale, True)
        torch.testing.assert_close(k(idx, w, scale, True, num_bins=bins), want)
    assert not calls
    k(idx, w, 1, True, num_bins=7)  # a new size: the full checks, then its own plan
    assert len(calls) == 1 and len(k._plans) == 3


def test_a_variant_without_its_optional_inputs_is_planned():
    shape = {"num_tokens": 64, "num_experts": 64, "num_topk": 4, "num_groups": 4, "num_topk_groups": 2}
    k = tkjit.get("top2_sum_gate", shape, arch="cpu")
    assert not k.spec.inputs[2].present(k.shape)  # no mask, no replica map
    logits, bias = torch.randn(64, 64), torch.randn(64)
    first = k(logits, bias, 2.5, 0, 64, 0, 1)
    assert len(k._plans) == 1
    calls = []
    real = k._call
    k._call = lambda *a: calls.append(a) or real(*a)
    for rsf in (2.5, 1.0):
        got = k(logits, bias, rsf, 0, 64, 0, 1)
        want = k.spec.reference(k.shape, logits, bias, rsf, 0, 64, 0, 1)
        assert torch.equal(got[0], want[0])  # each call's scaling factor reaches the kernel:
        assert k.spec.tolerance.check("topk_weights", got[1], want[1]) is None
    assert all(torch.equal(a, b) for a, b in zip(k(logits, bias, 2.5, 0, 64, 0, 1), first))
    assert not calls


def _abi_specs():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    import abi_specs  # registers axpy_inplace (y updated in place) and bincount_scaled (zeroed, caller-sized)

    return abi_specs


def _count_full_checks(k) -> list:
    calls = []
    real = k._call
    k._call = lambda *a: calls.append(a) or real(*a)  # the full checks: only when no plan serves
    return calls


def test_in_place_inputs_are_planned_and_updated_on_every_call():
    _abi_specs()
    k = tkjit.get("axpy_inplace", {"n": 64, "has_bias": False}, arch="cpu")
    x, y = torch.randn(64), torch.randn(64)
    want = y.clone()
    assert k(x, y, 2.0) is y
    want += 2.0 * x
    assert len(k._plans) == 1 and torch.equal(y, want)
    calls = _count_full_checks(k)
    for alpha in (0.5, -1.0):
        got = k(x, y, alpha)
        want += alpha * x
        assert got is y and torch.equal(y, want)
    assert not calls
    with pytest.raises(TensorError, match="scalar alpha"):  # a planned signature still names a bad scalar
        k(x, y, "2")


def test_out_calls_are_planned_per_out_signature():
    abi_specs = _abi_specs()
    k = tkjit.get("bincount_scaled", {"n": 64, "num_bins": 8}, arch="cpu")
    idx, w = torch.randint(-2, 14, (64,), dtype=torch.int32), torch.randn(64)
    out = torch.full((13,), 7.0)
    assert k(idx, w, 1, True, out=out) is out and len(k._out_plans) == 1
    calls = _count_full_checks(k)
    for scale in (2, -3):  # zero-filled again on every call, the call's scalars, the same tensor back
        out.fill_(7.0)
        got = k(idx, w, scale, True, out=out)
        assert got is out
        torch.testing.assert_close(out, abi_specs.bincount_reference(idx, w, 13, scale, True))
    other = torch.empty(13)
    assert k(idx, w, 1, True, out=[other]) is other  # same signature, another tensor (and out= as a list)
    assert not calls
    with pytest.raises(TensorError, match="counts axis 0"):  # another out signature: the full checks again
        k(idx, w, 1, True, num_bins=4, out=torch.empty(5))
    k(idx, w, 1, True, out=torch.empty(5))
    assert len(calls) == 2 and len(k._out_plans) == 2
    with pytest.raises(TensorError, match="must be a torch.Tensor"):
        k(idx, w, 1, True, out=[13.0])
