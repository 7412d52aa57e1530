"""reduce_fused on the GPU: every config of the space, every variant (x's dtype, weights, x_sf, sf, e4m3 out), odd and
large sizes, out-of-range positions, 0 tokens, bit-exact against the spec reference (exact FMAs) and against
TileKernels on get_fused_mapping's mappings; out=; the op under torch.compile and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.compat.tile_kernels
import tkjit.ops
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
MOST = 24  # configs checked per shape: an even spread of the space, the default among them
NAME = "reduce_fused"
VARIANTS = [  # (in_dtype, e4m3_out, has_weights, has_x_sf, has_sf)
    ("bfloat16", False, True, False, False), ("bfloat16", False, False, False, False),
    ("float32", False, True, True, False), ("bfloat16", True, True, True, True),
    ("float32", True, False, False, True), ("bfloat16", True, True, False, False),
    ("float16", False, True, False, False), ("float8_e4m3fn", False, True, True, False),
    ("float8_e4m3fn", True, False, True, True),
]


def _shape(n, p, h, k, v=VARIANTS[0]):
    return {"num_tokens": n, "num_expanded_tokens": p, "hidden": h, "num_topk": k, "in_dtype": v[0],
            "e4m3_out": v[1], "has_weights": v[2], "has_x_sf": v[3], "has_sf": v[4]}


@pytest.mark.parametrize("v", VARIANTS, ids=str)
@pytest.mark.parametrize("h,k", [(7168, 8), (4096, 8), (2048, 9), (576, 6), (24, 2)])
def test_default_config_every_size(v, h, k):
    for n, p in ((1, 1), (7, 50), (4001, 4001 * k + 640)):
        kern = tkjit.get(NAME, _shape(n, p, h, k, v))
        for seed in (0, 1):
            assert check(kern, _shape(n, p, h, k, v), seed=seed) is None


@pytest.mark.parametrize("h,v", [(576, VARIANTS[3]), (520, VARIANTS[2])], ids=str)
def test_every_config_in_the_space(h, v):
    sizes = [{"num_tokens": n, "num_expanded_tokens": p} for n, p in ((1, 3), (7, 50), (4001, 30000))]
    failures = check_configs(NAME, [_shape(4001, 30000, h, 6, v)], sizes, most=MOST)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_zero_tokens_and_rows():
    x = torch.randn(50, 256, device="cuda").bfloat16()
    w = torch.rand(0, 6, device="cuda")
    assert tkjit.ops.reduce_fused(x, w, torch.empty(0, 6, dtype=torch.int32, device="cuda")).shape == (0, 256)
    got = tkjit.ops.reduce_fused(x[:0], torch.rand(5, 6, device="cuda"),
                                 torch.full((5, 6), -1, dtype=torch.int32, device="cuda"))
    assert got.shape == (5, 256) and not got.any()


def _tk_mapping(tk, n, k, e, alignment=64, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).cuda()
    topk[torch.rand(n, k, generator=g).cuda() < 0.05] = -1
    m = tk.moe.get_fused_mapping(topk.contiguous(), e, 0, alignment)
    return m[3], m[0]


@pytest.mark.parametrize("k,e", [(2, 72), (6, 72), (8, 256), (9, 256)])
@pytest.mark.parametrize("h", [2048, 7168])
@pytest.mark.parametrize("v", VARIANTS, ids=str)
def test_against_tile_kernels(k, e, h, v):
    tk = pytest.importorskip("tile_kernels")
    pos, _ = _tk_mapping(tk, 4001, k, e)
    p = int(pos.max()) + 1
    g = torch.Generator(device="cpu").manual_seed(k * e + h)
    x = (torch.randn(p, h, generator=g) * torch.exp(torch.randn(p, 1, generator=g))).clamp(-448, 448)
    x = x.to(getattr(torch, v[0])).cuda()
    w = torch.rand(4001, k, generator=g).cuda() if v[2] else None
    x_sf = (torch.rand(p, generator=g) * 2).cuda() if v[3] else None
    sf = (torch.rand(1, generator=g) + 0.5).cuda() if v[4] else None
    fmt = "e4m3" if v[1] else ""
    xq = (x, x_sf) if x_sf is not None else x
    want = tk.moe.reduce_fused(xq, w, pos, fmt, sf)
    got = tkjit.compat.tile_kernels.moe.reduce_fused(xq, w, pos, fmt, sf)
    assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    out = torch.empty_like(want)
    assert tkjit.compat.tile_kernels.moe.reduce_fused(xq, w, pos, fmt, sf, out=out) is out
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    none = torch.full_like(pos, -1)  # every slot unused: zeros
    assert torch.equal(tkjit.compat.tile_kernels.moe.reduce_fused(xq, w, none, fmt, sf).view(torch.uint8),
                       tk.moe.reduce_fused(xq, w, none, fmt, sf).view(torch.uint8))


def test_e4m3_saturation_matches_tile_kernels():
    """Sums past 448: TileKernels' kernel saturates (its torch reference gives NaN); so does tkjit."""
    tk = pytest.importorskip("tile_kernels")
    x = (torch.randn(64, 256, device="cuda") * 400).bfloat16()
    pos = torch.randint(0, 64, (32, 4), dtype=torch.int32, device="cuda")
    w = torch.rand(32, 4, device="cuda")
    want = tk.moe.reduce_fused(x, w, pos, "e4m3")
    got = tkjit.ops.reduce_fused(x, w, pos, "e4m3")
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_op_compile_and_cuda_graph():
    spec = tkjit.get_spec(NAME)
    full = spec.canonical_shape(_shape(4001, 30000, 7168, 8))
    x, w, pos = spec.make_inputs(full, "cuda", 0)
    f = torch.compile(lambda x, w, pos: tkjit.ops.reduce_fused(x * 2, w, pos), fullgraph=True)
    assert torch.equal(f(x, w, pos), tkjit.ops.reduce_fused(x * 2, w, pos))
    out = torch.empty(4001, 7168, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tkjit.ops.reduce_fused(x, w, pos, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tkjit.ops.reduce_fused(x, w, pos))
