"""mask_indices_by_tp on a CPU host: the spec, its reference against TileKernels' formula (written out
here), run-time scalars on TileLang's C target (one binary for every rank), an sm_90a cross-compile,
the torch op and the TileKernels compat entry with its argument checks."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.testing import check

pytestmark = pytest.mark.usefixtures("module_cache")
NAME = "mask_indices_by_tp"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# (n, num_ep_ranks, num_tp_ranks): DeepSeek-like and odd layouts, n not always a multiple of num_ep_ranks
LAYOUTS = [(256, 8, 2), (256, 8, 1), (72, 4, 3), (256, 32, 4), (72, 72, 8), (100, 7, 3), (9, 1, 9)]


def spec():
    return tkjit.get_spec(NAME)


def tk_formula(x, n, num_ep_ranks, tp_rank, num_tp_ranks):
    """TileKernels' reference steps: shift by the rank, subtract the DP groups' gaps, -1 where invalid."""
    per_gpu = n // num_ep_ranks
    per_dp = num_tp_ranks * per_gpu
    v = x.long()
    invalid = (v < 0) | (torch.div(v, per_gpu, rounding_mode="floor") % num_tp_ranks != tp_rank)
    v = v - tp_rank * per_gpu
    v = v - torch.div(v, per_dp, rounding_mode="floor") * (per_dp - per_gpu)
    v[invalid | (v < 0)] = -1
    return v.to(x.dtype)


def test_registered_and_valid():
    s = spec()
    assert s.family == "moe" and s.tolerance.exact
    assert [a.name for a in s.scalars] == ["per_gpu", "tp_rank", "num_tp_ranks"]
    for ex in s.examples:
        full = s.canonical_shape(ex)
        assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
        assert s.default_config(full, "cpu") in s.configs(full, "cpu")
    assert s.default_config(s.canonical_shape({"num_tokens": 8192, "num_topk": 8, "dtype": "int64"})) == {
        "block_elems": 256, "threads": 128, "vec": 2}
    for k in range(1, 65):
        for dt in ("int32", "int64"):
            f = s.canonical_shape({"num_tokens": 7, "num_topk": k, "dtype": dt})
            assert s.constraint(f, s.default_config(f)) is None, (k, dt)


@pytest.mark.parametrize("shape, match", [
    ({"num_tokens": 8, "num_topk": 0}, "num_topk"),
    ({"num_tokens": 8, "num_topk": 65}, "num_topk"),
    ({"num_tokens": 8, "num_topk": 8, "dtype": "int16"}, "dtype"),
    ({"num_tokens": 0, "num_topk": 8}, "num_tokens"),
])
def test_bad_shapes(shape, match):
    with pytest.raises(ShapeError, match=match):
        spec().canonical_shape(shape)


def test_bad_configs():
    s = spec()
    full = s.canonical_shape({"num_tokens": 8, "num_topk": 6, "dtype": "int64"})
    good = s.default_config(full)
    with pytest.raises(ConfigError, match="exceed 16 bytes"):
        s.check_config(full, {**good, "vec": 4})
    odd = s.canonical_shape({"num_tokens": 8, "num_topk": 9, "dtype": "int32"})
    with pytest.raises(ConfigError, match="multiple of 2"):
        s.check_config(odd, {**s.default_config(odd), "vec": 2})
    with pytest.raises(ConfigError, match="multiple of threads"):
        s.check_config(full, {**good, "block_elems": 128, "threads": 128, "vec": 2})


@pytest.mark.parametrize("n, ep, tps", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_reference_is_tile_kernels_formula(n, ep, tps, dtype):
    s = spec()
    x = torch.randint(-3, 2 * n, (50, 8), dtype=dtype)
    for tp in range(tps):
        got = s.reference({}, x, n // ep, tp, tps)
        assert got.dtype == dtype and torch.equal(got, tk_formula(x, n, ep, tp, tps)), tp
    # Every expert of the model lands on exactly one TP rank, at a distinct local index there.
    experts = torch.arange(n // ep * ep, dtype=dtype)[:, None]
    owners = torch.stack([s.reference({}, experts, n // ep, tp, tps)[:, 0] for tp in range(tps)])
    assert torch.equal((owners >= 0).sum(0), torch.ones(n // ep * ep, dtype=torch.int64))
    for tp in range(tps):
        local = owners[tp][owners[tp] >= 0]
        assert torch.equal(local, torch.arange(local.numel(), dtype=dtype))


def test_reference_hand_checked():
    # 16 experts on 4 GPUs (4 each), 2 TP ranks: rank 1 owns GPUs 1 and 3 -> experts 4..7, 12..15.
    x = torch.tensor([[0, 4, 7, 8, 12, 15, -1, 16]])
    assert spec().reference({}, x, 4, 1, 2).tolist() == [[-1, 0, 3, -1, 4, 7, -1, -1]]
    assert spec().reference({}, x, 4, 0, 2).tolist() == [[0, -1, -1, 4, -1, -1, -1, 8]]


@pytest.mark.parametrize("dtype, k", [("int64", 8), ("int32", 8), ("int64", 9), ("int32", 6), ("int64", 1)])
def test_c_target_runs_one_binary_for_every_rank(dtype, k):
    shape = {"num_tokens": 100, "num_topk": k, "dtype": dtype}
    kern = tkjit.get(NAME, shape, arch="cpu")
    for t in (1, 7, 4001):
        for seed in (0, 1):
            assert check(kern, {**shape, "num_tokens": t}, device="cpu", seed=seed) is None, (t, seed)
    x = torch.randint(-2, 300, (333, k), dtype=getattr(torch, dtype))
    for n, ep, tps in LAYOUTS:
        for tp in range(tps):
            assert torch.equal(kern(x, n // ep, tp, tps), tk_formula(x, n, ep, tp, tps)), (n, ep, tps, tp)
        assert tkjit.get(NAME, {**shape, "num_tokens": 5}, arch="cpu").key == kern.key
    # Scalars the ops refuse never divide by zero in the kernel: everything is -1.
    for bad in ((0, 0, 2), (4, 0, 0), (-4, 0, 1), (4, 0, -2)):
        assert bool((kern(x, *bad) == -1).all()), bad
    assert bool((kern(x, 4, 5, 2) == -1).all())  # a tp_rank past the ranks keeps nothing
    assert kern(torch.empty(0, k, dtype=getattr(torch, dtype)), 4, 0, 2).shape == (0, k)


def test_every_cpu_config_of_a_shape():
    s = spec()
    full = s.canonical_shape({"num_tokens": 100, "num_topk": 8, "dtype": "int32"})
    configs = [c for c in s.configs(full, "cpu") if c["threads"] == 128 and c["block_elems"] in (512, 8192)]
    assert len(configs) >= 3
    for cfg in configs:
        kern = tkjit.get(NAME, full, arch="cpu", config=cfg)
        assert check(kern, {**full, "num_tokens": 1001}, device="cpu", seed=3) is None, cfg


def test_cross_compiles_for_sm90a():
    kern = tkjit.get(NAME, {"num_tokens": 8192, "num_topk": 8, "dtype": "int64"}, arch="sm_90a")
    src = (kern.path / "kernel.cu").read_text()
    assert "per_gpu" in src and "tp_rank" in src  # run-time arguments, not constants


# -- torch op ----------------------------------------------------------------------------------------

def test_op_opcheck_fake_and_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.mask_indices_by_tp.default
    assert ("(Tensor indices, int n, int num_ep_ranks, int tp_rank, int num_tp_ranks, str? config=None) -> Tensor"
            in str(op._schema))
    for dtype in (torch.int32, torch.int64):
        for t in (37, 0):
            x = torch.randint(-1, 256, (t, 8), dtype=dtype)
            got = torch.library.opcheck(op, (x, 256, 8, 1, 2), test_utils=OPCHECK_TESTS)
            assert got == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode():
        y = op(torch.empty(13, 6, dtype=torch.int32), 72, 4, 2, 3)
        assert y.shape == (13, 6) and y.dtype == torch.int32
    with pytest.raises(ShapeError, match="tp_rank"):
        op(torch.empty(5, 8, dtype=torch.int64, device="meta"), 256, 8, 2, 2)
    with pytest.raises(TensorError, match="dtype"):
        op(torch.empty(5, 8, dtype=torch.int16, device="meta"), 256, 8, 0, 2)


def test_op_eager_and_compiled():
    x = torch.randint(-1, 300, (333, 8))
    want = tk_formula(x, 256, 8, 1, 2)
    assert torch.equal(tkjit.ops.mask_indices_by_tp(x, 256, 8, 1, 2), want)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, tp):
        return tkjit.ops.mask_indices_by_tp(x, 256, 8, tp, 2) + 0

    assert torch.equal(f(x, 1), want)
    assert torch.equal(f(x, 0), tk_formula(x, 256, 8, 0, 2))


def test_check_indices_flag(monkeypatch):
    x = torch.tensor([[0, 300]])
    monkeypatch.setenv("TKJIT_CHECK_INDICES", "1")
    with pytest.raises(TensorError, match=r"indices\[0, 1\] = 300 is out of range \[-1, 256\)"):
        tkjit.ops.mask_indices_by_tp(x, 256, 8, 0, 2)


# -- compat ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_compat_matches_tile_kernels(dtype):
    for n, ep, tps in [(256, 8, 2), (72, 4, 3)]:
        x = torch.randint(-1, n, (4001, 8), dtype=dtype)
        for tp in range(tps):
            y = tk.moe.mask_indices_by_tp(x, n, ep, tp, tps)
            assert y.dtype == dtype and y.is_contiguous() and torch.equal(y, tk_formula(x, n, ep, tp, tps))
    empty = tk.moe.mask_indices_by_tp(torch.empty(0, 8, dtype=dtype), 256, 8, 0, 2)
    assert empty.shape == (0, 8) and empty.dtype == dtype
    strided = torch.randint(-1, 256, (8, 40), dtype=dtype)[:, ::5]
    assert torch.equal(tk.moe.mask_indices_by_tp(strided, 256, 8, 1, 2), tk_formula(strided, 256, 8, 1, 2))


@pytest.mark.parametrize("args, err, match", [
    ((torch.zeros(4, 8, dtype=torch.float32), 256, 8, 0, 2), TensorError, "indices must be torch.int32, torch.int64"),
    ((torch.zeros(4, dtype=torch.int64), 256, 8, 0, 2), TensorError, "indices must be 2-D"),
    ((torch.zeros(4, 8, dtype=torch.int64), 256, 0, 0, 2), ShapeError, "num_ep_ranks"),
    ((torch.zeros(4, 8, dtype=torch.int64), 4, 8, 0, 2), ShapeError, r"n \(4\) must be >= num_ep_ranks"),
    ((torch.zeros(4, 8, dtype=torch.int64), 256, 8, 2, 2), ShapeError, "tp_rank"),
    ((torch.zeros(4, 8, dtype=torch.int64), 256, 8, -1, 2), ShapeError, "tp_rank"),
    ((torch.zeros(4, 8, dtype=torch.int64), 256, 8, 0, 0), ShapeError, "num_tp_ranks"),
    ((torch.zeros(4, 8, dtype=torch.int64), 256.0, 8, 0, 2), ShapeError, "n must be an int"),
    ((torch.zeros(4, 8, dtype=torch.int64), 256, 8, True, 2), ShapeError, "tp_rank must be an int"),
    ((torch.zeros(4, 8, dtype=torch.int64), 1 << 40, 1, 0, 2), ShapeError, "exceeds int32"),
])
def test_compat_argument_errors(args, err, match):
    with pytest.raises(err, match=match) as e:
        tk.moe.mask_indices_by_tp(*args)
    assert str(e.value).startswith("tile_kernels.moe.mask_indices_by_tp: ")


def test_compat_too_many_indices_per_token_is_not_implemented():
    with pytest.raises(NotImplementedError, match="num_topk"):
        tk.moe.mask_indices_by_tp(torch.zeros(4, 65, dtype=torch.int64), 256, 8, 0, 2)


@pytest.mark.parametrize("vec", [1, 2])
def test_int64_indices_past_31_bits_take_the_long_path(vec):
    """int64 indices that fit 31 bits divide in int32 (the fast path); -1 needs no division; larger ones (past
    n, as TileKernels allows) take the int64 formula: every boundary gives the reference's value."""
    big = [0, 5, 31, 32, (1 << 31) - 2, (1 << 31) - 1, 1 << 31, (1 << 31) + 33, (1 << 32) + 1, (1 << 62) + 7,
           (1 << 63) - 1, -1, -(1 << 31), -(1 << 63)]
    x = torch.tensor(big * 2, dtype=torch.int64).reshape(-1, 2)
    kern = tkjit.get(NAME, {"num_tokens": x.shape[0], "num_topk": 2, "dtype": "int64"}, arch="cpu",
                     config={"block_elems": 128 * vec, "threads": 128, "vec": vec})
    for per_gpu, tp, tps in ((32, 1, 2), (9, 2, 3), (1, 0, 1), (7, 0, 4)):
        assert torch.equal(kern(x, per_gpu, tp, tps), spec().reference({}, x, per_gpu, tp, tps)), (per_gpu, tp, tps)
