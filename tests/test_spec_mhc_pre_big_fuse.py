"""mhc_pre_big_fuse on a CPU host: the spec (defaults, constraints, sm_90a cross-compiles), its reference against
the unfused specs' references (bit for bit) and against TileKernels' float32 torch references, the op served by
the references (fake, opcheck, torch.compile, no gradient), the TileKernels compat entry point (signature,
errors) and `mhc_pre`'s no-grad path through it."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ShapeError, TensorError
from tkjit.torch_ops import tf32_round

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from mhc_chain import tk_chain  # noqa: E402
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
NAME = "mhc_pre_big_fuse"
KERNELS = (NAME, "mhc_pre_norm_fn", "mhc_pre_norm_fn_bwd", "mhc_pre_split_mixes", "mhc_pre_split_mixes_bwd",
           "sinkhorn_fwd", "sinkhorn_bwd", "pre_apply_mix", "pre_apply_mix_bwd", "pre_apply_mix_bwd_acc")
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
EPS = dict(rms_eps=1e-6, mhc_pre_eps=1e-2, mhc_sinkhorn_eps=1e-6, mhc_post_mult_value=2.0, sinkhorn_repeat=10)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def full(num_tokens=6, m=4, hidden=64, **kw):
    return tkjit.get_spec(NAME).canonical_shape({"num_tokens": num_tokens, "mhc_mult": m, "hidden": hidden, **EPS,
                                                **kw})


def data(n0, n1, m, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, k = m * (m + 2), m * h
    residual = (torch.randn(n0, n1, m, h, generator=g) * torch.exp(torch.randn(n0, n1, m, 1, generator=g)))
    fn = torch.randn(w, k, generator=g) / k ** 0.5
    scale, base = torch.randn(3, generator=g), torch.randn(w, generator=g)
    return residual.bfloat16(), fn, scale, base


@pytest.fixture
def refs(monkeypatch):
    return serve_references(monkeypatch, KERNELS)


def test_registered_defaults_and_constraints():
    s = tkjit.get_spec(NAME)
    big = full(4096, 4, 7168)
    c = s.default_config(big, "sm_90a")
    assert c == {"threads": 128, "rows": 1, "vec_bytes": 16, "unroll": 7, "recip": True, "mix_warp": True}
    assert s.constraint(big, c) is None
    assert s.arch_constraint("cpu", c, big) is not None  # CUDA only
    assert "vec_bytes" in s.constraint(big, {**c, "vec_bytes": 4})  # a quarter of the widest vectors
    assert s.exact == {"recip": False}
    with pytest.raises(ShapeError):
        tkjit.get(NAME, {"num_tokens": 8, "mhc_mult": 4, "hidden": 64, **EPS, "sinkhorn_repeat": 0}, arch="sm_90a")


@pytest.mark.parametrize("shape, config", [
    ({"num_tokens": 4096, "mhc_mult": 4, "hidden": 7168}, None),
    ({"num_tokens": 64, "mhc_mult": 4, "hidden": 1000},  # a guarded last chunk, two tokens a block
     {"threads": 64, "rows": 2, "vec_bytes": 16, "unroll": 3, "recip": False, "mix_warp": False}),
    ({"num_tokens": 64, "mhc_mult": 4, "hidden": 1000},  # the same with a warp of its own for the mixes
     {"threads": 64, "rows": 2, "vec_bytes": 16, "unroll": 3, "recip": False, "mix_warp": True}),
    ({"num_tokens": 64, "mhc_mult": 2, "hidden": 1280}, None),
])
def test_compiles_for_sm90a(shape, config):
    k = tkjit.get(NAME, {**shape, **EPS}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert src.count("__global__") >= 1 and "__fmaf_rn" in src and "rsqrtf" in src
    threads = k.config["threads"] + 32 * k.config["mix_warp"]  # mix_warp: one more warp, the mixes'
    assert f"__launch_bounds__({threads}, 1)" in src


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_reference_is_the_unfused_references_composed(seed, m):
    """Bit for bit: pre_norm_fn's norm of the GEMM outputs, then pre_split_mixes', sinkhorn_fwd's and
    pre_apply_mix's spec references (what the kernel computes, one kernel for four)."""
    from tkjit_kernels.mhc.pre_big_fuse import normed_mixes

    s = full(9, m, 96)
    out_mul, sqrsum, scale, base, residual = tkjit.get_spec(NAME).make_inputs(s, seed=seed)
    post, comb, li = tkjit.get_spec(NAME).reference(s, out_mul, sqrsum, scale, base, residual)
    mixes = normed_mixes(out_mul, sqrsum, m * 96, EPS["rms_eps"])
    split = tkjit.get_spec("mhc_pre_split_mixes")
    pre, post2, comb2 = split.reference(split.canonical_shape({"num_tokens": 9, "mhc_mult": m,
                                                              "mhc_pre_eps": EPS["mhc_pre_eps"],
                                                              "mhc_post_mult_value": 2.0}), mixes, scale, base)
    sk = tkjit.get_spec("sinkhorn_fwd")
    comb2 = sk.reference(sk.canonical_shape({"num_tokens": 9, "n": m, "repeat": 10, "eps": 1e-6}), comb2.view(9, m, m))
    ap = tkjit.get_spec("pre_apply_mix")
    li2 = ap.reference(ap.canonical_shape({"num_tokens": 9, "mhc_mult": m, "hidden": 96}), residual, pre)
    for a, b in ((post, post2), (comb, comb2), (li, li2)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if seed:  # the zero token: rms = 1 / sqrt(eps) times zero mixes, so z = base
        z = base[m:2 * m]
        assert torch.allclose(post[4], torch.sigmoid(z) * 2.0) and not li[4].any()


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_tile_kernels_torch_references(seed):
    """From the same residual and fn (the GEMM outputs in float64 of tf32(fn)), within TileKernels' float32
    references' own rounding; the bf16 layer input within its last bit."""
    from tkjit_kernels.mhc.pre_norm_fn import reference_parts

    residual, fn, scale, base = data(2, 4, 4, 128, seed)
    out_mul, sqrsum = (t.float() for t in reference_parts(residual.view(8, 512), tf32_round(fn)))
    post, comb, li = tkjit.get_spec(NAME).reference(full(8, 4, 128), out_mul, sqrsum, scale, base,
                                                    residual.view(8, 4, 128))
    tpost, tcomb, tli = tk_chain(residual, fn, scale, base, **EPS)
    assert rel(post, tpost.view(8, 4)) < 1e-5 and rel(comb, tcomb.view(8, 4, 4)) < 1e-5
    assert rel(li, tli.view(8, 128)) < 4e-3


def test_op_matches_unfused_ops_and_has_no_gradient(refs):
    residual, fn, scale, base = data(2, 3, 4, 64, seed=2)
    leaves = [t.clone().requires_grad_() for t in (fn, scale, base)]
    post, comb, li = tkjit.ops.mhc_pre_big_fuse(residual, *leaves, *EPS.values())
    assert (post.shape, comb.shape, li.shape) == ((2, 3, 4, 1), (2, 3, 4, 4), (2, 3, 64))
    assert (post.dtype, comb.dtype, li.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    assert not any(t.requires_grad for t in (post, comb, li))  # inference only, as TileKernels'
    mixes = tkjit.ops.mhc_pre_norm_fn(residual, fn, None, EPS["rms_eps"])
    pre, post2, comb2 = tkjit.ops.mhc_pre_split_mixes(mixes, scale, base, 4, 2.0, EPS["mhc_pre_eps"])
    comb2 = tkjit.ops.sinkhorn(comb2, 10, 1e-6)
    li2 = tkjit.ops.mhc_pre_apply_mix(residual, pre)
    # the unfused references round the normed mixes from float64 of the GEMM, the fused one from its float32
    assert rel(post, post2) < 1e-6 and rel(comb, comb2) < 1e-6 and rel(li, li2) < 1e-3


def test_ops_opcheck_fake_and_compile(refs):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.mhc_pre_big_fuse.default
    residual, fn, scale, base = data(1, 6, 4, 64, seed=3)
    x = residual.view(6, 4, 64)
    args = (x, fn.clone().requires_grad_(), scale, base, *EPS.values())
    assert torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        outs = op(*(mode.from_tensor(t) for t in (x, fn, scale, base)), *EPS.values())
        assert [tuple(o.shape) for o in outs] == [(6, 4), (6, 4, 4), (6, 64)]
        assert [o.dtype for o in outs] == [torch.float32, torch.float32, torch.bfloat16]
    with pytest.raises(TensorError, match="fn must have shape"):
        op(x.to("meta"), fn[:, :64].to("meta"), scale, base, *EPS.values())
    f = torch.compile(lambda *a: tkjit.ops.mhc_pre_big_fuse(*a, *EPS.values()), fullgraph=True, backend="aot_eager")
    got = f(residual, fn, scale, base)
    want = tkjit.ops.mhc_pre_big_fuse(residual, fn, scale, base, *EPS.values())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    empty = tkjit.ops.mhc_pre_big_fuse(residual[:, :0], fn, scale, base, *EPS.values())
    assert [tuple(o.shape) for o in empty] == [(1, 0, 4, 1), (1, 0, 4, 4), (1, 0, 64)]


def test_compat_signature_is_tile_kernels():
    names = ["residual", "fn", "mhc_scale", "mhc_base", "rms_eps", "mhc_pre_eps", "mhc_sinkhorn_eps",
             "mhc_post_mult_value", "sinkhorn_repeat", "n_splits"]
    params = inspect.signature(tk.modeling.mhc.ops.mhc_pre_big_fuse).parameters
    assert list(params) == names
    assert [p.default for p in params.values()] == [inspect.Parameter.empty] * 9 + [16]


def test_compat_matches_tile_kernels_reference(refs):
    residual, fn, scale, base = data(2, 5, 4, 128, seed=4)
    post, comb, li = tk.modeling.mhc.ops.mhc_pre_big_fuse(residual, fn, scale, base, *EPS.values(), n_splits=4)
    tpost, tcomb, tli = tk_chain(residual, fn, scale, base, **EPS)
    assert post.shape == tpost.shape and comb.shape == tcomb.shape and li.shape == tli.shape
    assert rel(post, tpost) < 1e-5 and rel(comb, tcomb) < 1e-5 and rel(li, tli) < 4e-3


@pytest.mark.parametrize("kind", ["residual_dtype", "fn_shape", "fn_dtype", "scale", "base", "mhc", "hidden",
                                  "repeat", "n_splits", "eps"])
def test_compat_argument_errors(kind):
    residual, fn, scale, base = data(1, 2, 4, 64)
    args = dict(residual=residual, fn=fn, mhc_scale=scale, mhc_base=base, **EPS)
    err, match = TensorError, None
    if kind == "residual_dtype":
        args["residual"], match = residual.float(), "residual"
    elif kind == "fn_shape":
        args["fn"], match = fn[:, :128], "fn must have shape"
    elif kind == "fn_dtype":
        args["fn"], match = fn.double(), "fn"
    elif kind == "scale":
        args["mhc_scale"], match = scale[:2], "mhc_scale"
    elif kind == "base":
        args["mhc_base"], match = base.double(), "mhc_base"
    elif kind == "mhc":
        args["residual"], err, match = torch.zeros(1, 2, 9, 64, dtype=torch.bfloat16), ShapeError, "mhc_mult"
    elif kind == "hidden":
        args["residual"] = torch.zeros(1, 2, 4, 4, dtype=torch.bfloat16)
        args["fn"], err, match = torch.zeros(24, 16), ShapeError, "multiple of 32"
    elif kind == "repeat":
        args["sinkhorn_repeat"], err, match = 0, NotImplementedError, "sinkhorn_repeat"
    elif kind == "n_splits":
        args["n_splits"], match = 0, "n_splits"
    else:
        args["rms_eps"], err, match = "x", ShapeError, "rms_eps"
    with pytest.raises(err, match=match):
        tk.modeling.mhc.ops.mhc_pre_big_fuse(**args)


def test_mhc_pre_without_grad_runs_big_fuse(refs, monkeypatch):
    """TileKernels' mhc_pre: without gradients, its fused op with its arguments (no norm weight); it agrees with
    the differentiable path (no norm weight) to float32 rounding."""
    residual, fn, scale, base = data(2, 3, 4, 64, seed=5)
    calls = []
    real = tk.modeling.mhc.ops.mhc_pre_big_fuse

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(tk.modeling.mhc.ops, "mhc_pre_big_fuse", spy)
    kw = dict(norm_eps=1e-6, post_mult_value=2.0, pre_eps=1e-2, sinkhorn_eps=1e-6, sinkhorn_repeat=10, n_splits=4)
    with torch.no_grad():
        li, (post, comb) = tk.modeling.mhc.mhc_pre(residual, fn, scale, base, norm_weight=torch.ones(256), **kw)
    assert calls == [dict(rms_eps=1e-6, mhc_pre_eps=1e-2, mhc_sinkhorn_eps=1e-6, mhc_post_mult_value=2.0,
                          sinkhorn_repeat=10, n_splits=4)]
    gli, (gpost, gcomb) = tk.modeling.mhc.mhc_pre(residual, fn.clone().requires_grad_(), scale, base, **kw)
    assert len(calls) == 1 and gli.requires_grad
    assert (li.shape, post.shape, comb.shape) == (gli.shape, gpost.shape, gcomb.shape)
    assert rel(post, gpost.detach()) < 1e-6 and rel(comb, gcomb.detach()) < 1e-6 and rel(li, gli.detach()) < 1e-3
