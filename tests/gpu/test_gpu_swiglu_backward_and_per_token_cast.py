"""swiglu_backward_and_per_token_cast on the GPU: the default config at every shape and every config of the space at a
few, bit-exact against the spec reference run on the GPU (out, the FP8 gradient and its scales, x_grad; weight_grad to
1e-5) and within the spec tolerance through tkjit.testing (CPU reference); TileKernels' test parametrisation (its MoE
maps from get_fused_mapping, per_token_cast'ed x) against its torch reference and its kernel; the op under
torch.compile(fullgraph=True) and opcheck."""

import pytest
import torch

import tkjit
import tkjit.compat.tile_kernels
import tkjit.ops
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME = "swiglu_backward_and_per_token_cast"
TK_HIDDEN = (2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' generate_hidden_sizes(256)


def _static(hidden, npc=128, k=6, round_scale=False, use_clamp=False):
    return {"hidden": hidden, "num_per_channels": npc, "num_topk": k, "round_scale": round_scale,
            "use_clamp": use_clamp}


STATIC = [_static(h, npc, k, r, c) for h, k in ((7168, 6), (4096, 8), (2560, 9), (2048, 2)) for npc in (32, 128)
          for r, c in ((False, False), (True, True))] + [_static(256, 32, 1), _static(576, 32, 7, True, True)]
SIZES = [(100, 20), (4001, 700), (24576, 4001), (7, 1)]  # (num_expand_tokens, num_tokens)


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _exact_on_gpu(kern, shape, seed=0):
    """The kernel against the spec reference computed on the GPU (CUDA's expf on both sides): bit for bit."""
    spec = tkjit.get_spec(NAME)
    full = spec.canonical_shape(shape)
    *tensors, cv = spec.make_inputs(full, device="cuda", seed=seed)
    got = kern(*tensors, cv)
    ref = spec.reference(full, *tensors, cv)
    names = ("out", "x_grad_fp8", "x_grad_sf", "x_grad")
    for name, a, b in zip(names, got[:4], ref[:4]):
        assert _same(a, b), (name, shape, kern.config, int((a.view(torch.uint8) != b.view(torch.uint8)).sum()))
    torch.testing.assert_close(got[4], ref[4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", STATIC, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_default_config_every_size(static):
    for e, n in SIZES:
        shape = {**static, "num_expand_tokens": e, "num_tokens": n}
        kern = tkjit.get(NAME, shape)
        for seed in (0, 1):  # clamp 0.5, then 10
            assert check(kern, shape, seed=seed) is None
            _exact_on_gpu(kern, shape, seed)


@pytest.mark.parametrize("static", [_static(7168, 128, 6, True, True), _static(2560, 32, 8)],
                         ids=lambda s: "-".join(str(v) for v in s.values()))
def test_every_config_in_the_space(static):
    sizes = [{"num_expand_tokens": e, "num_tokens": n} for e, n in SIZES[:2]]
    failures = check_configs(NAME, [{**static, **sizes[0]}], sizes)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
    spec = tkjit.get_spec(NAME)
    full = spec.canonical_shape({**static, **sizes[1]})
    for cfg in spec.configs(full, "sm_90a"):
        _exact_on_gpu(tkjit.get(NAME, {**static, **sizes[1]}, config=cfg), {**static, **sizes[1]})


# -- TileKernels' test parametrisation (tests/quant/test_swiglu_backward_and_per_token_cast.py) ---------------

def _tk_params():
    from tile_kernels.testing.generator import generate_moe_params

    return [{**moe, "hidden": h, "num_per_channels": npc, "round_sf": r, "swiglu_clamp_value": c}
            for moe in generate_moe_params() for h in TK_HIDDEN for npc in (32, 128) for r in (False, True)
            for c in (None, 10.0, 0.5)]


def _tk_data(params):
    """TileKernels' own test data: its MoE maps, x expanded and per_token_cast'ed, random bf16 grad_out. The maps,
    the expansion and the cast come from tkjit's compat ops (bit-exact with TileKernels'): TileKernels'
    get_fused_mapping hit an illegal address on the H200 at 4 experts x 64 ranks (2026-12-04)."""
    from tile_kernels.testing.generator import generate_topk_idx

    tile_kernels = tkjit.compat.tile_kernels

    torch.manual_seed(params["hidden"] + params["num_topk"])
    npc, k, h = params["num_per_channels"], params["num_topk"], params["hidden"]
    topk_idx = generate_topk_idx(params)
    n = topk_idx.shape[0]
    weight = torch.rand((n, k), dtype=torch.float32, device="cuda")
    x = torch.randn((n, h * 2), dtype=torch.bfloat16, device="cuda")
    _, pos_to_token, pos_to_token_topk, token_topk_to_pos, _, _, _, _ = tile_kernels.moe.get_fused_mapping(
        topk_idx, params["num_experts"], 0, npc)
    x_expand = tile_kernels.moe.expand_to_fused(x, token_topk_to_pos, pos_to_token)
    x = tile_kernels.quant.per_token_cast(x_expand, "e4m3", num_per_channels=npc)
    grad_out = torch.randn((x_expand.size(0), h), dtype=torch.bfloat16, device="cuda")
    return x, grad_out, weight, pos_to_token_topk, token_topk_to_pos


def _ids(p):
    return "-".join(f"{k}={v}" for k, v in p.items())


try:
    TK_PARAMS = _tk_params()
except Exception:  # no tile_kernels (or no GPU to import it on): the tests below skip
    TK_PARAMS = [{"num_send_tokens": 4001, "num_topk": 6, "num_experts": 32, "num_ep_ranks": 8, "hidden": 7168,
                  "num_per_channels": 128, "round_sf": False, "swiglu_clamp_value": None}]


def _call(fn, params, data):
    x, grad_out, weight, pos, t2p = data
    return fn(x, grad_out, weight, pos, t2p, num_per_channels=params["num_per_channels"], round_sf=params["round_sf"],
              swiglu_clamp_value=params["swiglu_clamp_value"])


@pytest.mark.parametrize("params", TK_PARAMS, ids=_ids)
def test_matches_tile_kernels_reference(params):
    """Against TileKernels' torch reference as its test composes it, bit for bit (weight_grad to 1e-4)."""
    tk = pytest.importorskip("tile_kernels")
    data = _tk_data(params)
    x, grad_out, weight, pos, t2p = data
    out, (q, sf), xg, wg = _call(tkjit.compat.tile_kernels.quant.swiglu_backward_and_per_token_cast, params, data)
    npc = params["num_per_channels"]
    out_ref, xg_ref, wg_ref = tk.torch.swiglu_backward(x, grad_out, weight, pos, t2p, num_per_channels=npc,
                                                       swiglu_clamp_value=params["swiglu_clamp_value"])
    q_ref, sf_ref = tk.torch.cast(xg_ref, "e4m3", block_size=(1, npc), round_sf=params["round_sf"])
    assert _same(out, out_ref.to(torch.bfloat16)) and _same(xg, xg_ref.to(torch.bfloat16))
    assert _same(q, q_ref) and _same(sf, sf_ref) and sf.stride() == sf_ref.stride()
    torch.testing.assert_close(wg, wg_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("params", TK_PARAMS, ids=_ids)
def test_matches_tile_kernels_kernel(params):
    """Against TileKernels' own kernel on its test data: the same shapes, strides, dtypes and bits."""
    tk = pytest.importorskip("tile_kernels")
    data = _tk_data(params)
    got = _call(tkjit.compat.tile_kernels.quant.swiglu_backward_and_per_token_cast, params, data)
    want = _call(tk.quant.swiglu_backward_and_per_token_cast, params, data)
    flat = lambda r: (r[0], r[1][0], r[1][1], r[2])  # noqa: E731
    for a, b in zip(flat(got), flat(want)):
        assert _same(a, b) and a.stride() == b.stride()
    # weight_grad: TileKernels leaves a (token, k) that no row maps to and token_topk_to_pos does not mark -1
    # unwritten; its maps have none. Sums in another order.
    torch.testing.assert_close(got[3], want[3], atol=1e-4, rtol=1e-4)


# -- the op ---------------------------------------------------------------------------------------------------

def _inputs(e, n, k=6, hidden=1024, npc=128, seed=0):
    spec = tkjit.get_spec(NAME)
    full = spec.canonical_shape({"num_expand_tokens": max(e, 1), "num_tokens": max(n, 1), "num_topk": k,
                                 "hidden": hidden, "num_per_channels": npc})
    *tensors, _ = spec.make_inputs(full, device="cuda", seed=seed)
    return tensors


def test_edge_sizes():
    for e, n in ((0, 16), (64, 0)):
        x, x_sf, g, w, pos, t2p = _inputs(max(e, 1), max(n, 1))
        x, x_sf, g, pos, w, t2p = x[:e], x_sf[:e], g[:e], pos[:e], w[:n], t2p[:n]
        if n == 0:
            pos.fill_(-1)
        out, q, sf, xg, wg = tkjit.ops.swiglu_backward_and_per_token_cast(x, x_sf, g, w, pos, t2p)
        assert out.shape == (e, 1024) and q.shape == (e, 2048) and sf.shape == (e, 16) and wg.shape == (n, 6)
        assert (wg == 0).all()
        if e:
            assert (out.float() == 0).all() and (xg.float() == 0).all()


OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("npc, clamp", [(128, None), (32, 0.5)])
def test_opcheck(npc, clamp):
    tensors = _inputs(512, 100, npc=npc)
    result = torch.library.opcheck(torch.ops.tkjit.swiglu_backward_and_per_token_cast.default,
                                   (*tensors, npc, True, clamp), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


def test_compile_fullgraph_bit_exact():
    """Inductor, zero graph breaks; 4096 rows, then 24576 (a dynamic-size recompile)."""
    def model(*tensors):
        out, q, sf, xg, wg = tkjit.ops.swiglu_backward_and_per_token_cast(*tensors, 128, round_scale=True,
                                                                         swiglu_clamp_value=0.5)
        return out, q, sf + 1, xg, wg * 2

    tensors = _inputs(4096, 1000)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*tensors)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for e, n in ((4096, 1000), (24576, 4001)):
        tensors = _inputs(e, n, seed=e)
        got, want = compiled(*tensors), model(*tensors)
        assert all(_same(a, b) for a, b in zip(got, want)), e
