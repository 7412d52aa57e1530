"""expand_to_fused on the GPU: every config of the space, odd and large sizes, out-of-range positions,
0 tokens, bit-exact against the spec reference and against TileKernels (on get_fused_mapping's mappings);
the op under torch.compile and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.compat.tile_kernels
import tkjit.ops
from tkjit.testing import check, check_configs
from tkjit_kernels.moe.expand_to_fused import _bits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
MOST = 24  # configs checked per shape: an even spread of the space, the default among them
NAME = "expand_to_fused"


def _shape(n, p, h, k, dtype="bfloat16"):
    return {"num_tokens": n, "num_expanded_tokens": p, "hidden": h, "num_topk": k, "dtype": dtype}


@pytest.mark.parametrize("h,k,dtype", [(7168, 8, "bfloat16"), (4096, 8, "bfloat16"), (576, 6, "bfloat16"),
                                       (7168, 8, "float8_e4m3fn"), (2048, 9, "float32"), (100, 2, "float16"),
                                       (7, 20, "float8_e5m2")])
def test_default_config_every_size(h, k, dtype):
    for n, p in ((1, 1), (7, 50), (4001, 4001 * k + 640), (8192, 8192 * k + 16384)):
        kern = tkjit.get(NAME, _shape(n, p, h, k, dtype))
        for seed in (0, 1):
            assert check(kern, _shape(n, p, h, k, dtype), seed=seed) is None


@pytest.mark.parametrize("h,dtype", [(576, "bfloat16"), (1000, "float8_e4m3fn")])
def test_every_config_in_the_space(h, dtype):
    sizes = [{"num_tokens": n, "num_expanded_tokens": p} for n, p in ((1, 3), (7, 50), (4001, 30000))]
    failures = check_configs(NAME, [_shape(4001, 30000, h, 6, dtype)], sizes, most=MOST)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_zero_tokens_and_rows():
    x = torch.randn(0, 576, device="cuda").bfloat16()
    out = tkjit.ops.expand_to_fused(x, torch.empty(0, 6, dtype=torch.int32, device="cuda"),
                                    torch.full((64,), -1, dtype=torch.int32, device="cuda"))
    assert out.shape == (64, 576) and not out.any()
    x = torch.randn(5, 576, device="cuda").bfloat16()
    out = tkjit.ops.expand_to_fused(x, torch.full((5, 6), -1, dtype=torch.int32, device="cuda"),
                                    torch.empty(0, dtype=torch.int32, device="cuda"))
    assert out.shape == (0, 576)


def test_bad_tensors_raise():
    kern = tkjit.get(NAME, _shape(64, 600, 576, 6))
    x = torch.randn(64, 576, device="cuda").bfloat16()
    pos = torch.zeros(64, 6, dtype=torch.int32, device="cuda")
    pte = torch.zeros(600, dtype=torch.int32, device="cuda")
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.float(), pos, pte)
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 6"):
        kern(x, pos[:, :5].contiguous(), pte)
    with pytest.raises(tkjit.TensorError, match="num_tokens"):
        kern(x, pos[1:], pte)
    with pytest.raises(tkjit.TensorError, match="16-byte aligned"):
        kern(x.view(-1)[1: 1 + 63 * 576].view(63, 576), pos[1:], pte)


def _tk_mapping(tk, n, k, e, alignment=64, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).cuda()
    topk[torch.rand(n, k, generator=g).cuda() < 0.05] = -1  # some unused slots
    m = tk.moe.get_fused_mapping(topk.contiguous(), e, 0, alignment)
    return m[3], m[0]  # token_topk_to_pos, pos_to_expert


@pytest.mark.parametrize("k,e", [(2, 72), (6, 72), (8, 256), (9, 256)])
@pytest.mark.parametrize("h,dtype", [(576, torch.bfloat16), (2048, torch.float32), (7168, torch.bfloat16),
                                     (7168, torch.float8_e4m3fn)])
def test_against_tile_kernels(k, e, h, dtype):
    tk = pytest.importorskip("tile_kernels")
    pos, pte = _tk_mapping(tk, 4001, k, e)
    x = (torch.randn(4001, h, device="cuda") * 4).to(dtype)
    want = tk.moe.expand_to_fused(x, pos, pte)
    got = tkjit.compat.tile_kernels.moe.expand_to_fused(x, pos, pte)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(got), _bits(tkjit.get_spec(NAME).reference(None, x.cpu(), pos.cpu(), pte.cpu()).cuda()))
    # every slot unused: only padding rows, all zero
    none = torch.full_like(pos, -1)
    assert torch.equal(_bits(tkjit.ops.expand_to_fused(x, none, torch.full_like(pte, -1))),
                       _bits(tk.moe.expand_to_fused(x, none, torch.full_like(pte, -1))))


def test_op_compile_and_cuda_graph():
    spec = tkjit.get_spec(NAME)
    full = spec.canonical_shape(_shape(4001, 30000, 7168, 8))
    x, pos, pte = spec.make_inputs(full, "cuda", 0)
    f = torch.compile(lambda x, pos, pte: tkjit.ops.expand_to_fused(x * 2, pos, pte), fullgraph=True)
    eager = tkjit.ops.expand_to_fused(x * 2, pos, pte)
    assert torch.equal(f(x, pos, pte), eager)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tkjit.ops.expand_to_fused(x, pos, pte)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tkjit.ops.expand_to_fused(x, pos, pte))
