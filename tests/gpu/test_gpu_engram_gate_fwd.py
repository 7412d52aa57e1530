"""engram_gate_fwd on the GPU: every config of the space against the float64 reference (odd seeds: rows
of many magnitudes, zero rows), the default config at every shape, strided k and v read in place, the
TileKernels package as oracle (its own float32 sums: close, not bit for bit), the op under
torch.compile (fullgraph) and opcheck on CUDA."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME = "engram_gate_fwd"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# (num_tokens, hc_mult, hidden_size): TileKernels' tuned sizes (4096, 7168), then others it takes, then
# sizes only tkjit takes (not multiples of 256, odd token counts).
SHAPES = [(4096, 4, 7168), (4096, 4, 4096), (1, 4, 7168), (1000, 4, 2560), (333, 4, 512), (64, 8, 1024)]
ODD_SHAPES = [(7, 3, 300), (5, 1, 6), (129, 2, 1000)]


def _shape(t, m, h, **kw):
    return {"num_tokens": t, "hc_mult": m, "hidden_size": h, **kw}


def _inputs(t, m, h, seed):
    spec = tkjit.get_spec(NAME)
    return spec.make_inputs(spec.canonical_shape(_shape(t, m, h)), device="cuda", seed=seed)


def test_every_config_in_the_space():
    shapes = [_shape(1, 4, 7168), _shape(1, 3, 300)]
    failures = check_configs(NAME, shapes, [{"num_tokens": 1}, {"num_tokens": 517}], seeds=(0, 1))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("t, m, h", SHAPES + ODD_SHAPES)
def test_default_config(t, m, h):
    kern = tkjit.get(NAME, _shape(t, m, h))
    for seed in range(4):
        assert check(kern, _shape(t, m, h), seed=seed) is None, seed


def test_other_eps_and_clamp():
    shape = _shape(300, 4, 7168, eps=1e-5, clamp_value=0.5)  # a clamp many scores fall under
    kern = tkjit.get(NAME, shape)
    for seed in range(2):
        assert check(kern, shape, seed=seed) is None


def test_strided_k_and_v_are_read_in_place():
    x, k, v, w = _inputs(300, 4, 7168, 1)
    want = tkjit.ops.engram_gate_fwd(x, k, v, w, 1e-6, 1e-6)
    kbuf = torch.zeros(300, 4, 2 * 7168, dtype=torch.bfloat16, device="cuda")
    kbuf[:, :, 7168:] = k
    vbuf = torch.zeros(300, 3 * 7168, dtype=torch.bfloat16, device="cuda")
    vbuf[:, 8:7176] = v
    got = tkjit.ops.engram_gate_fwd(x, kbuf[:, :, 7168:], vbuf[:, 8:7176], w, 1e-6, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got = compat.engram.engram_gate_fwd(x, kbuf[:, :, 7168:], vbuf[:, 8:7176], w, 1e-6, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _close_to(ours, want, x, v):
    out, *saved = ours
    w_out, *w_saved = want
    diff = (out.float() - w_out.float()).abs()
    # gate agrees to float32 rounding, so out = bf16(x + gate * v) differs by at most one bf16 ulp of out
    # (<= 2^-7 |out| <= 2^-7 (|x| + |v|)), or, where x and gate * v cancel, by far less than that.
    scale = x.float().abs() + v.float().abs().unsqueeze(1)
    assert float((diff > 0).float().mean()) < 1e-3
    assert bool((diff <= scale * 2**-7).all()), float((diff / scale).max())
    for a, b in zip(saved, w_saved):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("t, m, h", [(4096, 4, 7168), (4096, 4, 4096), (1, 4, 7168), (333, 4, 512), (64, 8, 1024)])
def test_tile_kernels_is_the_oracle(t, m, h):
    tk = pytest.importorskip("tile_kernels")
    for seed in range(4):
        x, k, v, w = _inputs(t, m, h, seed)
        want = tk.engram.engram_gate_fwd(x, k, v, w, 1e-6, 1e-6)
        _close_to(compat.engram.engram_gate_fwd(x, k, v, w, 1e-6, 1e-6), want, x, v)
        out, *rest = compat.engram.engram_gate_fwd(x, k, v, w, 1e-6, 1e-6, save_for_backward=False)
        assert rest == [None] * 4
    # strided k and v, as TileKernels' callers slice them
    x, k, v, w = _inputs(t, m, h, 0)
    kbuf = torch.randn(t, m, 2 * h, device="cuda").bfloat16()
    kbuf[:, :, :h] = k
    vbuf = torch.randn(t, 2 * h, device="cuda").bfloat16()
    vbuf[:, h:] = v
    want = tk.engram.engram_gate_fwd(x, kbuf[:, :, :h], vbuf[:, h:], w, 1e-6, 1e-6)
    _close_to(compat.engram.engram_gate_fwd(x, kbuf[:, :, :h], vbuf[:, h:], w, 1e-6, 1e-6), want, x, v)


def test_bad_tensors_raise():
    kern = tkjit.get(NAME, _shape(16, 4, 7168))
    x, k, v, w = _inputs(16, 4, 7168, 0)
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x, k, v, w.bfloat16())
    with pytest.raises(tkjit.TensorError, match="needs cuda"):
        kern(x, k, v, w.cpu())
    with pytest.raises(tkjit.ShapeError, match="multiple of 256"):
        compat.engram.engram_gate_fwd(x[..., :300], k[..., :300], v[..., :300], w[:, :300], 1e-6, 1e-6)


def test_op_opcheck_and_compile():
    op = torch.ops.tkjit.engram_gate_fwd.default
    x, k, v, w = _inputs(64, 4, 7168, 1)
    args = (x, k, v, w, 1e-6, 1e-6)
    assert torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    eager = tkjit.ops.engram_gate_fwd(*args)
    f = torch.compile(lambda a, b, c, d: tkjit.ops.engram_gate_fwd(a, b, c, d, 1e-6, 1e-6), fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(f(x, k, v, w), eager))
