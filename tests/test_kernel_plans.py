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
