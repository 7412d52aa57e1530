"""get_fused_mapping on the CPU: spec, reference semantics (against a loop written from the definition and
against a model of the kernel's per-warp algorithm), an sm_90a cross-compile, the torch op, tkjit.ops and
the compat entry point (the CUDA-only kernel runs as a CompiledKernel whose launch writes the reference)."""

import sys
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.ops
import tkjit.torch_ops
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.spec import validate
from tkjit_kernels.moe import get_fused_mapping as mod

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from common import launches_cooperatively  # noqa: E402
from reference_kernels import serve_references  # noqa: E402

NAME = "get_fused_mapping"


@pytest.fixture(scope="module")
def spec():
    return get_spec(NAME)


def _shape(n, k, e, a, nexp=None):
    return {"num_tokens": n, "num_topk": k, "num_experts": e, "alignment": a,
            "num_expanded_tokens": mod.upper_bound(n, k, e, a) if nexp is None else nexp}


def _loop_reference(topk, e_count, a, nexp):
    """Written from the definition, one entry at a time."""
    n, k = topk.shape
    flat = topk.reshape(-1).tolist()
    members = [[i for i, x in enumerate(flat) if x == e] for e in range(e_count)]
    p2e, p2t, p2tk = [-1] * nexp, [-1] * nexp, [-1] * nexp
    ttp = [-1] * (n * k)
    start, end, seg, pos = [], [], [], 0
    for e in range(e_count):
        s = -(-len(members[e]) // a) * a
        start.append(pos)
        for r, i in enumerate(members[e]):
            if pos + r < nexp:
                p2e[pos + r], p2t[pos + r], p2tk[pos + r], ttp[i] = e, i // k, i, pos + r
        pos += s
        end.append(pos)
        seg.append(s)
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return t(p2e), t(p2t), t(p2tk), t(ttp).view(n, k), t(start), t(end), t(seg)


def _cdiv(a, b):
    return -(-a // b)


def _kernel_model(topk, e_count, a, nexp, threads, blocks):
    """The kernel's algorithm step by step (grid, per-warp ranges, match_any ranks), in Python."""
    n, k = topk.shape
    numel, w_per_block = n * k, threads // 32
    nb = min(blocks, _cdiv(numel, threads))
    per_warp = _cdiv(_cdiv(numel, nb * w_per_block), 32) * 32
    flat = topk.reshape(-1).tolist()
    ex = [x if 0 <= x < e_count else -1 for x in flat]
    ranges = [(g * per_warp, min((g + 1) * per_warp, numel)) for g in range(nb * w_per_block)]
    assert ranges[-1][1] == numel or ranges[-1][0] >= numel
    warp_counts = [[sum(1 for i in range(s, t) if ex[i] == e) for e in range(e_count)] for s, t in ranges]
    tot = [sum(c[e] for c in warp_counts) for e in range(e_count)]
    seg = [-(-c // a) * a for c in tot]
    first = [sum(seg[:e]) for e in range(e_count)]
    p2e, p2t, p2tk = [None] * nexp, [None] * nexp, [None] * nexp
    ttp = [None] * numel
    for g, (s, t) in enumerate(ranges):
        base = [first[e] + sum(warp_counts[h][e] for h in range(g)) for e in range(e_count)]
        for c0 in range(s, max(s, t), 32):
            lanes = [ex[i] if i < t else -1 for i in range(c0, c0 + 32)]
            for lane, e in enumerate(lanes):
                i = c0 + lane
                if i >= t:
                    continue
                if e < 0:
                    ttp[i] = -1
                    continue
                p = base[e] + sum(1 for x in lanes[:lane] if x == e)  # popc(match_any & lanes below)
                if p < nexp:
                    assert p2e[p] is None, "two entries at one position"
                    p2e[p], p2t[p], p2tk[p], ttp[i] = e, i // k, i, p
                else:
                    ttp[i] = -1
            for e in set(lanes) - {-1}:
                base[e] += lanes.count(e)
    for e in range(e_count):  # padding, then the tail
        for p in range(first[e] + tot[e], min(first[e] + seg[e], nexp)):
            assert p2e[p] is None
            p2e[p] = p2t[p] = p2tk[p] = -1
    for p in range(sum(seg), nexp):
        p2e[p] = p2t[p] = p2tk[p] = -1
    assert None not in p2e and None not in ttp, "a position or entry left unwritten"
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return t(p2e), t(p2t), t(p2tk), t(ttp).view(n, k), t(first), t([f + s for f, s in zip(first, seg)]), t(seg)


def _equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), i


# -- the spec ----------------------------------------------------------------------------------------

def test_spec_validates(spec):
    validate(spec)
    assert spec.family == "moe" and spec.tolerance.exact
    assert tkjit.get_spec(NAME) is spec
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")
    assert mod.default({"num_experts": 256}) == {"threads": 512, "blocks": 132, "count": "match", "reduce": "unroll",
                                                 "pad": "after"}


@pytest.mark.parametrize("e", [1, 2, 72, 255, 256, 257, 512, 1000, 1024])
def test_default_is_valid_for_any_expert_count(spec, e):
    for k in (1, 6, 16):
        full = spec.canonical_shape(_shape(100, k, e, 64))
        cfg = spec.default_config(full, "sm_90a")
        assert spec.check_config(full, cfg, "sm_90a") == cfg
        assert cfg["threads"] >= e


def test_bad_shapes_and_configs(spec):
    with pytest.raises(ShapeError, match="'num_experts'=1025 above its maximum 1024"):
        spec.canonical_shape(_shape(4, 8, 1025, 1, 64))
    with pytest.raises(ShapeError, match="'alignment'=0 below its minimum"):
        spec.canonical_shape(_shape(4, 8, 16, 0, 64))
    with pytest.raises(ShapeError, match="'num_topk'=0 below its minimum"):
        spec.canonical_shape(_shape(4, 0, 16, 1, 64))
    full = spec.canonical_shape(_shape(8, 8, 512, 64))
    with pytest.raises(ConfigError, match="threads=256 < num_experts=512"):
        spec.check_config(full, {"threads": 256, "blocks": 66, "count": "match", "reduce": "loop", "pad": "after"})
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full), "cpu")
    with pytest.raises(ConfigError, match="not in the space"):
        spec.check_config(full, {"threads": 512, "blocks": 264, "count": "match", "reduce": "loop", "pad": "after"})
    assert all(c["threads"] >= 512 for c in spec.configs(full, "sm_90a"))
    assert len(spec.configs(spec.canonical_shape(_shape(8, 8, 256, 64)), "sm_90a")) == 180  # 15 grids x 2 x 3 x 2


# -- the reference -----------------------------------------------------------------------------------

CASES = [  # (tokens, k, experts, alignment, nexp or None = upper bound)
    (1, 1, 1, 1, None), (37, 8, 16, 4, None), (101, 6, 72, 64, None), (64, 9, 256, 128, None),
    (50, 16, 8, 3, None), (33, 2, 5, 1, None),
    (40, 8, 16, 8, 10_000),  # a larger buffer: the tail holds -1
    (40, 8, 16, 8, 77),  # a buffer too small: positions past it dropped
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_the_definition(spec, case, seed):
    n, k, e, a, nexp = case
    shape = spec.canonical_shape(_shape(n, k, e, a, nexp))
    topk, ws = spec.make_inputs(shape, "cpu", seed)
    ref = spec.reference(shape, topk, ws)
    _equal(ref, _loop_reference(topk, e, a, shape["num_expanded_tokens"]))


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("config", [{"threads": 128, "blocks": 8}, {"threads": 256, "blocks": 132},
                                    {"threads": 1024, "blocks": 33}], ids=str)
def test_kernel_model_matches_the_reference(spec, case, config):
    """The per-warp ranges, ranks and padding the kernel computes give the reference's layout exactly."""
    n, k, e, a, nexp = case
    if config["threads"] < e:
        pytest.skip("threads < num_experts")
    shape = spec.canonical_shape(_shape(n, k, e, a, nexp))
    for seed in (0, 1):
        topk, ws = spec.make_inputs(shape, "cpu", seed)
        _equal(_kernel_model(topk, e, a, shape["num_expanded_tokens"], **config), spec.reference(shape, topk, ws))


def test_reference_edge_cases(spec):
    # All -1 rows: every segment empty, every position padding.
    s = spec.canonical_shape(_shape(5, 4, 8, 16, 32))
    ref = spec.reference(s, torch.full((5, 4), -1, dtype=torch.int64))
    assert all((t == -1).all() for t in ref[:4]) and all((t == 0).all() for t in ref[4:])
    # One expert, duplicates inside a token, out-of-range values treated as -1.
    s = spec.canonical_shape(_shape(3, 3, 1, 4))
    topk = torch.tensor([[0, 0, -1], [5, 0, 1 << 40], [-3, -1, 0]])
    p2e, p2t, p2tk, ttp, start, end, seg = spec.reference(s, topk)
    assert seg.tolist() == [4] and start.tolist() == [0] and end.tolist() == [4]
    assert p2tk.tolist()[:4] == [0, 1, 4, 8] and p2t.tolist()[:4] == [0, 0, 1, 2] and p2e.tolist()[:4] == [0] * 4
    assert ttp.tolist() == [[0, 1, -1], [-1, 2, -1], [-1, -1, 3]]
    assert p2e.numel() == mod.upper_bound(3, 3, 1, 4) == 12 and (p2e[4:] == -1).all()


def test_make_inputs(spec):
    s = spec.canonical_shape(_shape(400, 8, 64, 16))
    a, ws = spec.make_inputs(s, "cpu", 0)
    b, _ = spec.make_inputs(s, "cpu", 1)
    assert a.dtype == torch.int64 and a.shape == (400, 8) and a.is_contiguous()
    assert ws.shape == (mod.WS_ROWS, 64) and ws.dtype == torch.int32
    assert (a == -1).any() and ((a >= 0) & (a < 64)).any() and ((a == -1).all(-1)).any()
    assert not ((a < -1) | (a >= 64)).any()  # even seeds: valid routing only
    assert ((b < -1) | (b >= 64)).any() and (b[:, 0] == b[:, 1]).any()  # odd: out of range, duplicates
    assert torch.equal(a, spec.make_inputs(s, "cpu", 0)[0])


def test_bytes_moved(spec):
    s = _shape(8192, 8, 256, 128)
    assert spec.bytes_moved(s) == 65536 * 20 + s["num_expanded_tokens"] * 12 + 256 * 12


@pytest.mark.slow
def test_compiles_for_sm90a_as_a_cooperative_kernel(cache_dir):
    k = tkjit.get(NAME, _shape(4001, 8, 256, 128), arch="sm_90a")
    src = (k.path / "kernel.cu").read_text()
    assert "cooperative_groups::this_grid().sync()" in src and "__match_any_sync" in src
    # TileLang tags a grid-syncing kernel so TVM's CUDA module launches it with cuLaunchCooperativeKernel.
    assert launches_cooperatively(k.path)
    assert src.count("__syncthreads()") >= 4  # the hand-placed barriers (automatic ones are off)


# -- the op, tkjit.ops and compat (the kernel's launch writes the reference) -----------------------------

@pytest.fixture
def reference_kernel(monkeypatch):
    """get_fused_mapping as a CPU CompiledKernel that writes its reference; the list of its launches."""
    return serve_references(monkeypatch, (NAME,))


def _topk(n=37, k=6, e=72, seed=0):
    s = get_spec(NAME).canonical_shape(_shape(max(1, n), k, e, 1))
    return get_spec(NAME).make_inputs(s, "cpu", seed)[0][:n].contiguous()


def test_op_schema_and_opcheck(reference_kernel):
    op = torch.ops.tkjit.get_fused_mapping.default
    assert "int num_expanded_tokens, int alignment, str? config=None" in str(op._schema)
    for args in [(_topk(), 72, 500, 64), (_topk(5, 2, 4), 4, 3, 1), (_topk(0, 8, 16), 16, 40, 8)]:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), result


def test_fake_shapes_and_compile(reference_kernel):
    from torch._subclasses.fake_tensor import FakeTensorMode

    topk = _topk()
    real = torch.ops.tkjit.get_fused_mapping(topk, 72, 900, 64)
    with FakeTensorMode() as m:
        fake = torch.ops.tkjit.get_fused_mapping(m.from_tensor(topk), 72, 900, 64)
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]
    meta = torch.ops.tkjit.get_fused_mapping(topk.to("meta"), 72, 900, 64)
    assert [t.shape for t in meta] == [t.shape for t in real]

    def f(x):
        return tkjit.ops.get_fused_mapping(x, 72, 900, 64)[:7]

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    _equal(compiled(topk), f(topk))
    _equal(f(topk), real)


def test_ops_sync_path_slices_and_lists(reference_kernel):
    topk = _topk(37, 6, 72)
    *outs, counts = tkjit.ops.get_fused_mapping(topk, 72, 0, 64)
    ref = get_spec(NAME).reference(_shape(37, 6, 72, 64, sum(counts)), topk)
    assert counts == ref[6].tolist() and isinstance(counts[0], int)
    _equal(outs, ref)
    assert outs[0].numel() == sum(counts) == int(outs[5][-1])
    # force_no_sync: the upper bound is not used, nothing is synced: a 0-row buffer drops everything.
    *outs, counts = tkjit.ops.get_fused_mapping(topk, 72, 0, 64, force_no_sync=True)
    assert counts == [] and outs[0].shape == (0,) and (outs[3] == -1).all()
    _equal(outs[4:], ref[4:])
    # A caller-sized buffer: no sync, no list, tail -1.
    *outs, counts = tkjit.ops.get_fused_mapping(topk, 72, 10_000, 64)
    assert counts == [] and outs[0].shape == (10_000,) and (outs[0][sum(ref[6].tolist()):] == -1).all()


def test_ops_zero_tokens(reference_kernel):
    topk = torch.empty((0, 8), dtype=torch.int64)
    *outs, counts = tkjit.ops.get_fused_mapping(topk, 16, 0, 128)
    assert counts == [0] * 16 and all(t.numel() == 0 for t in outs[:4]) and outs[3].shape == (0, 8)
    assert all(t.tolist() == [0] * 16 for t in outs[4:])
    *outs, counts = tkjit.ops.get_fused_mapping(topk, 16, 50, 128)
    assert counts == [] and all((t == -1).all() and t.shape == (50,) for t in outs[:3])
    assert reference_kernel == []  # nothing launched


def test_ops_outputs_share_one_allocation(reference_kernel):
    """tkjit.ops' eager call allocates the workspace and the seven outputs as ONE buffer (one torch.empty a
    call; the host cost of a launch-bound op), each a contiguous view starting on 16 bytes (the kernel's
    alignment); the custom op's outputs keep storages of their own (custom ops may not return aliases)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    for n, k, e, nexp, a in [(37, 6, 72, 1001, 64), (5, 3, 5, 7, 1), (64, 8, 256, 8 + 256 * 127, 128)]:
        topk = _topk(n, k, e)
        ref = get_spec(NAME).reference(_shape(n, k, e, a, nexp), topk)
        for _ in range(2):  # the checked first call, then the planned one
            with Allocs() as m:
                *outs, _ = tkjit.ops.get_fused_mapping(topk, e, nexp, a)
            # (the reference the launch writes makes its own tensors with torch.full)
            assert m.ops.count("empty") == 1 and not {"zeros", "zero_", "fill_"} & set(m.ops), m.ops
            _equal(outs, ref)
            assert len({t.untyped_storage().data_ptr() for t in outs}) == 1
            assert all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in outs)
        separate = torch.ops.tkjit.get_fused_mapping(topk, e, nexp, a)
        _equal(separate, ref)
        assert len({t.untyped_storage().data_ptr() for t in separate}) == 7
        assert all(t.is_contiguous() and t.storage_offset() == 0 for t in separate)


def test_too_small_buffer_drops_or_raises(reference_kernel, monkeypatch):
    topk = _topk(37, 6, 8)
    *outs, _ = tkjit.ops.get_fused_mapping(topk, 8, 20, 4)
    need = int(outs[5][-1])
    assert need > 20 and outs[0].shape == (20,)
    assert ((outs[3] >= 0) & (outs[3] < 20) | (outs[3] == -1)).all()
    monkeypatch.setenv("TKJIT_CHECK_INDICES", "1")
    with pytest.raises(ShapeError, match=f"the layout needs {need} rows but num_expanded_tokens is 20"):
        tkjit.ops.get_fused_mapping(topk, 8, 20, 4)
    bad = topk.clone()
    bad[0, 0] = 8
    with pytest.raises(TensorError, match=r"topk_idx\[0, 0\] = 8 is out of range \[-1, 8\)"):
        tkjit.ops.get_fused_mapping(bad, 8, 0, 4)


def test_compat_argument_errors(reference_kernel):
    import tkjit.compat.tile_kernels as tk

    f = tk.moe.get_fused_mapping
    topk = _topk(10, 4, 16)
    out = f(topk, 16, 0, 8)
    assert len(out) == 8 and isinstance(out[7], list) and out[0].dtype == torch.int32
    with pytest.raises(TensorError, match="topk_idx must be torch.int64"):
        f(topk.int(), 16, 0, 8)
    with pytest.raises(TensorError, match="topk_idx must be 2-D"):
        f(topk.view(-1), 16, 0, 8)
    with pytest.raises(TensorError, match="topk_idx must be contiguous"):
        f(topk.t(), 16, 0, 8)
    with pytest.raises(ShapeError, match="alignment >= 1"):
        f(topk, 16, 0, 0)
    with pytest.raises(ShapeError, match="num_expanded_tokens >= 0"):
        f(topk, 16, -1, 8)
    with pytest.raises(ShapeError, match="num_experts must be an int"):
        f(topk, 16.0, 0, 8)
    with pytest.raises(NotImplementedError, match="num_experts=2000"):
        f(topk, 2000, 0, 8)
