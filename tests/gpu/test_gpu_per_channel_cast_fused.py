"""per_channel_cast_fused on the GPU: the default config at every shape and every config of the space at a few,
bit-exact against the spec reference (poisoned outputs); TileKernels' test parametrisation (its MoE maps from
get_fused_mapping, bf16 or per_token_cast'ed FP8 input, alignments 16 and 128) against its torch reference and its
kernel; the op under torch.compile(fullgraph=True) and opcheck."""

import itertools

import pytest
import torch

import tkjit
import tkjit.compat.tile_kernels
import tkjit.ops
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME = "per_channel_cast_fused"
FP8 = "float8_e4m3fn"
TK_HIDDEN = (2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' generate_hidden_sizes(128)
MOST = 32  # configs checked per shape: an even spread of the space (both stages), the default among them


def _static(hidden, npt=128, in_dtype="bfloat16", round_scale=False, has_pos=True):
    return {"hidden": hidden, "num_per_tokens": npt, "in_dtype": in_dtype, "round_scale": round_scale,
            "has_x_sf": in_dtype == FP8, "has_pos": has_pos}


STATIC = [
    _static(7168),
    _static(7168, in_dtype=FP8),
    _static(7168, in_dtype=FP8, round_scale=True, has_pos=False),
    _static(7168, round_scale=True, has_pos=False),
    _static(4096, 32, FP8, True),
    _static(2048, 32, "float32"),
    _static(576),  # a partial channel tile
    _static(208, 32, has_pos=False),  # hidden a multiple of 16 only
    _static(128, 128, FP8),
    _static(16, 32),
]


def _sizes(static):
    """(num_tokens, num_tokens_out): without a map equal, whole blocks and a partial last one; with a map 16-row
    multiples (TileKernels' alignment) and odd lengths, fewer and more rows than x."""
    if not static["has_pos"]:
        return [(n, n) for n in (128, 384, 100, 8064)]
    return [(4001, 4096), (100, 16), (333, 1040), (8001, 24576), (50, 7)]


@pytest.mark.parametrize("static", STATIC, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_default_config_every_size(static):
    for n, m in _sizes(static):
        shape = {**static, "num_tokens": n, "num_tokens_out": m}
        kern = tkjit.get(NAME, shape)
        for seed in (0, 1):  # odd seeds: out-of-range map entries
            assert check(kern, shape, seed=seed) is None


@pytest.mark.parametrize("static", [_static(576, 32), _static(7168, 128, FP8, True), _static(2048, 128, "float32"),
                                    _static(4096, 128, has_pos=False)],
                         ids=lambda s: "-".join(str(v) for v in s.values()))
def test_every_config_in_the_space(static):
    sizes = [{"num_tokens": n, "num_tokens_out": m} for n, m in _sizes(static)[:3]]
    failures = check_configs(NAME, [{**static, **sizes[0]}], sizes, most=MOST)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def _same(a, b):
    """Same shape, strides (of a non-empty tensor) and bits."""
    return (a.shape == b.shape and (a.numel() == 0 or a.stride() == b.stride())
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


# -- TileKernels' test parametrisation (tests/quant/test_per_channel_cast_fused.py) ---------------------------

def _tk_params():
    from tile_kernels.testing.generator import generate_moe_params

    moes = itertools.chain([{"num_send_tokens": 4096, "num_topk": 0, "num_experts": 0, "num_ep_ranks": 0}],
                           generate_moe_params())
    return [{**moe, "hidden": h, "fused_cast_back": cb, "round_sf": r}
            for moe in moes for h in TK_HIDDEN for cb in (False, True) for r in (False, True)]


def _tk_data(params, alignment):
    """TileKernels' own test data: x (expanded through its get_fused_mapping / expand_to_fused when num_topk > 0,
    as its test does), optionally its per_token_cast'ed (values, scales), and pos_to_token."""
    import tile_kernels
    from tile_kernels.testing.generator import generate_topk_idx

    torch.manual_seed(params["hidden"] + params["num_topk"])
    pos_to_token = None
    if params["num_topk"] > 0:
        topk_idx = generate_topk_idx(params)
        _, pos_to_token, _, token_topk_to_pos, _, _, _, _ = tile_kernels.moe.get_fused_mapping(
            topk_idx, params["num_experts"], 0, alignment)
        x = torch.randn((topk_idx.shape[0], params["hidden"]), dtype=torch.bfloat16, device="cuda")
        x = tile_kernels.moe.expand_to_fused(x, token_topk_to_pos, pos_to_token)
    else:
        x = torch.randn((params["num_send_tokens"], params["hidden"]), dtype=torch.bfloat16, device="cuda")
    if params["fused_cast_back"]:
        x = tile_kernels.quant.per_token_cast(x, "e4m3", 128)
    return x, pos_to_token


def _ids(p):
    return "-".join(f"{k}={v}" for k, v in p.items())


try:
    TK_PARAMS = _tk_params()
except Exception:  # no tile_kernels (or no GPU to import it on): the tests below skip
    TK_PARAMS = [{"num_send_tokens": 4096, "num_topk": 0, "num_experts": 0, "num_ep_ranks": 0, "hidden": 7168,
                  "fused_cast_back": False, "round_sf": False}]


@pytest.mark.parametrize("alignment", [16, 128])
@pytest.mark.parametrize("params", TK_PARAMS, ids=_ids)
def test_matches_tile_kernels_reference(params, alignment):
    """Against TileKernels' torch reference, bit for bit, through the compat entry point."""
    pytest.importorskip("tile_kernels")
    from tile_kernels.torch.per_channel_cast_fused import per_channel_cast_fused as tk_ref

    x, pos = _tk_data(params, alignment)
    npc = 128 if params["fused_cast_back"] else None
    q, sf = tkjit.compat.tile_kernels.quant.per_channel_cast_fused(x, "e4m3", 128, params["round_sf"], npc, pos)
    q_ref, sf_ref = tk_ref(x, 128, 128, params["round_sf"], pos)
    assert sf.shape == sf_ref.shape and sf.stride() == sf_ref.stride()
    assert torch.equal(sf.view(torch.int32), sf_ref.view(torch.int32))
    assert _same(q, q_ref)


@pytest.mark.parametrize("alignment", [16, 128])
@pytest.mark.parametrize("params", TK_PARAMS, ids=_ids)
def test_matches_tile_kernels_kernel(params, alignment):
    """Against TileKernels' own kernel on its test data: the same shapes, strides, dtypes and bits."""
    tk = pytest.importorskip("tile_kernels")
    x, pos = _tk_data(params, alignment)
    npc = 128 if params["fused_cast_back"] else None
    q_tk, sf_tk = tk.quant.per_channel_cast_fused(x, "e4m3", 128, params["round_sf"], npc, pos)
    q, sf = tkjit.compat.tile_kernels.quant.per_channel_cast_fused(x, "e4m3", 128, params["round_sf"], npc, pos)
    assert sf.shape == sf_tk.shape and sf.stride() == sf_tk.stride() and sf.dtype == sf_tk.dtype
    assert torch.equal(sf.view(torch.int32), sf_tk.view(torch.int32))
    assert _same(q, q_tk)


# -- the op ---------------------------------------------------------------------------------------------------

def _inputs(n, m, hidden, fp8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g) * torch.exp(2 * torch.randn(1, hidden, generator=g))
    x_sf = None
    if fp8:
        x, x_sf = (x * 4).to(torch.float8_e4m3fn), torch.rand(n, hidden // 128, generator=g) + 0.01
    else:
        x = x.bfloat16()
    pos = None if m is None else torch.randint(-1, max(n, 1), (m,), generator=g, dtype=torch.int32)
    return tuple(t.cuda() if t is not None else None for t in (x, x_sf, pos))


@pytest.mark.parametrize("fp8", [False, True])
def test_edge_sizes(fp8):
    """Empty maps, empty x under a map (every row zero), no rows at all."""
    spec = tkjit.get_spec(NAME)
    for n, m in ((0, 32), (64, 0), (0, None), (0, 0)):
        x, x_sf, pos = _inputs(n, m, 256, fp8)
        if pos is not None and n == 0:
            pos.fill_(-1)
        q, sf = tkjit.ops.per_channel_cast_fused(x, 32, x_sf=x_sf, pos_to_token=pos)
        rows = n if m is None else m
        assert q.shape == (rows, 256) and sf.shape == (-(-rows // 32), 256)
        full = spec.canonical_shape({**_static(256, 32, FP8 if fp8 else "bfloat16", has_pos=m is not None),
                                     "num_tokens": max(n, 1), "num_tokens_out": max(rows, 1)})
        q_ref, sf_ref = spec.reference(full, *[t.cpu() for t in (x, x_sf, pos) if t is not None])
        assert torch.equal(sf.cpu(), sf_ref) and _same(q.cpu(), q_ref)


def test_bad_input_raises():
    x, _, pos = _inputs(256, 64, 576, False)
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        tkjit.ops.per_channel_cast_fused(x.T.contiguous().T, 32, pos_to_token=pos)
    with pytest.raises(tkjit.ShapeError, match="fmt must be 'e4m3'"):
        tkjit.compat.tile_kernels.quant.per_channel_cast_fused(x, "e2m1", 128, pos_to_token=pos)
    with pytest.raises(tkjit.ShapeError, match="come together"):
        tkjit.ops.per_channel_cast_fused(x.to(torch.float8_e4m3fn), 32, pos_to_token=pos)


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("fp8, m, npt", [(False, 96, 32), (True, 160, 128), (False, None, 128), (True, None, 32)])
def test_opcheck(fp8, m, npt):
    x, x_sf, pos = _inputs(512, m, 1024, fp8)
    tests = OPCHECK_TESTS[1:] if fp8 else OPCHECK_TESTS  # (no float8 arithmetic for test_schema's mutation check)
    result = torch.library.opcheck(torch.ops.tkjit.per_channel_cast_fused.default, (x, x_sf, pos, npt, npt == 32),
                                   test_utils=tests)
    assert result == dict.fromkeys(tests, "SUCCESS"), result


@pytest.mark.parametrize("fp8", [False, True])
def test_compile_fullgraph_bit_exact(fp8):
    """Inductor, zero graph breaks; maps of 4096, then 24576 rows (a dynamic-size recompile), then 0."""
    def model(x, x_sf, pos):
        q, sf = tkjit.ops.per_channel_cast_fused(x, 128, x_sf=x_sf, pos_to_token=pos, round_scale=True)
        return q, sf + 1

    x, x_sf, pos = _inputs(8192, 4096, 2048, fp8)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x, x_sf, pos)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for m in (4096, 24576, 0):
        x, x_sf, pos = _inputs(8192, m, 2048, fp8, seed=m)
        (q, sf), (q_e, sf_e) = compiled(x, x_sf, pos), model(x, x_sf, pos)
        assert _same(q, q_e) and torch.equal(sf, sf_e), (fp8, m)
