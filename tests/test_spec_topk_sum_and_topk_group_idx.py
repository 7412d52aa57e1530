"""topk_sum_and_topk_group_idx spec on the CPU: shapes, configs, reference semantics, C-target runs
(layout=thread), an sm_90a cross-compile (layout=lanes), the torch op and the compat entry point."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat.tile_kernels import moe as tk_moe
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.spec import validate
from tkjit.testing import check

NAME = "topk_sum_and_topk_group_idx"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(scope="module", autouse=True)
def shared_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TKJIT_CACHE_DIR", str(tmp_path_factory.mktemp("topk-sum-cache")))
        tkjit.reset()
        yield
    tkjit.reset()


def _shape(g=8, epg=32, ks=2, kg=4, n=4001):
    return {"num_tokens": n, "num_groups": g, "num_experts_per_group": epg, "num_topk_sum": ks, "num_topk_groups": kg}


def test_spec_validates():
    spec = get_spec(NAME)
    validate(spec)
    assert spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a")["layout"] == "lanes"
        assert spec.default_config(full, "cpu")["layout"] == "thread"
    assert spec.default_config(spec.canonical_shape(_shape(epg=9)))["vec"] == 1
    assert spec.default_config(spec.canonical_shape(_shape(epg=6)))["vec"] == 2


def test_bad_shapes_and_configs():
    spec = get_spec(NAME)
    with pytest.raises(ShapeError, match="num_topk_sum=2 must be <= num_experts_per_group=1"):
        spec.canonical_shape(_shape(epg=1))
    with pytest.raises(ShapeError, match="num_topk_groups=9 must be <= num_groups=8"):
        spec.canonical_shape(_shape(kg=9))
    with pytest.raises(ShapeError, match="'num_groups'=33 above its maximum 32"):
        spec.canonical_shape(_shape(g=33))
    with pytest.raises(ShapeError, match="'num_topk_sum'=3 above its maximum 2"):
        spec.canonical_shape(_shape(ks=3))
    full = spec.canonical_shape(_shape(epg=9))
    with pytest.raises(ConfigError, match="vec=4 loads need num_experts_per_group=9"):
        spec.check_config(full, {"layout": "lanes", "threads": 128, "vec": 4})
    with pytest.raises(ConfigError, match="warp shuffles"):
        spec.check_config(full, {"layout": "lanes", "threads": 128, "vec": 1}, "cpu")


def _independent(x, ks, kg):
    """A Python-loop model: per group the sum of its ks largest, then a stable descending sort."""
    out = []
    for row in x.tolist():
        sums = []
        for grp in row:
            top = sorted(grp, reverse=True)[:ks]
            s = torch.tensor(top[0], dtype=torch.float32)
            if ks == 2:
                s = s + torch.tensor(top[1], dtype=torch.float32)
            sums.append(float(s))
        order = sorted(range(len(sums)), key=lambda g: (-sums[g], g))
        out.append(order[:kg])
    return out


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("g,epg,ks,kg", [(8, 32, 2, 4), (8, 9, 1, 8), (12, 6, 2, 2), (3, 1, 1, 3)])
def test_reference_against_an_independent_model(seed, g, epg, ks, kg):
    spec = get_spec(NAME)
    shape = spec.canonical_shape(_shape(g, epg, ks, kg, n=64))
    (x,) = spec.make_inputs(shape, "cpu", seed)
    assert spec.reference(shape, x).tolist() == _independent(x, ks, kg)


def test_reference_ties_and_signed_zeros():
    spec = get_spec(NAME)
    x = torch.tensor([[[1.0, 1.0], [2.0, 0.0], [0.5, 1.5], [-0.0, 0.0]]])
    # top-2 sums: 2, 2, 2, 0 -> ties to the smaller group; top-1: 1, 2, 1.5, 0
    assert spec.reference(_shape(4, 2, 2, 4, 1), x).tolist() == [[0, 1, 2, 3]]
    assert spec.reference(_shape(4, 2, 1, 4, 1), x).tolist() == [[1, 2, 0, 3]]
    x = torch.tensor([[[float("-inf"), 3.0], [float("-inf"), float("-inf")], [-0.0, 0.0]]])
    assert spec.reference(_shape(3, 2, 2, 3, 1), x).tolist() == [[2, 0, 1]]


def test_make_inputs_have_ties_on_odd_seeds():
    spec = get_spec(NAME)
    shape = spec.canonical_shape(_shape(n=256))
    (a,) = spec.make_inputs(shape, "cpu", 0)
    (b,) = spec.make_inputs(shape, "cpu", 1)
    assert a.shape == (256, 8, 32) and a.dtype == torch.float32
    assert a.unique().numel() > 0.99 * a.numel() and b.unique().numel() < 100
    assert torch.isinf(b).any() and (torch.signbit(b) & (b == 0)).any()


@pytest.mark.parametrize("g,epg,ks,kg", [(8, 32, 2, 4), (8, 9, 1, 8), (12, 6, 2, 2), (1, 3, 2, 1), (32, 2, 2, 5)])
def test_c_target_runs(g, epg, ks, kg):
    kern = tkjit.get(NAME, _shape(g, epg, ks, kg, n=100), arch="cpu")
    for n in (1, 7, 4001):
        for seed in (0, 1):
            assert check(kern, _shape(g, epg, ks, kg, n=n), device="cpu", seed=seed) is None


@pytest.mark.slow
def test_compiles_for_sm90a():
    kern = tkjit.get(NAME, _shape(12, 6, 2, 4), arch="sm_90a", config={"layout": "lanes", "threads": 128, "vec": 2})
    src = (kern.path / "kernel.cu").read_text()
    assert "__shfl_sync" in src and "float2" in src


# -- torch op and compat ---------------------------------------------------------------------------

def _scores(n=37, g=8, epg=16, seed=0):
    return torch.randn(n, g, epg, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tokens", [0, 37])
def test_opcheck_and_fake(tokens):
    from torch._subclasses.fake_tensor import FakeTensorMode

    f = torch.ops.tkjit.topk_sum_and_topk_group_idx.default
    x = _scores(tokens)
    result = torch.library.opcheck(f, (x, 2, 4), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result
    real = f(x, 2, 4)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = f(mode.from_tensor(x), 2, 4)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


def test_ops_compile_and_compat_match_the_reference():
    x = _scores()
    want = get_spec(NAME).reference(_shape(8, 16, 2, 4, 37), x)
    assert torch.equal(tkjit.ops.topk_sum_and_topk_group_idx(x, 2, 4), want)
    assert torch.equal(tk_moe.topk_sum_and_topk_group_idx(x, 2, 4), want)
    got = torch.compile(lambda s: tkjit.ops.topk_sum_and_topk_group_idx(s, 2, 4), fullgraph=True)(x)
    assert torch.equal(got, want)
    out = tk_moe.topk_sum_and_topk_group_idx(x[:0], 1, 3)
    assert out.shape == (0, 3) and out.dtype == torch.int64


def test_compat_argument_errors():
    x = _scores()
    fn = tk_moe.topk_sum_and_topk_group_idx
    with pytest.raises(TensorError, match="scores must be 3-D"):
        fn(x[0], 2, 4)
    with pytest.raises(TensorError, match="scores must be torch.float32"):
        fn(x.double(), 2, 4)
    with pytest.raises(TensorError, match="scores must be contiguous"):
        fn(x.transpose(1, 2), 2, 4)
    with pytest.raises(ShapeError, match=r"num_topk_sum \(3\) must be 1 or 2"):
        fn(x, 3, 4)
    with pytest.raises(ShapeError, match=r"num_topk_groups \(9\) must be in \[1, num_groups"):
        fn(x, 2, 9)
    with pytest.raises(ShapeError, match=r"num_groups \(scores.shape\[1\] = 33\) must be <= 32"):
        fn(torch.randn(2, 33, 2), 2, 4)
    with pytest.raises(ShapeError, match="num_topk_sum must be an int"):
        fn(x, 2.0, 4)
