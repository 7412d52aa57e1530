"""inplace_unique_group_indices on a CPU host: the spec, its reference against TileKernels' sort-based
formulation (written out here) and a per-row Python model, both algorithms and the persistent grid on
TileLang's C target (in place, out-of-range ids left alone), an sm_90a cross-compile, the torch op
(mutating, returns None) and the TileKernels compat entry."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.testing import check

pytestmark = pytest.mark.usefixtures("module_cache")
NAME = "inplace_unique_group_indices"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def spec():
    return tkjit.get_spec(NAME)


def model(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Row by row: an id in [0, num_groups) seen before in its row becomes -1; others stay."""
    out = x.clone()
    for r, row in enumerate(x.tolist()):
        seen = set()
        for j, v in enumerate(row):
            if 0 <= v < num_groups:
                if v in seen:
                    out[r, j] = -1
                seen.add(v)
    return out


def sort_based(x: torch.Tensor) -> torch.Tensor:
    """TileKernels' reference formulation: a stable sort, repeats in sorted order mapped back."""
    vals, idx = torch.sort(x, dim=1, stable=True)
    dup = torch.zeros_like(x, dtype=torch.bool)
    dup[:, 1:] = vals[:, 1:] == vals[:, :-1]
    out = x.clone()
    out[torch.zeros_like(dup).scatter_(1, idx, dup)] = -1
    return out


def test_registered_and_valid():
    s = spec()
    assert s.family == "moe" and s.tolerance.exact
    assert [a.name for a in s.inputs] == ["group_indices"] and s.inputs[0].inout and not s.outputs
    for ex in s.examples:
        full = s.canonical_shape(ex)
        assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
        assert s.default_config(full, "cpu") in s.configs(full, "cpu")
    full = s.canonical_shape({"num_tokens": 8192, "num_topk": 8, "num_groups": 8})
    assert s.default_config(full)["algo"] == "compare" and len(s.configs(full)) > 50
    for k in (1, 2, 6, 8, 9, 16, 17, 32, 33, 64):
        for groups in (1, 8, 64, 72, 128, 256, 257, 1 << 16):
            f = {"num_tokens": 7, "num_topk": k, "num_groups": groups}
            if s.check_shape(f):
                continue
            f = s.canonical_shape(f)
            assert s.constraint(f, s.default_config(f)) is None, (k, groups)


@pytest.mark.parametrize("shape, match", [
    ({"num_tokens": 8, "num_topk": 0}, "num_topk"),
    ({"num_tokens": 8, "num_topk": 65}, "num_topk"),
    ({"num_tokens": 8, "num_topk": 8, "num_groups": 0}, "num_groups"),
    ({"num_tokens": 8, "num_topk": 8, "num_groups": (1 << 16) + 1}, "num_groups"),
    ({"num_tokens": 8, "num_topk": 33, "num_groups": 300}, "num_topk=33 > 32 needs num_groups <= 256"),
    ({"num_tokens": 0, "num_topk": 8}, "num_tokens"),
])
def test_bad_shapes(shape, match):
    with pytest.raises(ShapeError, match=match):
        spec().canonical_shape(shape)


def test_bad_configs():
    s = spec()
    full = s.canonical_shape({"num_tokens": 8, "num_topk": 9, "num_groups": 300})
    good = s.default_config(full)
    assert good["algo"] == "compare"
    with pytest.raises(ConfigError, match="bitmask takes num_groups <= 256"):
        s.check_config(full, {**good, "algo": "bitmask"})
    with pytest.raises(ConfigError, match="multiple of 2"):
        s.check_config(full, {**good, "vec": 2})
    big = s.canonical_shape({"num_tokens": 8, "num_topk": 40, "num_groups": 8})
    with pytest.raises(ConfigError, match="compare takes num_topk <= 32"):
        s.check_config(big, {**s.default_config(big), "algo": "compare"})


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("k, groups", [(8, 8), (6, 72), (9, 128), (2, 3), (1, 4)])
def test_reference(seed, k, groups):
    s = spec()
    full = s.canonical_shape({"num_tokens": 300, "num_topk": k, "num_groups": groups})
    (x,) = s.make_inputs(full, seed=seed)
    ref = s.reference(full, x)
    assert torch.equal(ref, model(x, groups))
    in_range = bool(((x == -1) | ((x >= 0) & (x < groups))).all())
    assert in_range == (seed % 2 == 0)
    if in_range:  # TileKernels' own reference where its kernel is defined
        assert torch.equal(ref, sort_based(x))
    if k > 1:
        assert bool((ref != x).any())  # the inputs do repeat ids


def test_reference_hand_checked():
    x = torch.tensor([[3, 3, -1, 5, 3, -1, 5, 0], [-2, -2, 8, 8, 9, 1, 1, 1]])
    assert spec().reference({"num_groups": 8}, x).tolist() == [
        [3, -1, -1, 5, -1, -1, -1, 0], [-2, -2, 8, 8, 9, 1, -1, -1]]


@pytest.mark.parametrize("k, groups", [(8, 8), (9, 128), (6, 72), (1, 4), (33, 200)])
def test_c_target_every_algorithm_and_grid(k, groups):
    s = spec()
    full = s.canonical_shape({"num_tokens": 100, "num_topk": k, "num_groups": groups})
    d = s.default_config(full, "cpu")
    configs = [d] + [c for c in s.configs(full, "cpu") if c["threads"] == 64 and c["block_rows"] == 128
                     and c["grid"] in (0, 264) and c["vec"] == d["vec"]]
    assert {c["algo"] for c in configs} == ({"bitmask"} if k > 32 else {"bitmask", "compare"})
    for cfg in configs:
        kern = tkjit.get(NAME, full, arch="cpu", config=cfg)
        for t in (1, 7, 4001):
            for seed in (0, 1):
                assert check(kern, {**full, "num_tokens": t}, device="cpu", seed=seed) is None, (cfg, t, seed)
        x = s.make_inputs({**full, "num_tokens": 77}, seed=5)[0]
        want = model(x, groups)
        assert kern(x) is x and torch.equal(x, want)  # in place, the same tensor back
        assert kern(x) is x and torch.equal(x, want)  # idempotent
        empty = torch.empty(0, k, dtype=torch.int64)
        assert kern(empty) is empty


def test_check_sees_a_wrong_in_place_result(monkeypatch):
    """The harness compares the in-place tensor: a kernel that leaves it alone fails the check."""
    s = spec()
    full = s.canonical_shape({"num_tokens": 50, "num_topk": 8, "num_groups": 8})
    kern = tkjit.get(NAME, full, arch="cpu")
    monkeypatch.setattr(kern, "_launch", lambda *a: None)
    assert "group_indices" in check(kern, full, device="cpu", seed=0)


def test_cross_compiles_for_sm90a():
    kern = tkjit.get(NAME, {"num_tokens": 8192, "num_topk": 8, "num_groups": 72}, arch="sm_90a",
                     config={"algo": "bitmask", "block_rows": 256, "threads": 128, "vec": 2, "grid": 264})
    src = (kern.path / "kernel.cu").read_text()
    assert "longlong2" in src and "seen[2]" in src  # 16-byte loads, two bitmask words for 72 groups


# -- torch op ----------------------------------------------------------------------------------------

def test_op_opcheck_fake_and_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.inplace_unique_group_indices.default
    assert "(Tensor(a!) group_indices, int num_groups, str? config=None) -> ()" in str(op._schema)
    for t in (37, 0):
        x = torch.randint(-1, 8, (t, 8))
        assert torch.library.opcheck(op, (x, 8), test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode():
        assert op(torch.empty(13, 6, dtype=torch.int64), 8) is None
    with pytest.raises(TensorError, match="dtype"):
        op(torch.empty(5, 8, dtype=torch.int32, device="meta"), 8)
    with pytest.raises(ShapeError, match="num_groups"):
        op(torch.empty(5, 8, dtype=torch.int64, device="meta"), 0)


def test_op_eager_and_compiled_mutate_in_place():
    x = torch.randint(-1, 8, (333, 8))
    want = model(x, 8)
    y = x.clone()
    assert tkjit.ops.inplace_unique_group_indices(y, 8) is None and torch.equal(y, want)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(g):
        tkjit.ops.inplace_unique_group_indices(g, 8)
        return g + 0

    y = x.clone()
    assert torch.equal(f(y), want) and torch.equal(y, want)


def test_check_indices_flag(monkeypatch):
    monkeypatch.setenv("TKJIT_CHECK_INDICES", "1")
    with pytest.raises(TensorError, match=r"group_indices\[0, 1\] = 8 is out of range \[-1, 8\)"):
        tkjit.ops.inplace_unique_group_indices(torch.tensor([[0, 8]]), 8)


# -- compat ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k, groups", [(2, 8), (6, 72), (8, 8), (9, 128), (8, 1)])
def test_compat_matches_tile_kernels_reference(k, groups):
    x = torch.randint(-1, groups, (4001, k))
    want = sort_based(x)
    assert tk.moe.inplace_unique_group_indices(x, groups) is None
    assert torch.equal(x, want)
    assert tk.moe.inplace_unique_group_indices(torch.empty(0, k, dtype=torch.int64), groups) is None


def test_compat_unaligned_view_is_updated_in_place():
    buf = torch.randint(-1, 8, (33 * 8 + 1,))
    x = buf[1:].view(33, 8)  # 8 bytes past the buffer's start: off the kernel's 16-byte accesses
    want = sort_based(x)
    tk.moe.inplace_unique_group_indices(x, 8)
    assert torch.equal(x, want) and torch.equal(buf[1:].view(33, 8), want)


@pytest.mark.parametrize("args, err, match", [
    ((torch.zeros(4, 8, dtype=torch.int32), 8), TensorError, "group_indices must be torch.int64"),
    ((torch.zeros(4, dtype=torch.int64), 8), TensorError, "group_indices must be 2-D"),
    ((torch.zeros(8, 4, dtype=torch.int64).t(), 8), TensorError, "group_indices must be contiguous"),
    ((torch.zeros(4, 8, dtype=torch.int64), 129), ShapeError, r"num_groups \(129\) must be in \[1, 128\]"),
    ((torch.zeros(4, 8, dtype=torch.int64), 0), ShapeError, "num_groups"),
    ((torch.zeros(4, 8, dtype=torch.int64), 8.0), ShapeError, "num_groups must be an int"),
])
def test_compat_argument_errors(args, err, match):
    with pytest.raises(err, match=match) as e:
        tk.moe.inplace_unique_group_indices(*args)
    assert str(e.value).startswith("tile_kernels.moe.inplace_unique_group_indices: ")


def test_compat_too_many_ids_per_token_is_not_implemented():
    with pytest.raises(NotImplementedError, match="num_topk"):
        tk.moe.inplace_unique_group_indices(torch.zeros(4, 65, dtype=torch.int64), 8)
