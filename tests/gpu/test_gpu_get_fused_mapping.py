"""get_fused_mapping on the GPU: every config of the space (a cooperative launch: the grid barrier) against
the spec reference, bit-exact at odd and large sizes, and every output against TileKernels as oracle."""

import pytest
import torch

import tkjit
import tkjit.compat.tile_kernels
import tkjit.ops
from tkjit.errors import ShapeError, TensorError
from tkjit.pool import compile_many
from tkjit.testing import check
from tkjit_kernels.moe.get_fused_mapping import WS_ROWS, upper_bound

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME = "get_fused_mapping"
STATIC = [(8, 256, 128), (8, 256, 64), (6, 72, 1), (9, 72, 64), (2, 256, 128), (16, 1024, 128), (1, 1, 1),
          (4, 1000, 3)]  # (k, experts, alignment)
EVERY = [(8, 256, 128), (9, 72, 64)]  # every config of the space at these
SIZES = ((1, None), (7, None), (4001, None), (65536, None), (4001, 10), (333, 1 << 20))  # (tokens, nexp)


def _shape(t, k, e, a, nexp=None):
    return {"num_tokens": t, "num_topk": k, "num_experts": e, "alignment": a,
            "num_expanded_tokens": upper_bound(t, k, e, a) if nexp is None else nexp}


def _equal(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu()), i


def _same_mapping(ours, theirs, k):
    """Equal up to the order of the entries inside each expert's segment: the layout (segments, padding,
    counts, the synced list) bit for bit, the same (token, slot) entries in each segment, and maps that
    agree with each other. TileKernels' order inside a segment follows its warps' chunks of the flat
    entries (reversed inside each chunk), so it depends on its SM count; tkjit's is the flat order."""
    ours, theirs = [t.cpu() if isinstance(t, torch.Tensor) else t for t in ours], \
        [t.cpu() if isinstance(t, torch.Tensor) else t for t in theirs]
    for i in (0, 4, 5, 6):
        assert ours[i].dtype == theirs[i].dtype and torch.equal(ours[i], theirs[i]), i
    assert ours[7] == theirs[7]
    for o in (ours, theirs):
        assert o[1].shape == o[2].shape == o[0].shape and o[3].dtype == torch.int32
    n = ours[3].numel() + 1
    key = lambda m: torch.sort(m[0].to(torch.int64) * n + m[2]).values  # noqa: E731
    assert torch.equal(key(ours), key(theirs))
    assert torch.equal(ours[3] >= 0, theirs[3] >= 0)
    used = ours[2] >= 0
    pos = torch.arange(ours[2].numel(), dtype=torch.int32)
    assert torch.equal(ours[1][used], ours[2][used] // k)
    assert torch.equal(ours[3].reshape(-1)[ours[2][used].long()], pos[used])


@pytest.fixture(scope="module")
def every_config():
    spec = tkjit.get_spec(NAME)
    jobs = []
    for k, e, a in STATIC:
        full = spec.canonical_shape(_shape(4001, k, e, a))
        configs = spec.configs(full, "sm_90a") if (k, e, a) in EVERY else [spec.default_config(full, "sm_90a")]
        jobs += [(NAME, spec.static_shape(full), c, "sm_90a", "explicit") for c in configs]
    errors = compile_many(jobs)
    assert all(err is None for _, err in errors), [err for _, err in errors if err][:5]


@pytest.mark.parametrize("k,e,a", STATIC, ids=str)
def test_configs_at_odd_and_large_sizes(every_config, k, e, a):
    spec = tkjit.get_spec(NAME)
    full = spec.canonical_shape(_shape(4001, k, e, a))
    configs = spec.configs(full, "sm_90a") if (k, e, a) in EVERY else [spec.default_config(full, "sm_90a")]
    for c in configs:
        for t, nexp in SIZES:
            kern = tkjit.get(NAME, _shape(t, k, e, a, nexp), config=c)
            for seed in (0, 1) if t < 65536 else (1,):
                assert check(kern, _shape(t, k, e, a, nexp), seed=seed) is None


def test_default_serves_bench_shapes():
    for shape in (_shape(8192, 8, 256, 128), _shape(8192, 8, 256, 64), _shape(4001, 8, 256, 128)):
        assert check(tkjit.get(NAME, shape), shape, seed=1) is None


def test_op_zero_tokens_all_minus_one_rows_and_drops():
    *outs, counts = tkjit.ops.get_fused_mapping(torch.empty(0, 8, dtype=torch.int64, device="cuda"), 256, 0, 128)
    assert counts == [0] * 256 and outs[0].numel() == 0
    x = torch.full((4001, 8), -1, dtype=torch.int64, device="cuda")
    *outs, counts = tkjit.ops.get_fused_mapping(x, 256, 0, 128)
    assert counts == [0] * 256 and (outs[3] == -1).all()
    x = torch.randint(0, 8, (4001, 8), device="cuda")
    *outs, _ = tkjit.ops.get_fused_mapping(x, 8, 1000, 64)
    spec = tkjit.get_spec(NAME)
    _equal(outs, spec.reference(_shape(4001, 8, 8, 64, 1000), x.cpu()))
    *outs, counts = tkjit.ops.get_fused_mapping(x, 8, 0, 64, force_no_sync=True)
    assert counts == [] and outs[0].numel() == 0 and (outs[3] == -1).all()


def test_out_of_range_entries_are_skipped():
    spec = tkjit.get_spec(NAME)
    shape = spec.canonical_shape(_shape(4001, 8, 256, 128))
    x, _ = spec.make_inputs(shape, "cuda", seed=1)  # odd seed: -7, 256, 2**40, -2**33 entries
    *outs, _ = tkjit.ops.get_fused_mapping(x, 256, shape["num_expanded_tokens"], 128)
    _equal(outs, spec.reference(shape, x.cpu()))


def test_op_opcheck_compile_and_cuda_graph():
    x = torch.randint(-1, 256, (4001, 8), device="cuda")
    nexp = upper_bound(4001, 8, 256, 128)
    op = torch.ops.tkjit.get_fused_mapping.default
    result = torch.library.opcheck(op, (x, 256, nexp, 128))
    assert all(v == "SUCCESS" for v in result.values()), result
    eager = tkjit.ops.get_fused_mapping(x, 256, nexp, 128)[:7]
    f = torch.compile(lambda t: tkjit.ops.get_fused_mapping(t, 256, nexp, 128)[:7], fullgraph=True)
    _equal(f(x), eager)
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):  # the cooperative launch is captured
        got = tkjit.ops.get_fused_mapping(x, 256, nexp, 128)[:7]
    x.copy_(torch.randint(-1, 256, (4001, 8), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    _equal(got, tkjit.ops.get_fused_mapping(x, 256, nexp, 128)[:7])


def test_bad_input_errors():
    x = torch.randint(0, 16, (64, 4), device="cuda")
    with pytest.raises(TensorError, match="contiguous"):
        tkjit.ops.get_fused_mapping(x.t().contiguous().t(), 16, 0, 8)
    with pytest.raises(TensorError, match="dtype"):
        tkjit.ops.get_fused_mapping(x.int(), 16, 0, 8)
    with pytest.raises(ShapeError):
        tkjit.ops.get_fused_mapping(x, 16, -1, 8)
    ws = torch.empty(WS_ROWS, 16, dtype=torch.int32, device="cuda")
    kern = tkjit.get(NAME, _shape(64, 4, 16, 8))
    with pytest.raises(TensorError):
        kern(x, ws[:, :8], num_expanded_tokens=100)


# -- TileKernels as oracle ----------------------------------------------------------------------------

def _routing(t, k, e, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(t, e, generator=g).topk(k, dim=-1).indices if k <= e else torch.randint(0, e, (t, k), generator=g)
    idx = torch.where(torch.rand(t, k, generator=g) < 0.1, -1, idx)
    return idx.contiguous().cuda()


@pytest.mark.parametrize("k", [2, 6, 8, 9])
@pytest.mark.parametrize("e", [72, 256])
@pytest.mark.parametrize("a", [1, 64, 128])
def test_against_tile_kernels(k, e, a):
    tk = pytest.importorskip("tile_kernels")
    x = _routing(4001, k, e, seed=k * e + a)
    for nexp in (0, upper_bound(4001, k, e, a)):
        ours = tkjit.compat.tile_kernels.moe.get_fused_mapping(x, e, nexp, a)
        theirs = tk.moe.get_fused_mapping(x, e, nexp, a)
        _same_mapping(ours, theirs, k)


@pytest.mark.parametrize("case", ["all_minus_one", "one_expert", "zero_tokens"])
def test_against_tile_kernels_edge_cases(case):
    tk = pytest.importorskip("tile_kernels")
    if case == "all_minus_one":
        x, e = torch.full((4001, 8), -1, dtype=torch.int64, device="cuda"), 256
    elif case == "one_expert":
        x, e = torch.zeros((4001, 1), dtype=torch.int64, device="cuda"), 1
    else:
        x, e = torch.empty((0, 8), dtype=torch.int64, device="cuda"), 256
    for a in (1, 128):
        ours = tkjit.compat.tile_kernels.moe.get_fused_mapping(x, e, 0, a)
        theirs = tk.moe.get_fused_mapping(x, e, 0, a)
        _same_mapping(ours, theirs, x.shape[1])
