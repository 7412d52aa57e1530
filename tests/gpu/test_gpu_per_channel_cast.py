"""per_channel_cast / per_channel_cast_and_transpose on the GPU: the default config at every shape and every
config of the space at a few, bit-exact against the spec reference (poisoned outputs); TileKernels' test
shapes against its torch reference and its kernels; the ops under torch.compile(fullgraph=True) and opcheck."""

import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.compat.tile_kernels
import tkjit.ops
from tkjit.testing import check, check_configs
from tkjit.timing import median, time_cuda

sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from quant_checks import strided_byte_same as _same  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
CAST, TRANSPOSE = "per_channel_cast", "per_channel_cast_and_transpose"
NAMES = (CAST, TRANSPOSE)
TK_HIDDEN = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' generate_hidden_sizes()
TK_TOKENS = (4096, 8064)  # TileKernels' generate_num_tokens(128): 4001 and 8001 aligned to 128
MOST = 48  # configs checked per shape: an even spread of the space, the default among them


def _static(hidden, npt=128, in_dtype="bfloat16", round_scale=False):
    return {"hidden": hidden, "num_per_tokens": npt, "in_dtype": in_dtype, "round_scale": round_scale}


STATIC = [
    _static(7168),
    _static(7168, round_scale=True),
    _static(7168, 32),
    _static(4096, 32, round_scale=True),
    _static(2048, in_dtype="float32"),
    _static(576, 32, "float32", True),
    _static(576),  # a partial channel tile (576 % 128, % 256)
    _static(208, 32),  # hidden a multiple of 16 only
    _static(16, 32),
    _static(2560, 128, "float32"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("static", STATIC, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_default_config_every_size(name, static):
    # 1, 3 and 63 token blocks: tiles of several blocks are partial; 257 at 128 tokens per scale: 32896 tokens.
    for blocks in (1, 3, 63, 257 if static["hidden"] <= 7168 else 33):
        shape = {**static, "token_blocks": blocks}
        kern = tkjit.get(name, shape)
        for seed in (0, 1):
            assert check(kern, shape, seed=seed) is None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("static", [_static(576, 32), _static(7168, 128, "float32", True), _static(208, 128)],
                         ids=lambda s: "-".join(str(v) for v in s.values()))
def test_every_config_in_the_space(name, static):
    sizes = [{"token_blocks": n} for n in (1, 5, 33)]
    failures = check_configs(name, [{**static, "token_blocks": 33}], sizes, most=MOST)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def _x(tokens, hidden, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * torch.exp(2 * torch.randn(1, hidden, generator=g))
    return x.to(dtype).cuda()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens", TK_TOKENS)
@pytest.mark.parametrize("hidden", TK_HIDDEN)
@pytest.mark.parametrize("npt", [32, 128])
@pytest.mark.parametrize("round_sf", [False, True])
def test_matches_tile_kernels_reference(name, tokens, hidden, npt, round_sf):
    """TileKernels' test parametrisation, against its torch reference `cast(x, 'e4m3', (num_per_tokens, 1))`
    (transposed for the transposing op), bit for bit; through the compat entry point."""
    pytest.importorskip("tile_kernels")
    from tile_kernels.torch import cast as tk_cast

    x = _x(tokens, hidden, seed=hidden + npt)
    q, sf = getattr(tkjit.compat.tile_kernels.quant, name)(x, "e4m3", npt, round_sf)
    q_ref, sf_ref = tk_cast(x, "e4m3", block_size=(npt, 1), round_sf=round_sf)
    if name == TRANSPOSE:
        q_ref = q_ref.T.contiguous()
    assert sf.shape == sf_ref.shape == (tokens // npt, hidden) and sf.stride() == sf_ref.stride()
    assert torch.equal(sf.view(torch.int32), sf_ref.view(torch.int32))
    assert _same(q, q_ref)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("hidden", TK_HIDDEN)
@pytest.mark.parametrize("npt", [32, 128])
@pytest.mark.parametrize("round_sf", [False, True])
def test_matches_tile_kernels_kernel(name, hidden, npt, round_sf):
    """TileKernels' own kernels, where they take the shape (per_channel_cast: 128 tokens per scale, hidden a
    multiple of 128): the same shapes, strides and bits."""
    tk = pytest.importorskip("tile_kernels")
    if name == CAST and (npt != 128 or hidden % 128):
        pytest.skip("TileKernels' per_channel_cast takes num_per_tokens 128 and hidden % 128 == 0 only")
    x = _x(4096, hidden, seed=hidden)
    q_tk, sf_tk = getattr(tk.quant, name)(x, "e4m3", npt, round_sf)
    q, sf = getattr(tkjit.compat.tile_kernels.quant, name)(x, "e4m3", npt, round_sf)
    assert sf.shape == sf_tk.shape and sf.stride() == sf_tk.stride() and sf.dtype == sf_tk.dtype
    assert torch.equal(sf.view(torch.int32), sf_tk.view(torch.int32))
    assert _same(q, q_tk)


@pytest.mark.parametrize("name", NAMES)
def test_float32_and_empty(name):
    op = getattr(tkjit.ops, name)
    x = _x(8064, 576, torch.float32, seed=3)
    q, sf = op(x, 32, round_scale=True)
    q_bf, _ = op(x.bfloat16(), 32)
    assert q.shape == q_bf.shape and sf.shape == (252, 576)
    scale = sf.repeat_interleave(32, 0)
    deq = (q.T if name == TRANSPOSE else q).float() * scale
    # e4m3: 3 mantissa bits (relative error <= 2^-4) down to its subnormals (steps of 2^-9 scales)
    assert ((deq - x).abs() <= x.abs() * (2**-4 + 1e-5) + scale * (2**-10 + 1e-6)).all()
    q0, sf0 = op(x[:0], 128)
    assert q0.shape == ((576, 0) if name == TRANSPOSE else (0, 576)) and sf0.shape == (0, 576)


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_raises(name):
    op = getattr(tkjit.ops, name)
    x = _x(256, 576)
    with pytest.raises(tkjit.ShapeError, match="multiple of num_per_tokens"):
        op(x[:200], 128)
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        op(_x(576, 256).T, 32)
    with pytest.raises(tkjit.ShapeError, match="fmt must be 'e4m3'"):
        getattr(tkjit.compat.tile_kernels.quant, name)(x, "e2m1", 128)


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("npt", [32, 128])
def test_opcheck(name, npt):
    result = torch.library.opcheck(getattr(torch.ops.tkjit, name).default, (_x(512, 576), npt, npt == 32),
                                   test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


@pytest.mark.parametrize("name", NAMES)
def test_compile_fullgraph_bit_exact(name):
    """Inductor, zero graph breaks; 4096 tokens, then 8064 (a dynamic-size recompile), then 0."""
    op = getattr(tkjit.ops, name)

    def model(x):
        q, sf = op(x * 2, 32, round_scale=True)
        return q, sf + 1

    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(_x(4096, 2048))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for t in (4096, 8064, 0):
        x = _x(t, 2048, seed=t)
        (q, sf), (q_e, sf_e) = compiled(x), model(x)
        assert _same(q, q_e) and torch.equal(sf, sf_e), (name, t)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("npt", [32, 128])
def test_report_time(name, npt):
    """Not a gate: the default config at 32768 x 7168 bf16 against the copy ceiling (printed)."""
    x = _x(32768, 7168)
    shape = {**_static(7168, npt), "token_blocks": 32768 // npt}
    kern = tkjit.get(name, shape)
    x3 = x.view(-1, npt, 7168)
    out = kern(x3)
    us = median(time_cuda(lambda: kern(x3, out=out)))
    gbs = kern.spec.bytes_moved(kern.shape | shape) / us / 1e3
    print(f"\n{name} 32768x7168 bf16 npt={npt} {kern.config}: {us:.1f} us/call, {gbs:.0f} GB/s")
