"""per_token_cast(_colmajor) on the GPU: the default and every config of the space, bit-exact, poisoned outputs;
whole and partial last groups (hidden % group != 0), groups 16 to hidden."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.pool import compile_many
from tkjit.testing import check
from tkjit.timing import median, time_cuda

pytestmark = pytest.mark.gpu
NAME = "per_token_cast"
STATIC = [
    {"hidden": 7168, "group": 128},
    {"hidden": 7168, "group": 128, "round_scale": True},
    {"hidden": 4096, "group": 128, "in_dtype": "float32"},
    {"hidden": 4096, "group": 64},
    {"hidden": 576, "group": 32},
    {"hidden": 576, "group": 64, "in_dtype": "float32", "round_scale": True},
    {"hidden": 576, "group": 576},
    {"hidden": 7168, "group": 7168},
    {"hidden": 7168, "group": 7168, "in_dtype": "float32"},
    {"hidden": 1152, "group": 1152, "in_dtype": "float32", "round_scale": True},
    {"hidden": 16, "group": 16},
    # partial last group: num_groups = ceil(hidden / group), the last group's amax over its real channels
    {"hidden": 576, "group": 128},
    {"hidden": 576, "group": 128, "in_dtype": "float32"},
    {"hidden": 576, "group": 128, "round_scale": True},
    {"hidden": 48, "group": 32},
    {"hidden": 64, "group": 128},  # one partial group per token
    {"hidden": 1040, "group": 64, "in_dtype": "float32", "round_scale": True},
    {"hidden": 2064, "group": 128, "in_dtype": "float32"},
    # group 16
    {"hidden": 7168, "group": 16},
    {"hidden": 576, "group": 16, "in_dtype": "float32", "round_scale": True},
]
EVERY = [
    {"hidden": 7168, "group": 128},
    {"hidden": 7168, "group": 7168, "in_dtype": "float32"},
    {"hidden": 576, "group": 576, "round_scale": True},
    {"hidden": 576, "group": 32, "in_dtype": "float32"},
    {"hidden": 4096, "group": 64, "round_scale": True},
    {"hidden": 576, "group": 128},  # partial last group (64 channels): guarded and unguarded chunk slots
    {"hidden": 576, "group": 16, "in_dtype": "float32"},  # group 16
]


@pytest.mark.parametrize("static", STATIC, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_default_config_every_size(static):
    tokens = (1, 7, 4001, 65536) if static["hidden"] <= 1152 else (1, 7, 4001)
    for t in tokens:
        kern = tkjit.get(NAME, {**static, "num_tokens": t})
        for seed in (0, 1):
            assert check(kern, {**static, "num_tokens": t}, seed=seed) is None


def test_deepseek_size():
    static = {"hidden": 7168, "group": 128}
    kern = tkjit.get(NAME, {**static, "num_tokens": 32768})
    assert check(kern, {**static, "num_tokens": 32768}, seed=5) is None


def test_every_config_in_the_space():
    spec = tkjit.get_spec(NAME)
    jobs = []
    for static in EVERY:
        full = spec.canonical_shape({**static, "num_tokens": 7})
        jobs += [(NAME, spec.static_shape(full), c, "sm_90a", "explicit") for c in spec.configs(full, "sm_90a")]
    errors = compile_many(jobs)
    assert all(err is None for _, err in errors), [err for _, err in errors if err][:5]
    failures = []
    for i, (_, static, cfg, _, _) in enumerate(jobs):
        kern = tkjit.get(NAME, {**static, "num_tokens": 7}, config=cfg)
        for t in (1, 7, 4001):
            msg = check(kern, {**static, "num_tokens": t}, seed=i)
            if msg:
                failures.append(msg)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_bad_tensors_raise():
    kern = tkjit.get(NAME, {"num_tokens": 64, "hidden": 576, "group": 64})
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x.float())  # compiled for bf16
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 576"):
        kern(torch.randn(64, 512, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        kern(torch.randn(576, 64, device="cuda", dtype=torch.bfloat16).t())
    out = torch.empty(64, 576, device="cuda", dtype=torch.float8_e4m3fn)
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 9"):
        kern(x, out=(out, torch.empty(64, 8, device="cuda")))
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(x, out=(out.view(torch.uint8), torch.empty(64, 9, device="cuda")))
    with pytest.raises(tkjit.TensorError, match="other tensors say"):
        kern(x, out=(torch.empty(32, 576, device="cuda", dtype=torch.float8_e4m3fn), torch.empty(32, 9, device="cuda")))


def test_returns_values_and_scales():
    kern = tkjit.get(NAME, {"num_tokens": 5, "hidden": 4096, "group": 128})
    x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    q, s = kern(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 4096)
    assert s.dtype == torch.float32 and s.shape == (5, 32)
    deq = q.float() * s.repeat_interleave(128, 1)
    assert torch.allclose(deq, x.float(), rtol=0.07, atol=1e-3)


def test_report_time_at_target():
    """Not a gate: prints the default config's time at 32768 x 7168 bf16 (target <= 170 us on H200)."""
    kern = tkjit.get(NAME, {"num_tokens": 32768, "hidden": 7168, "group": 128})
    x = torch.randn(32768, 7168, device="cuda", dtype=torch.bfloat16)
    out = kern(x)
    us = median(time_cuda(lambda: kern(x, out=out)))
    gbs = kern.spec.bytes_moved(kern.shape | {"num_tokens": 32768}) / us / 1e3
    print(f"\nper_token_cast 32768x7168 bf16 g128 {kern.config}: {us:.1f} us/call, {gbs:.0f} GB/s")


# -- column-major, TMA-aligned scales (per_token_cast_colmajor) --------------------------------------
COLMAJOR = "per_token_cast_colmajor"
COLMAJOR_DEFAULTS = [
    {"hidden": 7168, "group": 128},
    {"hidden": 576, "group": 128},  # partial last group: 5 columns
    {"hidden": 7168, "group": 16},
    {"hidden": 576, "group": 32},
    {"hidden": 576, "group": 576, "round_scale": True},  # one group per token (group == hidden)
]
COLMAJOR_CONFIGS = [  # a handful besides the defaults (not the space: the values path is shared)
    ({"hidden": 7168, "group": 128}, {"vec": 8, "group_threads": 1, "threads": 128, "iters": 4}),
    ({"hidden": 7168, "group": 128, "round_scale": True}, {"vec": 16, "group_threads": 8, "threads": 512,
                                                           "iters": 1}),
    ({"hidden": 7168, "group": 7168, "in_dtype": "float32"}, None),  # wide group, cross-warp reduction
    ({"hidden": 576, "group": 32, "in_dtype": "float32"}, {"vec": 4, "group_threads": 8, "threads": 256,
                                                           "iters": 4}),
    ({"hidden": 576, "group": 64}, {"vec": 8, "group_threads": 2, "threads": 128, "iters": 1}),
    # partial last group: 16 channels, two 16-byte loads per chunk; every tail slot guarded
    ({"hidden": 2064, "group": 128, "in_dtype": "float32", "round_scale": True}, {"vec": 8, "group_threads": 2,
                                                                                  "threads": 128, "iters": 1}),
    ({"hidden": 48, "group": 32}, {"vec": 8, "group_threads": 4, "threads": 128, "iters": 4}),
]


@pytest.fixture(scope="module")
def colmajor_compiled():
    """The col-major variants below, compiled in parallel up front (keeps the added time small)."""
    spec = tkjit.get_spec(COLMAJOR)
    jobs = []
    for static, cfg in [(s, None) for s in COLMAJOR_DEFAULTS] + COLMAJOR_CONFIGS:
        full = spec.canonical_shape({**static, "num_tokens": 7})
        jobs.append((COLMAJOR, spec.static_shape(full), cfg or spec.default_config(full, "sm_90a"), "sm_90a",
                     "explicit"))
    errors = compile_many(jobs)
    assert all(err is None for _, err in errors), [err for _, err in errors if err]


@pytest.mark.parametrize("static", COLMAJOR_DEFAULTS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_colmajor_default_config(colmajor_compiled, static):
    """Tokens 1, 7, 4001 pad the columns to 4, 8, 4004 (padding must come back 0); 65536 needs none."""
    for t in (1, 7, 4001, 65536):
        kern = tkjit.get(COLMAJOR, {**static, "num_tokens": t})
        assert check(kern, {**static, "num_tokens": t}, seed=t) is None


@pytest.mark.parametrize("static,config", COLMAJOR_CONFIGS, ids=lambda v: "-".join(map(str, v.values())) if v else "d")
def test_colmajor_other_configs(colmajor_compiled, static, config):
    for t in (1, 7, 4001):
        kern = tkjit.get(COLMAJOR, {**static, "num_tokens": t}, config=config)
        assert check(kern, {**static, "num_tokens": t}, seed=t + 1) is None


def test_colmajor_ops_view_matches_row_major():
    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16)
    q, s = tkjit.ops.per_token_cast(x, 128, col_major_scales=True)
    q_row, s_row = tkjit.ops.per_token_cast(x, 128)
    assert s.shape == (4001, 56) and s.stride() == (1, 4004)
    assert torch.equal(q.view(torch.uint8), q_row.view(torch.uint8)) and torch.equal(s, s_row)
    storage = torch.as_strided(s, (56, 4004), (4004, 1))  # the whole padded buffer
    assert (storage[:, 4001:] == 0).all()
    empty_q, empty_s = tkjit.ops.per_token_cast(x[:0], 128, col_major_scales=True)
    assert empty_q.shape == (0, 7168) and empty_s.shape == (0, 56)


def test_colmajor_bad_scale_buffers_raise():
    kern = tkjit.get(COLMAJOR, {"num_tokens": 5, "hidden": 576, "group": 64})
    x = torch.randn(5, 576, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(5, 576, device="cuda", dtype=torch.float8_e4m3fn)
    with pytest.raises(tkjit.TensorError, match="rounded up to a multiple of 4"):
        kern(x, out=(out, torch.empty(9, 5, device="cuda")))  # unpadded columns
    with pytest.raises(tkjit.TensorError, match="axis 0 must be 9"):
        kern(x, out=(out, torch.empty(5, 9, device="cuda")))  # row-major buffer
    q, storage = kern(x, out=(out, torch.full((9, 8), float("nan"), device="cuda")))
    assert storage.isfinite().all() and (storage[:, 5:] == 0).all()


def test_colmajor_matches_tile_kernels_layout():
    """Where TileKernels is installed: same (num_tokens, num_groups) view, same strides, same values."""
    tk = pytest.importorskip("tile_kernels.quant")
    x = torch.randn(4001, 7168, device="cuda", dtype=torch.bfloat16)
    q_tk, s_tk = tk.per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True)
    q, s = tkjit.ops.per_token_cast(x, 128, col_major_scales=True)
    assert s.shape == s_tk.shape and s.stride() == s_tk.stride()
    assert torch.allclose(s, s_tk, rtol=1e-6, atol=0)
    assert (q.view(torch.uint8) != q_tk.view(torch.uint8)).float().mean().item() < 1e-3


# -- row-strided x: x = buf[:, off:off + hidden] of a wider buffer, read in place ----------------------
def _wide_x(n, width, in_dtype, seed):
    """Fresh random rows spanning many magnitudes (the spec's own inputs, `width` wide), on the GPU."""
    shape = {"num_tokens": n, "hidden": width, "in_dtype": in_dtype}
    return tkjit.get_spec(NAME).make_inputs(shape, seed=seed)[0].cuda()


def _poisoned_outs(kern, n):
    spec, shape = kern.spec, {**kern.shape, "num_tokens": n}
    (_, _, qdims), (_, _, sdims) = spec.output_decls(shape)
    q = torch.empty(qdims, device="cuda", dtype=torch.uint8).fill_(0xFF).view(torch.float8_e4m3fn)
    return q, torch.full(sdims, float("nan"), device="cuda")


def _same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(
        a.view(torch.int32), b.view(torch.int32))


# (num_tokens, hidden, group, in_dtype, buffer width - hidden, offset in chunks of the kernel's x_align)
STRIDED = [
    (32768, 7168, 128, "bfloat16", 7168, 0),  # the benchmark case: a 32768 x 14336 buffer's left half
    (4001, 7168, 128, "bfloat16", 64, 2),
    (1, 576, 64, "bfloat16", 448, 1),
    (65, 576, 32, "float32", 24, 3),
    (7, 4096, 4096, "float32", 32, 1),  # one group per token: cross-warp reduction
    (4001, 576, 128, "bfloat16", 64, 1),  # partial last group
    (65, 2064, 128, "float32", 16, 2),
    (33, 48, 16, "bfloat16", 8, 3),  # group 16
]


@pytest.mark.parametrize("name", [NAME, "per_token_cast_colmajor"])
@pytest.mark.parametrize("n, hidden, group, in_dtype, extra, chunks", STRIDED)
def test_strided_x_is_bit_exact(name, n, hidden, group, in_dtype, extra, chunks):
    kern = tkjit.get(name, {"num_tokens": n, "hidden": hidden, "group": group, "in_dtype": in_dtype})
    eb = 2 if in_dtype == "bfloat16" else 4
    align = kern.spec.inputs[0].align_bytes(kern.shape, kern.config) // eb  # elements
    off = chunks * align
    width = hidden + -(-(extra + off) // align) * align
    x = _wide_x(n, width, in_dtype, seed=n)[:, off:off + hidden]
    assert x.stride() == (width, 1)
    want = kern(x.contiguous(), out=_poisoned_outs(kern, n))
    got = kern(x, out=_poisoned_outs(kern, n))
    torch.cuda.synchronize()
    ref = kern.spec.reference({**kern.shape, "num_tokens": n}, x.contiguous())
    for g, w, r in zip(got, want, ref):
        assert _same_bits(g, w) and _same_bits(g, r.cuda())
    q, s = tkjit.ops.per_token_cast(x, group, col_major_scales=name != NAME)
    assert _same_bits(q, got[0])
    assert torch.equal(s, got[1] if name == NAME else got[1][:, :n].T)


def test_misaligned_x_is_refused():
    kern = tkjit.get(NAME, {"num_tokens": 64, "hidden": 7168, "group": 128})
    x = _wide_x(64, 7168 + 16, "bfloat16", seed=0)
    with pytest.raises(tkjit.TensorError, match="byte aligned"):
        kern(x[:, 3:3 + 7168])


def test_report_strided_vs_contiguous_time():
    """For the benchmark note: 32768 x 7168 bf16 read from a 32768 x 14336 buffer's left half, against
    a contiguous copy of it, and against a .contiguous() copy before the call."""
    kern = tkjit.get(NAME, {"num_tokens": 32768, "hidden": 7168, "group": 128})
    buf = _wide_x(32768, 14336, "bfloat16", seed=5)
    x = buf[:, :7168]
    xc = x.contiguous()
    out = kern(xc)
    strided = median(time_cuda(lambda: kern(x, out=out)))
    contiguous = median(time_cuda(lambda: kern(xc, out=out)))
    copy_then = median(time_cuda(lambda: kern(x.contiguous(), out=out)))
    print(f"\nper_token_cast 32768x7168 bf16 g128 {kern.config}: strided view {strided:.1f} us, contiguous "
          f"{contiguous:.1f} us, .contiguous() + kernel {copy_then:.1f} us")
    q, s = kern(x)
    assert _same_bits(q, out[0]) and _same_bits(s, out[1])


# -- partial last group (hidden % group != 0) ---------------------------------------------------------
@pytest.mark.parametrize("name", [NAME, COLMAJOR])
@pytest.mark.parametrize(
    "n, hidden, group, in_dtype, config",
    [
        (4001, 576, 128, "bfloat16", None),
        (7, 576, 128, "float32", {"vec": 4, "group_threads": 8, "threads": 256, "iters": 4}),
        (65, 2064, 128, "float32", {"vec": 8, "group_threads": 2, "threads": 128, "iters": 1}),
        (129, 48, 32, "bfloat16", {"vec": 8, "group_threads": 4, "threads": 128, "iters": 1}),
        (3, 64, 128, "bfloat16", None),
    ],
)
def test_partial_group_never_reads_past_hidden(name, n, hidden, group, in_dtype, config):
    """x = buf[:, :hidden] of a wider buffer whose columns past hidden hold huge values, out of every
    group's range: a partial last group that read them would get a larger amax (different scale and
    values). Outputs are poisoned, so a store that fell outside the row's channels shows too."""
    kern = tkjit.get(name, {"num_tokens": n, "hidden": hidden, "group": group, "in_dtype": in_dtype},
                     config=config)
    eb = 2 if in_dtype == "bfloat16" else 4
    align = kern.spec.inputs[0].align_bytes(kern.shape, kern.config) // eb
    width = hidden + -(-group // align) * align  # room for a whole group's worth of neighbours
    buf = _wide_x(n, width, in_dtype, seed=n)
    buf[:, hidden:] = torch.finfo(buf.dtype).max / 2
    x = buf[:, :hidden]
    got = kern(x, out=_poisoned_outs(kern, n))
    ref = kern.spec.reference({**kern.shape, "num_tokens": n}, x.contiguous())
    torch.cuda.synchronize()
    for g, r in zip(got, ref):
        assert _same_bits(g, r.cuda())


def test_partial_group_scales_shapes_and_values():
    """hidden 576, group 128: five scales per token, the fifth over channels 512..575 only."""
    x = torch.randn(33, 576, device="cuda", dtype=torch.bfloat16)
    x[:, :512] *= 1000  # large whole groups must not leak into the partial one
    q, s = tkjit.ops.per_token_cast(x, 128)
    assert q.shape == (33, 576) and s.shape == (33, 5)
    amax = x[:, 512:].float().abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(s[:, 4], amax / torch.full_like(amax, 448.0))
    qc, sc = tkjit.ops.per_token_cast(x, 128, col_major_scales=True)
    assert sc.shape == (33, 5) and sc.stride() == (1, 36)
    assert torch.equal(sc, s) and _same_bits(qc, q)
    q16, s16 = tkjit.ops.per_token_cast(x[:, 512:].contiguous(), 64)  # the same channels as one group
    assert torch.equal(s16[:, 0], s[:, 4]) and _same_bits(q16, q[:, 512:].contiguous())


@pytest.mark.parametrize("hidden, group", [(576, 128), (2064, 128), (576, 16), (48, 32)])
@pytest.mark.parametrize("col_major", [False, True])
def test_partial_group_matches_tile_kernels(hidden, group, col_major):
    """Where TileKernels is installed: its torch reference bit-exactly, and its kernel's layout."""
    pytest.importorskip("tile_kernels")
    from tile_kernels.quant import per_token_cast as tk_cast
    from tile_kernels.torch import cast as tk_ref

    x = _wide_x(4001, hidden, "bfloat16", seed=hidden)
    q, s = tkjit.ops.per_token_cast(x, group, round_scale=col_major, col_major_scales=col_major)
    q_ref, s_ref = tk_ref(x, "e4m3", (1, group), round_sf=col_major, use_tma_aligned_col_major_sf=col_major)
    assert s.shape == s_ref.shape == (4001, -(-hidden // group))
    assert torch.equal(s, s_ref) and _same_bits(q, q_ref)
    q_tk, s_tk = tk_cast(x, "e4m3", group, use_tma_aligned_col_major_sf=col_major, round_sf=col_major)
    assert s.shape == s_tk.shape and s.stride() == s_tk.stride()
    assert torch.allclose(s, s_tk, rtol=1e-6, atol=0)
    assert (q.view(torch.uint8) != q_tk.view(torch.uint8)).float().mean().item() < 1e-3


@pytest.mark.parametrize("hidden, group", [(7168, 128), (7168, 32), (576, 128), (2048, 16)])
def test_packed_ue8m0_matches_tile_kernels(hidden, group):
    """Packed UE8M0 scales (`use_packed_ue8m0`): the same int32 view, strides and bits as TileKernels'
    kernel and its torch reference, values bit-exact."""
    tk = pytest.importorskip("tile_kernels")
    from tile_kernels.torch import cast as tk_cast

    import tkjit.compat.tile_kernels as tkc

    x = torch.randn(4001, hidden, device="cuda", dtype=torch.bfloat16) * 3
    q, sf = tkc.quant.per_token_cast(x, "e4m3", group, None, True, True, True)
    q_tk, sf_tk = tk.quant.per_token_cast(x, "e4m3", group, None, True, True, True)
    q_ref, sf_ref = tk_cast(x, "e4m3", (1, group), round_sf=True, use_tma_aligned_col_major_sf=True,
                            use_packed_ue8m0=True)
    for want in (sf_tk, sf_ref):
        assert sf.dtype == want.dtype == torch.int32 and sf.shape == want.shape and sf.stride() == want.stride()
    assert torch.equal(sf, sf_ref)  # the reference zero-pads the bytes past the last group, as tkjit does
    # TileKernels' kernel leaves those padding bytes unspecified (0x3D seen at hidden 576, group 128):
    # compare its words on the bytes of real groups only.
    groups = -(-hidden // group)
    keep = torch.full((sf.shape[1],), -1, dtype=torch.int64, device=sf.device)
    if groups % 4:
        keep[-1] = (1 << (8 * (groups % 4))) - 1
    assert torch.equal(sf.to(torch.int64) & keep, sf_tk.to(torch.int64) & keep)
    assert torch.equal(q.view(torch.uint8), q_tk.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
