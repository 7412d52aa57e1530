"""expand_to_fused_with_sf (row-major and TMA-aligned column-major scales) on the GPU: configs of the space,
odd and large sizes, out-of-range positions, 0 tokens, padding, bit-exact against the spec reference and
against TileKernels (on get_fused_mapping's mappings); the op under torch.compile and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.compat.tile_kernels
import tkjit.ops
from tkjit.testing import check, check_configs
from tkjit_kernels.moe.expand_to_fused import _bits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
MOST = 24  # configs checked per shape: an even spread of the space, the default among them
ROW, COL = "expand_to_fused_with_sf", "expand_to_fused_with_sf_colmajor"


def _shape(n, p, h, k, npc=128, dtype="float8_e4m3fn", sf_dtype="float32"):
    return {"num_tokens": n, "num_expanded_tokens": p, "hidden": h, "num_topk": k, "num_per_channels": npc,
            "dtype": dtype, "sf_dtype": sf_dtype}


@pytest.mark.parametrize("name", [ROW, COL])
@pytest.mark.parametrize("h,k,npc,dtype,sf_dtype", [(7168, 8, 128, "float8_e4m3fn", "float32"),
                                                    (7168, 8, 32, "float8_e4m3fn", "int32"),
                                                    (576, 6, 32, "bfloat16", "float32"),
                                                    (100, 9, 32, "int8", "int32")])
def test_default_config_every_size(name, h, k, npc, dtype, sf_dtype):
    # p odd: the column-major storage has padding columns the kernel must zero
    for n, p in ((1, 1), (7, 50), (4001, 4001 * k + 641), (8192, 8192 * k + 16383)):
        s = _shape(n, p, h, k, npc, dtype, sf_dtype)
        kern = tkjit.get(name, s)
        for seed in (0, 1):
            assert check(kern, s, seed=seed) is None


@pytest.mark.parametrize("name", [ROW, COL])
def test_every_config_in_the_space(name):
    sizes = [{"num_tokens": n, "num_expanded_tokens": p} for n, p in ((1, 3), (7, 50), (4001, 30001))]
    failures = check_configs(name, [_shape(4001, 30001, 1000, 6, 32, "float8_e4m3fn", "float32")], sizes, most=MOST)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("col_major", [False, True])
def test_zero_tokens_zero_rows_and_padding(col_major):
    dev = "cuda"
    x = torch.randn(0, 7168, device=dev).to(torch.float8_e4m3fn)
    out, sf = tkjit.ops.expand_to_fused_with_sf((x, torch.empty(0, 56, device=dev)), 128,
                                                torch.empty(0, 8, dtype=torch.int32, device=dev),
                                                torch.full((65,), -1, dtype=torch.int32, device=dev), col_major)
    assert out.shape == (65, 7168) and sf.shape == (65, 56) and not out.view(torch.uint8).any() and not sf.any()
    assert sf.stride() == ((1, 68) if col_major else (56, 1))
    x = torch.randn(5, 7168, device=dev).to(torch.float8_e4m3fn)
    out, sf = tkjit.ops.expand_to_fused_with_sf((x, torch.ones(5, 56, device=dev)), 128,
                                                torch.full((5, 8), -1, dtype=torch.int32, device=dev),
                                                torch.empty(0, dtype=torch.int32, device=dev), col_major)
    assert out.shape == (0, 7168) and sf.shape == (0, 56)
    # every slot unused, every row padding: all zero, the padding columns of the storage too
    out, sf = tkjit.ops.expand_to_fused_with_sf((x, torch.ones(5, 56, device=dev)), 128,
                                                torch.full((5, 8), -1, dtype=torch.int32, device=dev),
                                                torch.full((41,), -1, dtype=torch.int32, device=dev), col_major)
    assert not out.view(torch.uint8).any() and not sf.any()
    if col_major:
        assert not sf.T.as_strided((56, 44), (44, 1)).any()


def _tk_mapping(tk, n, k, e, alignment=64, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).cuda()
    topk[torch.rand(n, k, generator=g).cuda() < 0.05] = -1  # some unused slots
    m = tk.moe.get_fused_mapping(topk.contiguous(), e, 0, alignment)
    return m[3], m[0]  # token_topk_to_pos, pos_to_expert


@pytest.mark.parametrize("k,e", [(2, 72), (6, 72), (8, 256), (9, 256)])
@pytest.mark.parametrize("h,npc,sf_dtype,col_major", [(7168, 128, torch.float32, False),
                                                      (7168, 128, torch.float32, True),
                                                      (7168, 32, torch.int32, True),
                                                      (576, 32, torch.float32, True)])
def test_against_tile_kernels(k, e, h, npc, sf_dtype, col_major):
    tk = pytest.importorskip("tile_kernels")
    pos, pte = _tk_mapping(tk, 4001, k, e)
    x = (torch.randn(4001, h, device="cuda") * 4).to(torch.float8_e4m3fn)
    sw = -(-h // npc)
    if sf_dtype == torch.int32:
        sf = torch.randint(0, 2**31 - 1, (4001, -(-sw // 4)), dtype=torch.int32, device="cuda")
    else:
        sf = torch.rand(4001, sw, device="cuda") + 0.5
    want, want_sf = tk.moe.expand_to_fused_with_sf((x, sf), npc, pos, pte, col_major)
    got, got_sf = tkjit.compat.tile_kernels.moe.expand_to_fused_with_sf((x, sf), npc, pos, pte, col_major)
    assert torch.equal(_bits(got), _bits(want))
    assert got_sf.shape == want_sf.shape and got_sf.stride() == want_sf.stride() and torch.equal(got_sf, want_sf)
    ref, ref_sf = tkjit.get_spec(ROW).reference(None, x.cpu(), sf.cpu(), pos.cpu(), pte.cpu())
    assert torch.equal(_bits(got.cpu()), _bits(ref)) and torch.equal(got_sf.cpu(), ref_sf)


def test_op_compile_and_cuda_graph():
    spec = tkjit.get_spec(COL)
    full = spec.canonical_shape(_shape(4001, 30001, 7168, 8))
    x, x_sf, pos, pte = spec.make_inputs(full, "cuda", 0)

    def run(x, x_sf, pos, pte):
        return tkjit.ops.expand_to_fused_with_sf((x, x_sf * 2), 128, pos, pte, True)

    f = torch.compile(run, fullgraph=True)
    got, got_sf = f(x, x_sf, pos, pte)
    want, want_sf = run(x, x_sf, pos, pte)
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(got_sf, want_sf)
    assert got_sf.stride() == want_sf.stride() == (1, 30004)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, out_sf = tkjit.ops.expand_to_fused_with_sf((x, x_sf), 128, pos, pte, True)
    out.view(torch.uint8).fill_(0xFF)
    out_sf.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    want, want_sf = tkjit.ops.expand_to_fused_with_sf((x, x_sf), 128, pos, pte, True)
    assert torch.equal(_bits(out), _bits(want)) and torch.equal(out_sf, want_sf)
