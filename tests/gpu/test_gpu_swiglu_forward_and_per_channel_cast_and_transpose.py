"""swiglu_forward_and_per_channel_cast(_and_transpose) on the GPU: the default config at every shape and every config
of the space at a few, against the spec reference (poisoned outputs; the CPU reference's exp may differ from CUDA's
expf in the last bit, hence the spec's rtol) and bit for bit against the same reference computed on the GPU;
TileKernels' test shapes against its torch reference and its kernel; the ops under torch.compile(fullgraph=True)
and opcheck."""

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
TRANSPOSE = "swiglu_forward_and_per_channel_cast_and_transpose"
CAST = "swiglu_forward_and_per_channel_cast"
NAMES = (TRANSPOSE, CAST)
TK_HIDDEN = (576, 2048, 2560, 3072, 4096, 6144, 7168)  # TileKernels' generate_hidden_sizes(): x is twice as wide
TK_TOKENS = (4096, 8064)  # TileKernels' generate_num_tokens(128): 4001 and 8001 aligned to 128
MOST = 48  # configs checked per shape: an even spread of the space, the default among them


def _static(hidden, npt=128, in_dtype="bfloat16", round_scale=False, clamp=None):
    return {"hidden": hidden, "num_per_tokens": npt, "in_dtype": in_dtype, "round_scale": round_scale,
            "use_clamp": clamp is not None, "clamp_value": 0.0 if clamp is None else float(clamp)}


STATIC = [
    _static(2048),
    _static(2048, round_scale=True, clamp=10.0),
    _static(7168, 32),
    _static(4096, 32, round_scale=True),
    _static(2048, in_dtype="float32", clamp=7.0),
    _static(576, 32, "float32", True),
    _static(576, clamp=6.9),  # a partial channel tile; a clamp not representable in bf16
    _static(208, 32),  # hidden a multiple of 16 only
    _static(16, 32),
]


def _id(s):
    return "-".join(str(v) for v in s.values())


def _exact_on_gpu(kern, shape, seed):
    """The kernel against the spec reference computed on the GPU (torch's CUDA exp is the kernel's expf)."""
    spec = kern.spec
    full = spec.canonical_shape(shape)
    (x,) = spec.make_inputs(full, "cuda", seed)
    q, sf = kern(x)
    q_ref, sf_ref = spec.reference(full, x)
    assert torch.equal(sf.view(torch.int32), sf_ref.view(torch.int32)), (shape, seed)
    assert _same(q, q_ref), (shape, seed, int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum()))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("static", STATIC, ids=_id)
def test_default_config_every_size(name, static):
    for blocks in (1, 3, 63, 257 if static["hidden"] <= 4096 else 33):
        shape = {**static, "token_blocks": blocks}
        kern = tkjit.get(name, shape)
        for seed in (0, 1):
            assert check(kern, shape, seed=seed) is None
            _exact_on_gpu(kern, shape, seed)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("static", [_static(576, 32, clamp=7.0), _static(2048, 128, "float32", True),
                                    _static(208, 128)], ids=_id)
def test_every_config_in_the_space(name, static):
    sizes = [{"token_blocks": n} for n in (1, 5, 33)]
    failures = check_configs(name, [{**static, "token_blocks": 33}], sizes, most=MOST)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def _x(tokens, hidden, dtype=torch.bfloat16, seed=0):
    """[gate | up] (tokens, 2 * hidden): gates around 0 and beyond typical clamps, ups of many magnitudes."""
    g = torch.Generator().manual_seed(seed)
    gate = 4 * torch.randn(tokens, hidden, generator=g)
    up = torch.randn(tokens, hidden, generator=g) * torch.exp(2 * torch.randn(1, hidden, generator=g))
    return torch.cat([gate, up], 1).to(dtype).cuda()


def _tk_expected(x, npt, round_sf, clamp, without_transpose):
    """TileKernels' torch references on the GPU: swiglu_forward (float32) staged in bf16 as its kernel stages
    it, then cast(..., 'e4m3', (num_per_tokens, 1))."""
    from tile_kernels.torch import cast as tk_cast
    from tile_kernels.torch.swiglu import swiglu_forward

    act = swiglu_forward(x, swiglu_clamp_value=clamp).to(x.dtype)
    q, sf = tk_cast(act, "e4m3", block_size=(npt, 1), round_sf=round_sf)
    return (q if without_transpose else q.T.contiguous()), sf


@pytest.mark.parametrize("without_transpose", [False, True])
@pytest.mark.parametrize("tokens", TK_TOKENS)
@pytest.mark.parametrize("hidden", TK_HIDDEN)
@pytest.mark.parametrize("npt", [32, 128])
@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("clamp", [None, 7.0])
def test_matches_tile_kernels_reference(without_transpose, tokens, hidden, npt, round_sf, clamp):
    """TileKernels' test parametrisation against its torch references, bit for bit, through the compat entry."""
    pytest.importorskip("tile_kernels")
    x = _x(tokens, hidden, seed=hidden + npt)
    q, sf = tkjit.compat.tile_kernels.quant.swiglu_forward_and_per_channel_cast_and_transpose(
        x, "e4m3", npt, round_sf, without_transpose, clamp)
    q_ref, sf_ref = _tk_expected(x, npt, round_sf, clamp, without_transpose)
    assert sf.shape == sf_ref.shape == (tokens // npt, hidden) and sf.stride() == sf_ref.stride()
    assert torch.equal(sf.view(torch.int32), sf_ref.view(torch.int32))
    assert _same(q, q_ref)


@pytest.mark.parametrize("without_transpose", [False, True])
@pytest.mark.parametrize("hidden", TK_HIDDEN)
@pytest.mark.parametrize("npt", [32, 128])
@pytest.mark.parametrize("round_sf, clamp", [(False, None), (True, 7.0), (False, 10.0)])
def test_matches_tile_kernels_kernel(without_transpose, hidden, npt, round_sf, clamp):
    """TileKernels' own kernel: the same shapes, strides and bits (clamps representable in bf16)."""
    tk = pytest.importorskip("tile_kernels")
    x = _x(4096, hidden, seed=hidden)
    args = (x, "e4m3", npt, round_sf, without_transpose, clamp)
    q_tk, sf_tk = tk.quant.swiglu_forward_and_per_channel_cast_and_transpose(*args)
    q, sf = tkjit.compat.tile_kernels.quant.swiglu_forward_and_per_channel_cast_and_transpose(*args)
    assert sf.shape == sf_tk.shape and sf.stride() == sf_tk.stride() and sf.dtype == sf_tk.dtype
    assert torch.equal(sf.view(torch.int32), sf_tk.view(torch.int32))
    assert _same(q, q_tk)


@pytest.mark.parametrize("name", NAMES)
def test_float32_and_empty(name):
    op = getattr(tkjit.ops, name)
    x = _x(8064, 576, torch.float32, seed=3)
    q, sf = op(x, 32, round_scale=True, swiglu_clamp_value=7.0)
    assert sf.shape == (252, 576)
    act = torch.nn.functional.silu(x[:, :576].clamp(max=7.0)) * x[:, 576:].clamp(-7.0, 7.0)
    scale = sf.repeat_interleave(32, 0)
    deq = (q.T if name == TRANSPOSE else q).float() * scale
    # e4m3: 3 mantissa bits (relative error <= 2^-4) down to its subnormals (steps of 2^-9 scales)
    assert ((deq - act).abs() <= act.abs() * (2**-4 + 1e-5) + scale * (2**-10 + 1e-6)).all()
    q0, sf0 = op(x[:0], 128)
    assert q0.shape == ((576, 0) if name == TRANSPOSE else (0, 576)) and sf0.shape == (0, 576)


def test_bad_input_raises():
    fn = tkjit.compat.tile_kernels.quant.swiglu_forward_and_per_channel_cast_and_transpose
    x = _x(256, 576)
    with pytest.raises(tkjit.ShapeError, match="multiple of num_per_tokens"):
        fn(x[:200], "e4m3", 128)
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        fn(_x(576, 128).T, "e4m3", 32)
    with pytest.raises(tkjit.ShapeError, match="fmt must be 'e4m3'"):
        fn(x, "e2m1", 128)
    with pytest.raises(tkjit.ShapeError, match="swiglu_clamp_value"):
        fn(x, "e4m3", 128, swiglu_clamp_value=-1.0)


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("npt, clamp", [(32, None), (128, 7.0)])
def test_opcheck(name, npt, clamp):
    result = torch.library.opcheck(getattr(torch.ops.tkjit, name).default, (_x(512, 576), npt, npt == 32, clamp),
                                   test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result


@pytest.mark.parametrize("name", NAMES)
def test_compile_fullgraph_bit_exact(name):
    """Inductor, zero graph breaks; 4096 tokens, then 8064 (a dynamic-size recompile), then 0."""
    op = getattr(tkjit.ops, name)

    def model(x):
        q, sf = op(x * 2, 32, round_scale=True, swiglu_clamp_value=10.0)
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
    """Not a gate: the default config at 32768 x (2 x 2048) bf16 against the copy ceiling (printed)."""
    shape = {**_static(2048, npt), "token_blocks": 32768 // npt}
    kern = tkjit.get(name, shape)
    x3 = _x(32768, 2048).view(-1, npt, 4096)
    out = kern(x3)
    us = median(time_cuda(lambda: kern(x3, out=out)))
    gbs = kern.spec.bytes_moved(kern.shape | shape) / us / 1e3
    print(f"\n{name} 32768x2x2048 bf16 npt={npt} {kern.config}: {us:.1f} us/call, {gbs:.0f} GB/s")
