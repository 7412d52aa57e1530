"""fused_weight on the GPU: every config of the space bit-exact against torch's float32 product (subnormal
and overflowing products on odd seeds: no flush to zero), the default config at every shape, the
TileKernels package as oracle, the op under torch.compile and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import bit_equal, check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME = "fused_weight"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# (hc_mult, hidden_size): DeepSeek-like mHC rates and hidden sizes; then rows no block size divides.
SHAPES = [(4, 7168), (4, 4096), (4, 2560), (4, 1024), (1, 256), (8, 7168), (16, 12288)]
ODD_SHAPES = [(3, 300), (4, 6), (2, 1), (5, 7176)]


def _shape(hc, h):
    return {"hc_mult": hc, "hidden_size": h}


def _normal_or_zero(x):
    return (x.abs() >= 2.0**-126) | (x == 0)  # (inf included)


def _inputs(hc, h, seed):
    spec = tkjit.get_spec(NAME)
    return spec.make_inputs(spec.canonical_shape(_shape(hc, h)), device="cuda", seed=seed)


def test_every_config_in_the_space():
    failures = check_configs(NAME, [_shape(4, 7168), _shape(3, 300)], [{}], seeds=(0, 1, 3))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("hc, h", SHAPES + ODD_SHAPES)
def test_default_config(hc, h):
    kern = tkjit.get(NAME, _shape(hc, h))
    for seed in range(4):
        assert check(kern, _shape(hc, h), seed=seed) is None


@pytest.mark.parametrize("hc, h", SHAPES)
def test_tile_kernels_is_the_oracle(hc, h):
    tk = pytest.importorskip("tile_kernels")
    for seed in (0, 2):  # weights around 1, as a model's RMSNorm weights
        wh, we = _inputs(hc, h, seed)
        want = tk.engram.fused_weight(wh, we)
        assert bit_equal(compat.engram.fused_weight(wh, we), want), seed
        assert bit_equal(tkjit.ops.fused_weight(wh, we), want), seed
    # Every finite bf16 (odd seeds): the same wherever the product is a normal float32, zero or inf (a
    # TileKernels built with fast math would flush subnormal products, which tkjit keeps, as torch does).
    wh, we = _inputs(hc, h, 1)
    ours, want = compat.engram.fused_weight(wh, we), tk.engram.fused_weight(wh, we)
    a, b = wh.float(), we.float()
    keep = _normal_or_zero(a) & _normal_or_zero(b) & _normal_or_zero(a * b)
    assert bool(keep.any()) and bit_equal(ours[keep], want[keep])
    g = torch.Generator(device="cpu").manual_seed(hc * h)
    wh, we = (torch.randn(hc, h, generator=g).bfloat16().cuda() for _ in range(2))
    assert bit_equal(compat.engram.fused_weight(wh, we), tk.engram.fused_weight(wh, we))


def test_bad_tensors_raise():
    kern = tkjit.get(NAME, _shape(4, 7168))
    wh, we = _inputs(4, 7168, 0)
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(wh.float(), we)
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 7168"):
        kern(wh[:, :4096].contiguous(), we)
    with pytest.raises(tkjit.TensorError, match="needs cuda"):
        kern(wh.cpu(), we)
    with pytest.raises(tkjit.ShapeError, match="multiple of 256"):
        compat.engram.fused_weight(wh[:, :300], we[:, :300])


def test_op_opcheck_compile_and_cuda_graph():
    op = torch.ops.tkjit.fused_weight.default
    wh, we = _inputs(4, 7168, 1)
    assert torch.library.opcheck(op, (wh, we), test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    eager = tkjit.ops.fused_weight(wh, we)
    f = torch.compile(lambda a, b: tkjit.ops.fused_weight(a, b), fullgraph=True)
    assert bit_equal(f(wh, we), eager)
    g = torch.cuda.CUDAGraph()
    tkjit.ops.fused_weight(wh, we)  # compiled and planned before capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        got = tkjit.ops.fused_weight(wh, we)
    wh.copy_(_inputs(4, 7168, 2)[0])
    g.replay()
    torch.cuda.synchronize()
    assert bit_equal(got.cpu(), wh.cpu().float() * we.cpu().float())
