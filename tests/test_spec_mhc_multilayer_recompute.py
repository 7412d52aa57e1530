"""mhc_multilayer_recompute on a CPU host: the spec, its exact float32 reference (pre_apply_mix's and
mhc_post_fwd's orders) against hand-computed values, the unfused references and TileKernels' torch
references, sm_90a cross-compiles (bf16: no C target), the torch op (opcheck, fake, torch.compile) and the
TileKernels compat entry point (lists stacked or read in place) with the kernels replaced by ones writing
the reference (the GPU tests run the real kernels)."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit_kernels.mhc._post import forward, forward_fma32
from tkjit_kernels.mhc.multilayer_recompute import MAX_STATE, recompute
from tkjit_kernels.mhc.pre_apply_mix import mix_streams

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
NAME = "mhc_multilayer_recompute"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def spec():
    return tkjit.get_spec(NAME)


def shape(t=8, m=4, h=64, L=3, P=2):
    return spec().canonical_shape({"num_tokens": t, "mhc_mult": m, "hidden": h, "num_layers": L, "num_post": P})


def _tk_data(bs, seq, m, h, L, P, seed=0):
    """TileKernels' generate_multilayer_recompute_test_data (standard normal), on the CPU."""
    g = torch.Generator().manual_seed(seed)
    ir = torch.randn(bs, seq, m, h, generator=g).bfloat16()
    pre = [torch.randn(bs, seq, m, 1, generator=g) for _ in range(L)]
    lo = [torch.randn(bs, seq, h, generator=g).bfloat16() for _ in range(P)]
    post = [torch.randn(bs, seq, m, 1, generator=g) for _ in range(P)]
    comb = [torch.randn(bs, seq, m, m, generator=g) for _ in range(P)]
    li = [torch.full((bs, seq, h), float("nan"), dtype=torch.bfloat16) for _ in range(L)]
    res = [torch.full((bs, seq, m, h), float("nan"), dtype=torch.bfloat16) for _ in range(P)]
    return ir, pre, lo, post, comb, li, res


def _unfused(ir, pre, lo, post, comb):
    """TileKernels' _mhc_multilayer_recompute_ref with tkjit's compat ops (what TileKernels' test compares)."""
    ops = tk.modeling.mhc.ops
    inputs, residuals, res = [], [], ir
    for i in range(len(pre)):
        inputs.append(ops.mhc_pre_apply_mix(res, pre[i]))
        if i < len(lo):
            res = ops.mhc_post_fwd(lo[i], res, post[i], comb[i])
            residuals.append(res)
    return inputs, residuals


# -- the spec ----------------------------------------------------------------------------------------

def test_registered_and_valid():
    s = spec()
    assert s.family == "mhc" and [p.name for p in s.runtime_params] == ["num_tokens"]
    assert [p.name for p in s.params] == ["num_tokens", "mhc_mult", "hidden", "num_layers", "num_post"]
    assert [t.name for t in s.inputs] == ["initial_residual", "pre_mix", "layer_output", "post_mix", "comb_mix"]
    assert [t.name for t in s.outputs] == ["layer_input", "residual"]
    assert set(s.space) == {"threads", "rows", "vec_bytes", "unroll", "unroll_layers"}
    for ex in s.examples:
        full = s.canonical_shape(ex)
        assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
        assert s.configs(full, "cpu") == []  # bf16: CUDA targets only
    for m in (1, 2, 4, 8, 16):
        for h in (2, 6, 100, 1280, 2560, 4096, 7168, 8192, 65536):
            for L, P in ((1, 1), (2, 1), (10, 9), (10, 10), (64, 64)):
                f = shape(4096, m, h, L, P)
                c = s.default_config(f)
                assert s.constraint(f, c) is None, (m, h, L, P)
                assert c["unroll_layers"] == (L <= 16)


def test_defaults_and_traffic():
    s = spec()
    assert s.default_config(shape(8192, 4, 7168, 10, 9)) == {
        "threads": 128, "rows": 1, "vec_bytes": 16, "unroll": 1, "unroll_layers": True}
    assert s.default_config(shape(8192, 4, 2560, 10, 10))["vec_bytes"] == 16
    assert s.default_config(shape(8192, 2, 7168, 10, 9))["unroll"] == 2  # 2 streams: two vectors per lane
    full = shape(8, 4, 64, 3, 2)
    n, m, h = 8, 4, 64
    # TileKernels' io_fused
    want = n * m * h * 2 + 3 * (n * m * 4 + n * h * 2) + 2 * (n * h * 2 + n * m * 4 + n * m * m * 4 + n * m * h * 2)
    assert s.bytes_moved(full) == want


@pytest.mark.parametrize("bad, match", [
    ({"num_layers": 3, "num_post": 1}, "num_post=1 must be num_layers=3 or num_layers - 1"),
    ({"num_layers": 2, "num_post": 3}, "num_post=3"),
    ({"num_layers": 1, "num_post": 0}, "num_post"),
    ({"num_layers": 0, "num_post": 0}, "num_layers"),
    ({"num_layers": 65, "num_post": 64}, "num_layers"),
    ({"mhc_mult": 17}, "mhc_mult"),
    ({"hidden": 0}, "hidden"),
    ({"num_tokens": 0}, "num_tokens"),
])
def test_bad_shapes(bad, match):
    with pytest.raises(ShapeError, match=match):
        spec().canonical_shape({"num_tokens": 8, "mhc_mult": 4, "hidden": 64, "num_layers": 3, "num_post": 2, **bad})


def test_bad_configs():
    s = spec()
    full = shape(64, 16, 1024, 2, 2)
    good = s.default_config(full)
    assert good["vec_bytes"] * good["unroll"] // 2 * 16 <= MAX_STATE
    with pytest.raises(ConfigError, match="spill registers"):
        s.check_config(full, {**good, "vec_bytes": 16, "unroll": 1})  # 16 streams x 8 values
    with pytest.raises(ConfigError, match="not in the space"):
        s.check_config(full, {**good, "unroll_layers": 1})
    with pytest.raises(ConfigError, match="C target"):
        s.check_config(full, good, arch="cpu")


# -- the reference -----------------------------------------------------------------------------------

def test_post_order_is_the_kernels():
    """fma(post, x, round(comb[0] * res[0])), not fma(comb[0], res[0], round(post * x)): a case where the two
    differ (comb[0] * res[0] = 1 + 2^-7 + 2^-17 + 2^-24 rounds to even, post * x cancels the rounded value)."""
    c0 = 1 + 2.0**-17
    x = torch.tensor([[1.0]]).bfloat16()
    res = torch.tensor([[[1 + 2.0**-7]]]).bfloat16()
    post = torch.tensor([[-(1 + 2.0**-7 + 2.0**-17)]])
    comb = torch.tensor([[[c0]]])
    assert forward_fma32(x, res, post, comb).item() == 0.0
    assert forward(x, res, post, comb).item() == 2.0**-24  # the exact value: the order shows
    # a second stream is one more fma onto that
    res2 = torch.cat([res, torch.tensor([[[3.0]]]).bfloat16()], 1)
    comb2 = torch.tensor([[[c0, 0.0], [0.5, 0.0]]])
    post2 = torch.tensor([[post.item(), 0.0]])
    assert forward_fma32(x, res2, post2, comb2)[0, 0].item() == 1.5


def test_reference_by_hand():
    """mhc 1, one layer of each: layer_input = bf16(pre * r), residual = bf16(fma(post, x, comb * r)); then
    the tail layer's input from that residual."""
    r = torch.tensor([[[1.5, -2.0, 0.0, 3.0]]]).bfloat16()  # (t=1, m=1, h=4)
    pre = torch.tensor([[[0.5]], [[2.0]]])  # (L=2, t, m)
    lo = torch.tensor([[[1.0, 1.0, -1.0, 0.25]]]).bfloat16()
    post = torch.tensor([[[2.0]]])
    comb = torch.tensor([[[[-1.0]]]])
    li, res = recompute(r, pre, lo, post, comb)
    assert li.dtype == res.dtype == torch.bfloat16 and li.shape == (2, 1, 4) and res.shape == (1, 1, 1, 4)
    assert li[0, 0].tolist() == [0.75, -1.0, 0.0, 1.5]
    assert res[0, 0, 0].tolist() == [0.5, 4.0, -2.0, -2.5]
    assert li[1, 0].tolist() == [1.0, 8.0, -4.0, -5.0]
    # the sums start from +0.0: a -0 product gives +0
    li, _ = recompute(torch.tensor([[[-0.0]]]).bfloat16(), torch.tensor([[[1.0]]]), lo[:, :, :1], post, comb)
    assert str(li.item()) == "0.0"


@pytest.mark.parametrize("m, h, L, P, seed", [(4, 64, 3, 2, 0), (4, 48, 3, 3, 1), (2, 40, 1, 1, 2), (1, 16, 2, 1, 3),
                                              (8, 24, 4, 3, 5)])
def test_reference_is_the_unfused_ops(m, h, L, P, seed):
    """Layer by layer: pre_apply_mix's reference and mhc_post_fwd's kernel order, each output rounded once."""
    full = shape(9, m, h, L, P)
    ir, pre, lo, post, comb = spec().make_inputs(full, seed=seed)
    li, res = spec().reference(full, ir, pre, lo, post, comb)
    assert li.shape == (L, 9, h) and res.shape == (P, 9, m, h)
    r = ir
    pa = tkjit.get_spec("pre_apply_mix")
    for l in range(L):
        assert torch.equal(li[l], pa.reference(pa.canonical_shape({"num_tokens": 9, "mhc_mult": m, "hidden": h}),
                                               r, pre[l]))
        if l < P:
            want = forward_fma32(lo[l], r, post[l], comb[l]).bfloat16()
            assert torch.equal(res[l], want)
            # within bf16 rounding of mhc_post_fwd's float64 reference and of TileKernels' float32 torch one
            exact = forward(lo[l], r, post[l], comb[l])
            assert float((res[l].double() - exact).norm() / exact.norm()) < 3e-3
            tkref = (lo[l].float().unsqueeze(-2) * post[l].unsqueeze(-1)
                     + torch.einsum("tmn,tmc->tnc", comb[l], r.float())).bfloat16()
            assert (res[l] != tkref).float().mean() < 0.02
            r = res[l]


def test_inputs_cover_signed_zeros_and_zero_mixes():
    full = shape(16, 4, 64, 3, 2)
    ir, pre, lo, post, comb = spec().make_inputs(full, seed=1)
    assert (pre[:, ::3, 0] == 0).all() and (post[:, 1::4, -1] == 0).all()
    assert bool((ir == 0).any()) and bool(torch.signbit(ir[ir == 0]).any())
    assert (lo.shape, post.shape, comb.shape) == ((2, 16, 64), (2, 16, 4), (2, 16, 4, 4))
    a, b = spec().make_inputs(full, seed=2), spec().make_inputs(full, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- sm_90a cross-compiles ---------------------------------------------------------------------------

@pytest.mark.parametrize("full, config", [
    ({"num_tokens": 8192, "mhc_mult": 4, "hidden": 7168, "num_layers": 3, "num_post": 2}, None),
    ({"num_tokens": 100, "mhc_mult": 3, "hidden": 1000, "num_layers": 2, "num_post": 2},
     {"threads": 64, "rows": 2, "vec_bytes": 8, "unroll": 3, "unroll_layers": False}),
])
def test_compiles_for_sm90a(full, config):
    k = tkjit.get(NAME, full, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert src.count("__global__") >= 1
    # the fma order is spelled out: nothing left to nvcc's contraction
    assert "__fmul_rn" in src and "__fmaf_rn" in src
    if config is None:
        assert "uint4" in src  # 16-byte vectors of the bf16 rows


# -- the torch op (kernels replaced by ones writing the reference) ---------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    return serve_references(monkeypatch, (NAME, "pre_apply_mix", "mhc_post_fwd"))


def _flat(t=6, m=4, h=64, L=3, P=2, seed=0):
    return spec().make_inputs(shape(t, m, h, L, P), seed=seed)


def test_op_opcheck_and_fake_shapes(reference_kernels):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.mhc_multilayer_recompute.default
    assert "(Tensor initial_residual, Tensor pre_mix, Tensor layer_output, Tensor post_mix, Tensor comb_mix, " \
           "str? config=None) -> (Tensor, Tensor)" in str(op._schema)
    for L, P in ((3, 2), (2, 2), (1, 0)):
        args = _flat(L=L, P=max(P, 1)) if P else _flat(L=1, P=1)
        if not P:  # one layer, no post
            args = (args[0], args[1], args[2][:0], args[3][:0], args[4][:0])
        assert torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        li, res = op(*(mode.from_tensor(a) for a in _flat(t=5, m=3, h=40, L=4, P=3)))
        assert li.shape == (4, 5, 40) and res.shape == (3, 5, 3, 40)
        assert li.dtype == res.dtype == torch.bfloat16 and li.is_contiguous() and res.is_contiguous()
    ir, pre, lo, post, comb = (a.to("meta") for a in _flat())
    assert all(t.is_meta for t in op(ir, pre, lo, post, comb))
    with pytest.raises(TensorError, match="layer_output has dtype torch.float32"):
        op(ir, pre, lo.float(), post, comb)
    with pytest.raises(ShapeError, match="num_post .* must be num_layers or num_layers - 1"):
        op(ir, pre, lo[:1], post[:1], comb[:1])
    with pytest.raises(ShapeError, match="comb_mix has 1 layers, layer_output 2"):
        op(ir, pre, lo, post, comb[:1])
    with pytest.raises(TensorError, match="comb_mix: expected a 4-D"):
        op(ir, pre, lo, post, comb[0])


def test_op_values_and_the_one_layer_case(reference_kernels):
    full = shape(7, 4, 48, 3, 2)
    args = spec().make_inputs(full, seed=1)
    want = spec().reference(full, *args)
    got = tkjit.ops.mhc_multilayer_recompute(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    out = (torch.full_like(want[0], float("nan")), torch.full_like(want[1], float("nan")))
    assert tkjit.ops.mhc_multilayer_recompute(*args, out=out) is not None
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    # TileKernels-style leading dims and (..., mhc, 1) mixes
    ir, pre, lo, post, comb = args
    li, res = tkjit.ops.mhc_multilayer_recompute(ir.view(1, 7, 4, 48), pre.view(3, 1, 7, 4, 1), lo.view(2, 1, 7, 48),
                                                 post.view(2, 1, 7, 4, 1), comb.view(2, 1, 7, 4, 4))
    assert li.shape == (3, 1, 7, 48) and res.shape == (2, 1, 7, 4, 48)
    assert torch.equal(li.view(3, 7, 48), want[0]) and torch.equal(res.view(2, 7, 4, 48), want[1])
    # one layer without a post: pre_apply_mix
    li, res = tkjit.ops.mhc_multilayer_recompute(ir, pre[:1], lo[:0], post[:0], comb[:0])
    assert res.shape == (0, 7, 4, 48) and torch.equal(li[0], mix_streams(ir, pre[0]).bfloat16())
    # an empty batch
    li, res = tkjit.ops.mhc_multilayer_recompute(ir[:0], pre[:, :0], lo[:, :0], post[:, :0], comb[:, :0])
    assert li.shape == (3, 0, 48) and res.shape == (2, 0, 4, 48)


def test_ops_errors():
    ir, pre, lo, post, comb = _flat()
    f = tkjit.ops.mhc_multilayer_recompute
    with pytest.raises(TensorError, match="initial_residual must be torch.bfloat16"):
        f(ir.float(), pre, lo, post, comb)
    with pytest.raises(TensorError, match="pre_mix must be .*6 tokens of 4 values per layer"):
        f(ir, pre[:, :5], lo, post, comb)
    with pytest.raises(ShapeError, match="num_post must be num_layers or num_layers - 1"):
        f(ir, pre, lo[:1], post[:1], comb[:1])
    with pytest.raises(ShapeError, match="post_mix has 1 layers"):
        f(ir, pre, lo, post[:1], comb)
    li = torch.empty(3, 6, 64, dtype=torch.bfloat16)
    with pytest.raises(TensorError, match="out must be a \\(layer_input, residual\\) pair"):
        f(ir, pre, lo, post, comb, out=li)
    with pytest.raises(TensorError, match="residual"):
        f(ir, pre, lo, post, comb, out=(li, torch.empty(2, 6, 4, 32, dtype=torch.bfloat16)))


def test_compiled(reference_kernels):
    args = _flat(t=5, m=4, h=32, L=3, P=3, seed=3)
    want = spec().reference(shape(5, 4, 32, 3, 3), *args)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(*a):
        li, res = tkjit.ops.mhc_multilayer_recompute(*a)
        return li * 1.0, res

    got = f(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -- compat ------------------------------------------------------------------------------------------

def test_compat_signature_is_tile_kernels():
    P = inspect.Parameter
    params = inspect.signature(tk.modeling.mhc.ops.mhc_multilayer_recompute).parameters.values()
    assert [(p.name, p.kind, p.default) for p in params] == [
        (n, P.POSITIONAL_OR_KEYWORD, P.empty) for n in (
            "initial_residual", "pre_mix_list", "layer_output_list", "post_mix_list", "comb_mix_list",
            "layer_input_list", "residual_list")]
    assert inspect.signature(tk.modeling.mhc.ops.mhc_multilayer_recompute).return_annotation in (None, "None")


@pytest.mark.parametrize("L, P, h", [(1, 1, 64), (3, 2, 64), (3, 3, 40), (10, 9, 16), (1, 0, 32)])
def test_compat_is_the_unfused_ops(reference_kernels, L, P, h):
    """TileKernels' test: the fused call equals its own unfused ops (here tkjit's) bit for bit."""
    data = _tk_data(1, 12, 4, h, L, P, seed=L * 10 + P)
    assert tk.modeling.mhc.ops.mhc_multilayer_recompute(*data) is None
    inputs, residuals = _unfused(*data[:5])
    li, res = data[5], data[6]
    assert len(inputs) == len(li) == L and len(residuals) == len(res) == P
    for a, b in zip(li + res, inputs + residuals):
        assert a.shape == b.shape and torch.equal(a, b)


def test_compat_reads_and_writes_one_buffer_in_place(reference_kernels, monkeypatch):
    import tkjit.ops as ops

    L, P, m, h = 3, 2, 4, 32
    ir, pre, lo, post, comb, _, _ = _tk_data(2, 5, m, h, L, P, seed=4)
    pre_buf, lo_buf = torch.stack(pre), torch.stack(lo)
    li_buf = torch.empty(L, 2, 5, h, dtype=torch.bfloat16)
    res_buf = torch.empty(P, 2, 5, m, h, dtype=torch.bfloat16)
    stacks = []
    real = ops.stacked_layers

    def spy(items, *a, **kw):
        out = real(items, *a, **kw)
        stacks.append(ops.is_storage_of(items, out))
        return out

    monkeypatch.setattr(ops, "stacked_layers", spy)
    tk.modeling.mhc.ops.mhc_multilayer_recompute(ir, list(pre_buf.unbind(0)), list(lo_buf.unbind(0)), post, comb,
                                                 list(li_buf.unbind(0)), list(res_buf.unbind(0)))
    assert stacks == [True, True, False, False, True, True]  # post / comb: separate tensors, stacked copies
    inputs, residuals = _unfused(ir, pre, lo, post, comb)
    assert torch.equal(li_buf, torch.stack(inputs)) and torch.equal(res_buf, torch.stack(residuals))


def test_compat_non_contiguous_and_odd_shaped_tensors(reference_kernels):
    """Only element counts matter (TileKernels reads raw pointers); strided outputs are written through."""
    L, P, m, h = 2, 2, 2, 16
    ir, pre, lo, post, comb, _, _ = _tk_data(1, 6, m, h, L, P, seed=5)
    pre2 = [p.view(6, m) for p in pre]
    lo2 = [torch.stack([x, x], -1)[..., 0] for x in lo]  # non-contiguous views
    li = [torch.empty(6, h, 2, dtype=torch.bfloat16)[..., 1] for _ in range(L)]
    res = [torch.empty(6 * m * h, dtype=torch.bfloat16) for _ in range(P)]
    tk.modeling.mhc.ops.mhc_multilayer_recompute(ir, pre2, lo2, post, comb, li, res)
    inputs, residuals = _unfused(ir, pre, lo, post, comb)
    for a, b in zip(li, inputs):
        assert torch.equal(a, b.view(6, h))
    for a, b in zip(res, residuals):
        assert torch.equal(a, b.flatten())


def _args(L=3, P=2):
    return list(_tk_data(1, 4, 4, 16, L, P))


@pytest.mark.parametrize("edit, error, match", [
    (lambda a: a.__setitem__(0, a[0].float()), TensorError, "initial_residual must be torch.bfloat16"),
    (lambda a: a.__setitem__(0, a[0][0, 0, 0]), TensorError, "initial_residual must be"),
    (lambda a: a.__setitem__(1, tuple(a[1])[:2]), ShapeError, "layer_input_list has 3 tensors, pre_mix_list 2"),
    (lambda a: a.__setitem__(4, a[4][:1]), ShapeError, "comb_mix_list has 1 tensors, layer_output_list 2"),
    (lambda a: [a.__setitem__(i, a[i][:1]) for i in (2, 3, 4, 6)], ShapeError, "post count \\(1\\) must be"),
    (lambda a: [a.__setitem__(i, []) for i in (1, 2, 3, 4, 5, 6)], ShapeError, "post count"),
    (lambda a: a.__setitem__(1, a[1][0]), TensorError, "pre_mix_list must be a list of torch.Tensor"),
    (lambda a: a[2].__setitem__(1, a[2][1].float()), TensorError, "layer_output_list\\[1\\] must be torch.bfloat16"),
    (lambda a: a[4].__setitem__(0, a[4][0][..., :3]), TensorError, "comb_mix_list\\[0\\] must hold 4 tokens of 16"),
    (lambda a: a[6].__setitem__(0, a[6][0][:, :2]), TensorError, "residual_list\\[0\\] must hold"),
    (lambda a: a[5].__setitem__(2, a[5][2].to("meta")), TensorError, "layer_input_list\\[2\\] is on meta"),
])
def test_compat_argument_errors(edit, error, match):
    a = _args()
    edit(a)
    with pytest.raises(error, match=match):
        tk.modeling.mhc.ops.mhc_multilayer_recompute(*a)


def test_compat_sizes_tkjit_lacks_are_not_implemented():
    a = _args(L=65, P=65)
    with pytest.raises(NotImplementedError, match="num_layers \\(len\\(pre_mix_list\\)\\)=65"):
        tk.modeling.mhc.ops.mhc_multilayer_recompute(*a)


def test_the_reference_replayed_by_token_chunks_equals_the_whole_replay(monkeypatch):
    """The reference replays chunks of tokens (its float64 temporaries stay in cache): the same bits as one replay
    of every token, at a count that leaves a partial last chunk."""
    import tkjit_kernels.mhc.multilayer_recompute as mr

    full = spec().canonical_shape({"num_tokens": 23, "mhc_mult": 4, "hidden": 64, "num_layers": 3, "num_post": 2})
    inputs = spec().make_inputs(full, "cpu", 5)
    whole = mr._recompute(*inputs)
    monkeypatch.setattr(mr, "CHUNK_ELEMS", 5 * 4 * 64)  # 5 tokens a chunk: 4 full chunks and one of 3
    chunked = mr.recompute(*inputs)
    for a, b in zip(whole, chunked):
        assert a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
