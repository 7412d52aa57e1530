"""top2_sum_gate spec on the CPU: shapes, configs, the reference against an independent model and against
TileKernels' torch reference semantics, C-target runs (layout=thread), an sm_90a cross-compile (layout=warp),
the torch op and the compat entry point."""

import pytest
import torch
import torch.nn.functional as F

import tkjit
import tkjit.ops
from tkjit.compat.tile_kernels import moe as tk_moe
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.registry import get_spec
from tkjit.spec import validate
from tkjit.testing import reference_outputs, run_against_reference

NAME = "top2_sum_gate"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
THREAD = {"layout": "thread", "threads": 32, "tokens_per_warp": 1, "reduce": "shfl"}


@pytest.fixture(scope="module", autouse=True)
def shared_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TKJIT_CACHE_DIR", str(tmp_path_factory.mktemp("top2-sum-gate-cache")))
        tkjit.reset()
        yield
    tkjit.reset()


def _shape(e=256, k=8, g=8, kg=4, n=64, s=0, f="sigmoid", has_map=False, d=1, has_mask=False, has_fix=False,
           has_unmapped=False):
    return {"num_tokens": n, "num_experts": e, "num_topk": k, "num_groups": g, "num_topk_groups": kg,
            "num_shared_experts": s, "scoring_func": f, "has_map": has_map, "num_duplicates": d,
            "has_mask": has_mask, "has_fix": has_fix, "has_unmapped": has_unmapped}


def test_spec_validates():
    spec = get_spec(NAME)
    validate(spec)
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a")["layout"] == "warp"
        assert spec.default_config(full, "cpu")["layout"] == "thread"
    full = spec.canonical_shape(_shape())
    assert len(spec.configs(full, "sm_90a")) == 28 and len(spec.configs(full, "cpu")) == 4


def test_bad_shapes_and_configs():
    spec = get_spec(NAME)
    for kw, msg in [({"e": 70}, "multiple of 4"), ({"k": 30, "s": 3}, "'num_shared_experts'=3 above"),
                    ({"k": 31, "s": 2}, "must be <= 32"), ({"g": 8, "kg": 0}, "both zero or both non-zero"),
                    ({"kg": 9}, "num_topk_groups=9 must be <= num_groups=8"),
                    ({"e": 100, "g": 8}, "divisible by num_groups=8"), ({"e": 32, "g": 32, "kg": 4}, ">= 2 experts"),
                    ({"e": 64, "g": 8, "kg": 1, "k": 9}, "num_topk=9 must be <= num_topk_groups"),
                    ({"f": "identity"}, "scoring_func"),
                    ({"has_fix": True}, r"has_fix \(fix_routing_mask\) needs has_unmapped \(unmapped_topk_idx\)")]:
        with pytest.raises(ShapeError, match=msg):
            spec.canonical_shape(_shape(**kw))
    full = spec.canonical_shape(_shape())
    with pytest.raises(ConfigError, match="warp shuffles"):
        spec.check_config(full, {"layout": "warp", "threads": 128, "tokens_per_warp": 1, "reduce": "shfl"}, "cpu")
    with pytest.raises(ConfigError, match="layout=thread has no warps"):
        spec.check_config(full, {"layout": "thread", "threads": 128, "tokens_per_warp": 2, "reduce": "shfl"})


# -- the reference ---------------------------------------------------------------------------------

def _independent(shape, logits, bias, rsf, per_gpu, tp_rank, num_tp_ranks, physical=None):
    """A Python-loop model of the semantics (sigmoid only: its float ops are elementwise)."""
    e, k, g, kg = shape["num_experts"], shape["num_topk"], shape["num_groups"], shape["num_topk_groups"]
    f32 = torch.float32
    out_idx, out_w = [], []
    for t, (row_x) in enumerate(logits):
        sc = [torch.div(torch.tensor(1.0, dtype=f32), 1.0 + torch.exp(-row_x[i])) for i in range(e)]
        key = [float(sc[i] + bias[i]) for i in range(e)]
        allowed = set(range(e))
        if g != kg:
            epg = e // g
            sums = []
            for gi in range(g):
                top = sorted(key[gi * epg:(gi + 1) * epg], reverse=True)[:2]
                sums.append(float(torch.tensor(top[0], dtype=f32) + torch.tensor(top[1], dtype=f32)))
            keep = sorted(range(g), key=lambda q: (-sums[q], q))[:kg]
            allowed = {i for i in range(e) if i // epg in keep}
        chosen = sorted(allowed, key=lambda i: (-key[i], i))[:k]
        tot = torch.tensor(1e-20, dtype=f32)
        for i in chosen:
            tot = tot + sc[i]
        ws = [float(sc[i] / tot * torch.tensor(rsf, dtype=f32)) for i in chosen]
        ids = list(chosen) + [e + j for j in range(shape["num_shared_experts"])]
        ws += [1.0] * shape["num_shared_experts"]
        if physical is not None:
            ids = [physical(t, i) for i in ids]
        res = []
        for i in ids:
            gpu = i // per_gpu
            res.append(-1 if i < 0 or gpu % num_tp_ranks != tp_rank else (gpu // num_tp_ranks) * per_gpu + i % per_gpu)
        out_idx.append(res)
        out_w.append(ws)
    return torch.tensor(out_idx, dtype=torch.int64), torch.tensor(out_w, dtype=f32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("e,k,g,kg", [(256, 8, 8, 4), (72, 6, 0, 0), (64, 4, 4, 4), (48, 5, 6, 2)])
def test_reference_against_an_independent_model(seed, e, k, g, kg):
    spec = get_spec(NAME)
    shape = spec.canonical_shape(_shape(e, k, g, kg, n=24))
    logits, bias, rsf, _ep, per_gpu, tp, tps = spec.make_inputs(shape, "cpu", seed)
    idx, w = spec.reference(shape, logits, bias, rsf, _ep, per_gpu, tp, tps)
    want_idx, want_w = _independent(shape, logits, bias, rsf, per_gpu, tp, tps)
    assert torch.equal(idx, want_idx)
    assert torch.equal(w, want_w)


def test_reference_with_the_map_against_an_independent_model():
    spec = get_spec(NAME)
    shape = spec.canonical_shape(_shape(64, 4, 4, 2, n=24, s=2, has_map=True, d=3))
    logits, bias, pmap, cnt, rsf, ep, per_gpu, tp, tps = spec.make_inputs(shape, "cpu", 1)
    assert ((cnt < 1) | (cnt > 3)).any()  # odd seeds: counts outside [1, d] give -1

    def physical(t, i):
        c = int(cnt[i])
        return int(pmap[i, (ep + t * 23333) % c]) if 1 <= c <= 3 else -1

    idx, w = spec.reference(shape, logits, bias, pmap, cnt, rsf, ep, per_gpu, tp, tps)
    want_idx, want_w = _independent(shape, logits, bias, rsf, per_gpu, tp, tps, physical)
    assert torch.equal(idx, want_idx) and torch.equal(w, want_w)


def _tk_reference(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
                  routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
                  fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None):
    """TileKernels' torch reference `tile_kernels.torch.top2_sum_gate`, step by step, unmapped_topk_idx updated
    in place as there; rows are independent, so routing every token and then clearing the masked rows is the
    same."""
    n, e = logits.shape
    s = num_shared_experts if use_shared_as_routed else 0
    if scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    elif scoring_func == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    else:
        scores = torch.softmax(logits, dim=-1)
    biased = (logits + bias) if scoring_func == "softmax" else (scores + bias)
    if num_groups != num_topk_groups:
        per = e // num_groups
        sums = biased.view(n, num_groups, per).topk(2, dim=-1, sorted=False).values.sum(-1)
        top = torch.sort(sums, dim=1, descending=True, stable=True).indices[:, :num_topk_groups]
        gmask = torch.ones(n, num_groups, dtype=torch.bool).scatter_(1, top, False)
        biased = biased.masked_fill(gmask.unsqueeze(-1).expand(-1, num_groups, per).reshape(n, e), float("-inf"))
    sel = torch.sort(biased, dim=1, descending=True, stable=True).indices[:, :num_topk]
    if fix_routing_mask is not None:  # fixed rows: the stored indices, their scores at index.clamp(min=0)
        sel = torch.where(fix_routing_mask.unsqueeze(1), unmapped_topk_idx, sel)
    if unmapped_topk_idx is not None:
        unmapped_topk_idx.copy_(sel if mask is None else torch.where(mask.unsqueeze(1), sel, -1))
    sc = scores.gather(1, sel.clamp(min=0))
    w = sc / sc.sum(dim=-1, keepdim=True).clamp(min=1e-20) * routed_scaling_factor
    idx = sel.clone()
    if s:
        idx = torch.cat([idx, torch.arange(e, e + s).expand(n, -1)], dim=1)
        w = torch.cat([w, torch.ones(n, s)], dim=1)
    if to_physical_map is not None:
        for lane in range(idx.shape[1]):
            logical = idx[:, lane]
            dup = (ep_rank + torch.arange(n) * 23333) % logical_count[logical].long()
            idx[:, lane] = to_physical_map[logical, dup].long()
    extra = to_physical_map.shape[1] - 1 if to_physical_map is not None else 0
    per_rank = (e + extra) // num_ep_ranks
    per_dp = per_rank * num_tp_ranks
    valid = idx >= 0
    ep_of = torch.where(valid, idx // per_rank, 0)
    idx = torch.where(valid & (ep_of % num_tp_ranks != tp_rank), -1, idx)
    valid = idx >= 0
    local = idx - tp_rank * per_rank
    dp = torch.where(valid, local // per_dp, 0)
    remapped = local - dp * (per_dp - per_rank)
    idx = torch.where(valid & (remapped >= 0), remapped, torch.where(valid, -1, idx))
    if mask is not None:
        idx[~mask] = -1
        w[~mask] = 0.0
    return idx, w


@pytest.mark.parametrize("f", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("e,k,g,kg,s,d", [(256, 8, 8, 4, 0, 1), (72, 6, 0, 0, 0, 1), (256, 8, 8, 4, 1, 9),
                                          (64, 8, 8, 8, 2, 4)])
def test_reference_matches_tile_kernels_semantics(f, e, k, g, kg, s, d):
    """Indices exact; weights equal up to the order of float sums (torch's softmax and topk-sum reductions
    are device-specific; ours follow TileKernels' kernel)."""
    spec = get_spec(NAME)
    has_map = s > 0
    shape = spec.canonical_shape(_shape(e, k, g, kg, n=200, s=s, f=f, has_map=has_map, d=d))
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(200, e, generator=gen) * 2
    bias = torch.randn(e, generator=gen) * 0.1
    maps = ()
    if has_map:
        maps = (torch.randint(0, e + d - 1, (e + s, d), generator=gen, dtype=torch.int32),
                torch.randint(1, d + 1, (e + s,), generator=gen, dtype=torch.int32))
    num_ep, tp, tps = 8, 1, 2
    per_gpu = (e + d - 1) // num_ep
    idx, w = spec.reference(shape, logits, bias, *maps, 2.5, 3, per_gpu, tp, tps)
    want_idx, want_w = _tk_reference(logits, bias, k, kg, g, s > 0, s, 2.5, 3, num_ep, tp, tps, f,
                                     **(dict(to_physical_map=maps[0], logical_count=maps[1]) if maps else {}))
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)


def test_reference_edge_cases():
    """Ties between groups go to the smaller group, ties between experts to the smaller expert; the bias
    steers selection only; shared experts and the TP remap."""
    spec = get_spec(NAME)
    shape = spec.canonical_shape(_shape(8, 2, 4, 2, n=1))
    # Keys per group (sigmoid(0) = 0.5 plus bias): groups 1 and 2 tie on their top-2 sums, group 3 is best.
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.0, 0.25, 0.5, 0.5])
    idx, w = spec.reference(shape, logits, bias, 1.0, 0, 8, 0, 1)
    assert idx.tolist() == [[6, 7]] and w.tolist() == [[0.5, 0.5]]
    bias = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.0, 0.25, 0.0, 0.0])
    idx, _ = spec.reference(shape, logits, bias, 1.0, 0, 8, 0, 1)
    assert idx.tolist() == [[2, 5]]  # groups 1, 2 kept (tie: both), then the two 0.75 keys
    idx, _ = spec.reference(spec.canonical_shape(_shape(8, 2, 4, 1, n=1)), logits, bias, 1.0, 0, 8, 0, 1)
    assert idx.tolist() == [[2, 3]]  # one group: group 1 (ties with group 2), its two experts
    # TP remap: 2 experts per GPU, 2 TP ranks: rank 1 keeps experts of GPUs 1, 3, ...
    shape = spec.canonical_shape(_shape(32, 4, 0, 0, n=1))
    logits = torch.arange(32.0).flip(0).unsqueeze(0) / 8  # best: 0, 1, 2, 3
    idx, _ = spec.reference(shape, logits, torch.zeros(32), 1.0, 0, 2, 1, 2)
    assert idx.tolist() == [[-1, -1, 0, 1]]  # 0, 1 on GPU 0 (TP rank 0); 2, 3 on GPU 1 -> local 0, 1


def test_make_inputs_have_ties_on_odd_seeds():
    spec = get_spec(NAME)
    shape = spec.canonical_shape(_shape(n=256))
    a = spec.make_inputs(shape, "cpu", 0)[0]
    b = spec.make_inputs(shape, "cpu", 1)[0]
    assert a.shape == (256, 256) and a.dtype == torch.float32
    assert a.unique().numel() > 0.99 * a.numel() and b.unique().numel() < 100
    assert (torch.signbit(b) & (b == 0)).any()


def _named(spec, full, inputs) -> tuple[dict, tuple]:
    """make_inputs' tensors by name (the present inputs), and the scalars after them."""
    names = [a.name for a in spec.inputs if a.present(full)]
    return dict(zip(names, inputs)), tuple(inputs[len(names):])


def _assert_exact(kern, shape, seed):
    """On the C target the reference's float ops are the kernel's: indices bit-exact (the spec's tolerance allows
    ulps for torch's CUDA exp on the GPU). With has_unmapped, unmapped_topk_idx too, written through its view.
    Weights to 1e-6: torch's CPU exp (vectorised, its code path chosen by the host CPU's instruction set) and
    the C library's expf can differ in the last bit; on one CI host they did, in a few weights."""
    spec = kern.spec
    full = spec.canonical_shape(shape)
    inputs = spec.make_inputs(full, device="cpu", seed=seed)
    refs = reference_outputs(spec, full, inputs)
    (idx, w), _ = run_against_reference(kern, full, inputs, device="cpu")  # (poisoned outputs: all written)
    assert torch.equal(idx, refs[-2]), (shape, seed)
    torch.testing.assert_close(w, refs[-1], rtol=1e-6, atol=0)
    if full["has_unmapped"]:
        view = _named(spec, full, inputs)[0]["unmapped_topk_idx"]
        wide = view._base.clone()
        got = kern(*inputs)
        assert got[0] is view and torch.equal(view, refs[0]), (shape, seed)
        k = full["num_topk"]
        assert torch.equal(view._base[:, [0, k + 1, k + 2]], wide[:, [0, k + 1, k + 2]])  # (around the view)


# -- C target --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(e=72, k=6, g=0, kg=0, has_mask=True), dict(e=64, k=8, g=8, kg=8),
                                dict(e=64, k=4, g=4, kg=2, s=2, has_map=True, d=3, has_mask=True)])
def test_c_target_runs_sigmoid_exact(kw):
    kern = tkjit.get(NAME, _shape(n=100, **kw), arch="cpu")
    assert kern.config["layout"] == "thread"
    for n in (1, 7, 301):
        for seed in (0, 1):
            _assert_exact(kern, _shape(n=n, **kw), seed)


@pytest.mark.parametrize("f", ["softmax", "sqrtsoftplus"])
def test_c_target_runs_other_scoring(f):
    """The C library's expf/log1pf and torch's CPU kernels may differ in the last bit: indices exact where
    keys are distinct (even seeds), weights to 1e-6 (bit-exact on the GPU, where both use CUDA's expf)."""
    spec = get_spec(NAME)
    kern = tkjit.get(NAME, _shape(e=72, k=6, g=0, kg=0, n=100, f=f), arch="cpu", config=THREAD)
    shape = spec.canonical_shape(_shape(e=72, k=6, g=0, kg=0, n=257, f=f))
    inputs = spec.make_inputs(shape, "cpu", 0)
    idx, w = kern(*inputs)
    ref_idx, ref_w = spec.reference(shape, *inputs)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_compiles_for_sm90a():
    kern = tkjit.get(NAME, _shape(n=4096), arch="sm_90a")
    assert kern.config["layout"] == "warp"
    src = (kern.path / "kernel.cu").read_text()
    assert "__ballot_sync" in src and "__reduce_max_sync" in src and "float4" in src
    assert "__expf" not in src and "__syncthreads" not in src


# -- fix_routing_mask / unmapped_topk_idx ---------------------------------------------------------

FIXED = {"has_fix": True, "has_unmapped": True}


@pytest.mark.parametrize("f", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("e,k,g,kg,s,d", [(256, 8, 8, 4, 0, 1), (72, 6, 0, 0, 0, 1), (256, 8, 8, 4, 1, 9)])
def test_reference_with_fixed_routing_matches_tile_kernels_semantics(f, e, k, g, kg, s, d):
    """Fixed rows (their indices from unmapped_topk_idx), masked rows (-1 there too), the replica map; seed 0:
    every given index a valid expert, as TileKernels asserts."""
    spec = get_spec(NAME)
    full = spec.canonical_shape(_shape(e, k, g, kg, n=200, s=s, f=f, has_map=s > 0, d=d, has_mask=True, **FIXED))
    inputs = spec.make_inputs(full, "cpu", 0)
    named, (rsf, ep, per_gpu, tp, tps) = _named(spec, full, inputs)
    mask, fix = named["mask"].bool(), named["fix_routing_mask"].bool()
    assert (mask & fix).sum() > 20 and (mask & ~fix).sum() > 20 and (~mask).sum() > 20
    logical, idx, w = spec.reference(full, *inputs)
    unmapped = named["unmapped_topk_idx"].clone()
    maps = {"to_physical_map": named["to_physical_map"], "logical_count": named["logical_count"]} if s else {}
    want_idx, want_w = _tk_reference(named["logits"], named["bias"], k, kg, g, s > 0, s, rsf, ep, 8, tp, tps, f,
                                     mask, fix, unmapped_topk_idx=unmapped, **maps)
    assert per_gpu == (e + d - 1) // 8
    assert torch.equal(logical, unmapped) and torch.equal(idx, want_idx)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)
    assert torch.equal(logical[mask & fix], named["unmapped_topk_idx"][mask & fix])


@pytest.mark.parametrize("kw", [dict(has_unmapped=True), dict(has_mask=True, **FIXED),
                                dict(e=72, k=6, g=0, kg=0, **FIXED),
                                dict(e=64, k=4, g=4, kg=2, s=2, has_map=True, d=3, has_mask=True, **FIXED)])
def test_c_target_runs_fixed_routing_exact(kw):
    """Odd seeds also give fixed indices outside [0, num_experts): in bounds, as the reference says."""
    kern = tkjit.get(NAME, _shape(n=100, **kw), arch="cpu")
    assert kern.config["layout"] == "thread"
    for n in (1, 7, 301):
        for seed in (0, 1):
            _assert_exact(kern, _shape(n=n, **kw), seed)


def _logits(n: int, e: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, e, generator=g) * 2, torch.randn(e, generator=g) * 0.1


def _distinct(n: int, e: int, k: int, seed: int = 1) -> torch.Tensor:
    """n rows of k distinct experts in random order (int64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, e, generator=g).argsort(dim=1)[:, :k]


def test_fixed_rows_keep_their_indices_and_the_other_rows_do_not_change():
    """One GPU, one TP rank (the remap is the identity): a fixed row's indices are the given ones in their
    order, its weights their scores normalised; the other rows are routed as without fix_routing_mask, and
    unmapped_topk_idx gets what they selected."""
    n, e, k, rsf = 50, 64, 4, 2.5
    plain = tkjit.get(NAME, _shape(e, k, 4, 2, n=n), arch="cpu")
    fixed = tkjit.get(NAME, _shape(e, k, 4, 2, n=n, **FIXED), arch="cpu")
    logits, bias = _logits(n, e)
    idx0, w0 = plain(logits, bias, rsf, 0, e, 0, 1)
    fix = (torch.arange(n) % 3 == 0).to(torch.int8)
    rows = fix.bool()
    given = _distinct(n, e, k)
    given[rows] = torch.where(given[rows] == idx0[rows], (given[rows] + 1) % e, given[rows])  # not the selection
    unmapped = given.clone()
    got, idx, w = fixed(logits, bias, fix, unmapped, rsf, 0, e, 0, 1)
    assert got is unmapped
    assert torch.equal(idx[rows], given[rows]) and torch.equal(unmapped[rows], given[rows])
    assert torch.equal(idx[~rows], idx0[~rows]) and torch.equal(w[~rows], w0[~rows])
    assert torch.equal(unmapped[~rows], idx0[~rows])
    sc = torch.sigmoid(logits).gather(1, given)[rows]
    torch.testing.assert_close(w[rows], sc / sc.sum(1, keepdim=True) * rsf, rtol=1e-6, atol=0)
    # The given order is kept: reversed indices, reversed weights (the sum in the other order: to an ulp).
    rev = given.flip(1)
    _, idx2, w2 = fixed(logits, bias, fix, rev.clone(), rsf, 0, e, 0, 1)
    assert torch.equal(idx2[rows], rev[rows])
    torch.testing.assert_close(w2[rows], w[rows].flip(1), rtol=1e-6, atol=0)
    # Every row fixed to what it would select: the routing without fix_routing_mask, exactly.
    _, idx3, w3 = fixed(logits, bias, torch.ones(n, dtype=torch.int8), idx0.clone(), rsf, 0, e, 0, 1)
    assert torch.equal(idx3, idx0) and torch.equal(w3, w0)


def test_fixed_routing_with_the_map_and_ep_tp_ranks():
    """Fixed rows go through the shared-expert slots, the replica map and the EP/TP remap like selected ones;
    unmapped_topk_idx keeps the logical indices."""
    n, e, k, s, d = 40, 64, 4, 2, 3
    kern = tkjit.get(NAME, _shape(e, k, 4, 2, n=n, s=s, has_map=True, d=d, **FIXED), arch="cpu")
    logits, bias = _logits(n, e)
    g = torch.Generator().manual_seed(3)
    pmap = torch.randint(0, e + d - 1, (e + s, d), generator=g, dtype=torch.int32)
    cnt = torch.randint(1, d + 1, (e + s,), generator=g, dtype=torch.int32)
    fix = (torch.arange(n) % 2 == 0).to(torch.int8)
    given = _distinct(n, e, k)
    ep, num_ep, tp, tps = 3, 4, 1, 2
    per_gpu = (e + d - 1) // num_ep
    unmapped = given.clone()
    _, idx, w = kern(logits, bias, pmap, cnt, fix, unmapped, 1.5, ep, per_gpu, tp, tps)
    for t in range(0, n, 2):
        assert unmapped[t].tolist() == given[t].tolist()
        for r, i in enumerate(given[t].tolist() + [e, e + 1]):
            phys = int(pmap[i, (ep + t * 23333) % int(cnt[i])])
            gpu = phys // per_gpu
            want = (gpu // tps) * per_gpu + phys % per_gpu if gpu % tps == tp else -1
            assert int(idx[t, r]) == want, (t, r)
        assert w[t, k:].tolist() == [1.0, 1.0]
    full = kern.spec.canonical_shape(_shape(e, k, 4, 2, n=n, s=s, has_map=True, d=d, **FIXED))
    ref = kern.spec.reference(full, logits, bias, pmap, cnt, fix, given, 1.5, ep, per_gpu, tp, tps)
    assert torch.equal(ref[0], unmapped) and torch.equal(ref[1], idx)
    torch.testing.assert_close(ref[2], w, rtol=1e-6, atol=0)  # (see _assert_exact)


def test_unmapped_through_a_strided_view_and_masked_rows():
    """unmapped_topk_idx as a view of a wider buffer: its rows written, the columns around them not; a masked
    token's row is -1; a routed token's row is what the plain routing selects (before the replica map)."""
    n, e, k, s, d = 33, 64, 4, 1, 2
    kern = tkjit.get(NAME, _shape(e, k, 4, 2, n=n, s=s, has_map=True, d=d, has_mask=True, has_unmapped=True),
                     arch="cpu")
    plain = tkjit.get(NAME, _shape(e, k, 4, 2, n=n), arch="cpu")
    logits, bias = _logits(n, e)
    mask = (torch.arange(n) % 4 != 1).to(torch.int8)
    pmap = (torch.arange((e + s) * d, dtype=torch.int32).view(e + s, d) * 7) % (e + d - 1)
    cnt = torch.full((e + s,), d, dtype=torch.int32)
    wide = torch.full((n, k + 5), 99, dtype=torch.int64)
    view = wide[:, 2:2 + k]
    got, idx, _ = kern(logits, bias, mask, pmap, cnt, view, 1.0, 0, e + d - 1, 0, 1)
    assert got is view and view.stride() == (k + 5, 1)
    assert (wide[:, :2] == 99).all() and (wide[:, 2 + k:] == 99).all()
    rows = mask.bool()
    assert (view[~rows] == -1).all() and (idx[~rows] == -1).all()
    assert torch.equal(view[rows], plain(logits, bias, 1.0, 0, e, 0, 1)[0][rows])
    assert not torch.equal(view[rows], idx[rows, :k])  # (the map moved some: topk_idx is not the logical index)
    with pytest.raises(TensorError, match="unmapped_topk_idx must have a contiguous last axis"):
        kern(logits, bias, mask, pmap, cnt, torch.zeros(n, 2 * k, dtype=torch.int64)[:, ::2], 1.0, 0, 65, 0, 1)


def test_fixed_indices_outside_the_experts_stay_in_bounds():
    """Unsupported (TileKernels asserts >= 0), yet nothing goes out of bounds: a negative index and one past the
    map's rows give -1, the score is read at the clamped index, the index is kept in unmapped_topk_idx."""
    n, e, k, s, d = 4, 32, 4, 1, 2
    shape = _shape(e, k, 0, 0, n=n, s=s, has_map=True, d=d, **FIXED)
    kern = tkjit.get(NAME, shape, arch="cpu")
    logits, bias = _logits(n, e)
    pmap = torch.arange((e + s) * d, dtype=torch.int32).view(e + s, d) % (e + d - 1)
    cnt = torch.ones(e + s, dtype=torch.int32)
    given = torch.tensor([[-1, 0, 1, 2], [e + s, 2**40, -(2**40), 3], [e, 4, 5, 6], [7, 8, 9, 10]])
    fix = torch.tensor([1, 1, 1, 0], dtype=torch.int8)
    unmapped = given.clone()
    _, idx, w = kern(logits, bias, pmap, cnt, fix, unmapped, 1.0, 0, e + d - 1, 0, 1)
    assert torch.equal(unmapped[:3], given[:3])
    assert idx[0, 0] == -1 and (idx[1, :3] == -1).all() and idx[2, 0] == pmap[e, 0]  # e: the shared expert's row
    assert torch.isfinite(w).all()
    sc = torch.sigmoid(logits[0])
    torch.testing.assert_close(w[0, 0], sc[0] / sc[[0, 0, 1, 2]].sum(), rtol=1e-6, atol=0)  # -1 read as 0
    full = kern.spec.canonical_shape(shape)
    ref = kern.spec.reference(full, logits, bias, pmap, cnt, fix, given, 1.0, 0, e + d - 1, 0, 1)
    assert torch.equal(ref[0], unmapped) and torch.equal(ref[1], idx)
    torch.testing.assert_close(ref[2], w, rtol=1e-6, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("config", [{"layout": "warp", "threads": 128, "tokens_per_warp": 1, "reduce": "redux"},
                                    {"layout": "warp", "threads": 64, "tokens_per_warp": 2, "reduce": "shfl"}])
def test_compiles_for_sm90a_with_fixed_routing(config):
    kern = tkjit.get(NAME, _shape(n=4096, s=1, has_map=True, d=9, has_mask=True, **FIXED), arch="sm_90a",
                     config=config)
    src = (kern.path / "kernel.cu").read_text()
    assert "fix_routing_mask" in src and "unmapped_topk_idx_stride0" in src and "__expf" not in src
    kern = tkjit.get(NAME, _shape(n=4096, e=72, k=6, g=0, kg=0, f="softmax", has_unmapped=True), arch="sm_90a",
                     config=config)
    assert "unmapped_topk_idx_stride0" in (kern.path / "kernel.cu").read_text()


# -- torch op and compat ---------------------------------------------------------------------------

def _inputs(n=37, e=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, e, generator=g), torch.randn(e, generator=g) * 0.1


ARGS = (6, 2, 8, False, 0, 2.5, 0, 4, 1, 2, "sigmoid")  # num_topk .. scoring_func, 64 experts


@pytest.mark.parametrize("tokens", [0, 37])
def test_opcheck_and_fake(tokens):
    from torch._subclasses.fake_tensor import FakeTensorMode

    f = torch.ops.tkjit.top2_sum_gate.default
    x, b = _inputs(tokens)
    result = torch.library.opcheck(f, (x, b, *ARGS), test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result
    real = f(x, b, *ARGS)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = f(mode.from_tensor(x), mode.from_tensor(b), *ARGS)
    for r, fk in zip(real, fake):
        assert (fk.shape, fk.dtype, fk.stride()) == (r.shape, r.dtype, r.stride())


def test_the_mutated_argument_may_be_left_out_and_is_version_bumped_when_given():
    # torch before 2.12 indexed the dispatcher's args for it, which drop an argument left at its default: an
    # IndexError on any call without it (pytorch#176078); tkjit registers its own version bump.
    f = torch.ops.tkjit.top2_sum_gate
    x, b = _inputs()
    idx, _ = f(x, b, *ARGS)
    given = torch.full((37, 6), 7, dtype=torch.int64)
    before = given._version
    again, _ = f(x, b, *ARGS, unmapped_topk_idx=given)
    assert given._version > before and torch.equal(again, idx)


def test_ops_compile_and_compat_match_the_reference():
    x, b = _inputs()
    spec = get_spec(NAME)
    want = spec.reference(spec.canonical_shape(_shape(64, 6, 8, 2, n=37)), x, b, 2.5, 0, 16, 1, 2)
    for got in (tkjit.ops.top2_sum_gate(x, b, *ARGS), tk_moe.top2_sum_gate(x, b, *ARGS),
                torch.compile(lambda s, t: tkjit.ops.top2_sum_gate(s, t, *ARGS), fullgraph=True)(x, b)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Shared experts through the map; TileKernels' torch reference semantics.
    pmap = torch.arange(65 * 2, dtype=torch.int32).view(65, 2) % 66
    cnt = torch.tensor([1, 2] * 32 + [2], dtype=torch.int32)
    mask = torch.arange(37) % 3 != 1
    got = tk_moe.top2_sum_gate(x, b, 8, 2, 8, True, 1, 2.5, 3, 2, 0, 1, "sigmoid", mask=mask, to_physical_map=pmap,
                               logical_count=cnt)
    want = _tk_reference(x, b, 8, 2, 8, True, 1, 2.5, 3, 2, 0, 1, "sigmoid", mask, to_physical_map=pmap,
                         logical_count=cnt)
    assert (got[0][1] == -1).all() and (got[1][1] == 0).all()
    assert got[0].shape == (37, 9) and torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    out = tk_moe.top2_sum_gate(x[:0], b, *ARGS)
    assert out[0].shape == (0, 6) and out[0].dtype == torch.int64 and out[1].dtype == torch.float32


def _fixed_call(n=37, seed=0):
    """A compat call's tensors with every option: 64 experts, one shared expert through the map, a mask, a third of
    the tokens fixed to valid distinct experts, unmapped_topk_idx a view of a wider buffer."""
    x, b = _inputs(n, seed=seed)
    pmap = torch.arange(65 * 2, dtype=torch.int32).view(65, 2) % 66
    cnt = torch.tensor([1, 2] * 32 + [2], dtype=torch.int32)
    mask = torch.arange(n) % 5 != 1
    fix = torch.arange(n) % 3 == 0
    wide = torch.full((n, 12), 77, dtype=torch.int64)
    wide[:, 2:10] = _distinct(n, 64, 8, seed + 1)
    return x, b, {"mask": mask, "fix_routing_mask": fix, "to_physical_map": pmap, "logical_count": cnt,
                  "unmapped_topk_idx": wide[:, 2:10]}


GATE = (8, 2, 8, True, 1, 2.5, 3, 2, 0, 1, "sigmoid")  # num_topk .. scoring_func, for _fixed_call's tensors


def test_compat_fixed_routing_and_unmapped_match_tile_kernels_reference():
    """Formerly NotImplementedError: fix_routing_mask and unmapped_topk_idx through the compat API, the op (eager
    and torch.compile'd) as TileKernels' torch reference has them."""
    x, b, kw = _fixed_call()
    given = kw["unmapped_topk_idx"].clone()
    want_unmapped = given.clone()
    want = _tk_reference(x, b, *GATE, **{**kw, "unmapped_topk_idx": want_unmapped})
    compiled = torch.compile(lambda s, t, u: tkjit.ops.top2_sum_gate(s, t, *GATE, **{**kw, "unmapped_topk_idx": u}),
                             fullgraph=True)
    calls = (lambda u: tk_moe.top2_sum_gate(x, b, *GATE, **{**kw, "unmapped_topk_idx": u}),
             lambda u: tkjit.ops.top2_sum_gate(x, b, *GATE, **{**kw, "unmapped_topk_idx": u}),
             lambda u: torch.ops.tkjit.top2_sum_gate(x, b, *GATE, **{**kw, "unmapped_topk_idx": u}),
             lambda u: compiled(x, b, u))
    for call in calls:
        wide = kw["unmapped_topk_idx"]._base.clone()
        unmapped = wide[:, 2:10]
        unmapped.copy_(given)
        got = call(unmapped)
        assert len(got) == 2 and got[0].shape == (37, 9)
        assert torch.equal(got[0], want[0]) and torch.equal(unmapped, want_unmapped)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
        assert (wide[:, :2] == 77).all() and (wide[:, 10:] == 77).all()
    fixed = kw["fix_routing_mask"] & kw["mask"]
    assert fixed.any() and torch.equal(want_unmapped[fixed], given[fixed])
    assert (want_unmapped[~kw["mask"]] == -1).all()
    out = tk_moe.top2_sum_gate(x[:0], b, *ARGS, unmapped_topk_idx=torch.empty(0, 6, dtype=torch.int64))
    assert out[0].shape == (0, 6)


def test_op_fixed_routing_fake_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    f = torch.ops.tkjit.top2_sum_gate.default
    x, b, kw = _fixed_call(13)
    args = (x, b, *GATE, kw["mask"], kw["fix_routing_mask"], kw["to_physical_map"], kw["logical_count"],
            kw["unmapped_topk_idx"].contiguous())
    result = torch.library.opcheck(f, args, test_utils=OPCHECK_TESTS)
    assert result == dict.fromkeys(OPCHECK_TESTS, "SUCCESS"), result
    real = f(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = f(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]
    # The same refusals from the fake and the real implementation.
    bad = [(dict(unmapped_topk_idx=None), "fix_routing_mask needs unmapped_topk_idx"),
           (dict(fix_routing_mask=kw["fix_routing_mask"].to(torch.int8)), "fix_routing_mask has dtype torch.int8"),
           (dict(unmapped_topk_idx=torch.zeros(13, 8, dtype=torch.int32)), "unmapped_topk_idx has dtype torch.int32"),
           (dict(unmapped_topk_idx=torch.zeros(13, 7, dtype=torch.int64)), r"unmapped_topk_idx has shape \(13, 7\)"),
           (dict(unmapped_topk_idx=torch.zeros(8, 13, dtype=torch.int64).t()), r"stride\(1\) == 1")]
    for change, msg in bad:
        call = {**kw, **change}
        with pytest.raises(TensorError, match=msg):
            f(x, b, *GATE, **call)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises(TensorError, match=msg):
            f(mode.from_tensor(x), b, *GATE, **{k: v if v is None else mode.from_tensor(v) for k, v in call.items()})


def test_compat_argument_errors():
    x, b = _inputs()
    fn = tk_moe.top2_sum_gate
    with pytest.raises(TensorError, match="logits must be torch.float32"):
        fn(x.double(), b, *ARGS)
    with pytest.raises(TensorError, match="logits and bias must be contiguous"):
        fn(x.t().contiguous().t(), b, *ARGS)
    with pytest.raises(TensorError, match="bias has 63 entries"):
        fn(x, b[:63], *ARGS)
    with pytest.raises(ShapeError, match=r"num_topk \(65\) must be in"):
        fn(x, b, 65, *ARGS[1:])
    with pytest.raises(ShapeError, match="both zero or both non-zero"):
        fn(x, b, 6, 0, 8, *ARGS[3:])
    with pytest.raises(ShapeError, match="identity"):
        fn(x, b, *ARGS[:-1], "identity")
    with pytest.raises(ShapeError, match="scoring_func must be"):
        fn(x, b, *ARGS[:-1], "tanh")
    with pytest.raises(ShapeError, match="num_shared_experts"):
        fn(x, b, 6, 2, 8, True, 1, 2.5, 0, 4, 1, 2, "sigmoid")  # shared experts need the map's extra experts
    with pytest.raises(ShapeError, match=r"tp_rank \(2\) must be in"):
        fn(x, b, 6, 2, 8, False, 0, 2.5, 0, 4, 2, 2, "sigmoid")
    with pytest.raises(ShapeError, match=r"n \(64\) must be >= num_ep_ranks \(128\)"):
        fn(x, b, 6, 2, 8, False, 0, 2.5, 0, 128, 0, 1, "sigmoid")
    with pytest.raises(TensorError, match="given together"):
        fn(x, b, *ARGS, to_physical_map=torch.zeros(64, 1, dtype=torch.int32))
    with pytest.raises(TensorError, match="mask must be a torch.bool tensor"):
        fn(x, b, *ARGS, mask=torch.ones(37, dtype=torch.int32))
    with pytest.raises(TensorError, match="mask has 36 entries"):
        fn(x, b, *ARGS, mask=torch.ones(36, dtype=torch.bool))
    fix, unmapped = torch.ones(37, dtype=torch.bool), torch.zeros(37, 6, dtype=torch.int64)
    for kw, msg in [({"fix_routing_mask": fix}, "fix_routing_mask needs unmapped_topk_idx"),
                    ({"fix_routing_mask": fix.to(torch.int8)}, "fix_routing_mask must be torch.bool"),
                    ({"fix_routing_mask": fix[:36]}, r"fix_routing_mask must be contiguous with num_tokens \(37\)"),
                    ({"fix_routing_mask": torch.ones(74, dtype=torch.bool)[::2]}, "must be contiguous"),
                    ({"unmapped_topk_idx": unmapped.int()}, "unmapped_topk_idx must be torch.int64"),
                    ({"unmapped_topk_idx": unmapped[:, :5]}, r"\(num_tokens, num_topk\) = \(37, 6\)"),
                    ({"unmapped_topk_idx": unmapped[0]}, "unmapped_topk_idx must be 2-D"),
                    ({"unmapped_topk_idx": torch.zeros(6, 37, dtype=torch.int64).t()}, r"stride\(1\) == 1")]:
        if "needs" not in msg:  # (a valid partner for the argument under test)
            kw = {"unmapped_topk_idx": unmapped, **kw}
        with pytest.raises(TensorError, match=msg):
            fn(x, b, *ARGS, **kw)
    with pytest.raises(NotImplementedError, match="num_experts"):
        fn(torch.randn(3, 66), torch.randn(66), 6, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sigmoid")


def test_compat_repeat_calls_skip_the_checks_and_stay_exact(monkeypatch):
    """A signature checked once goes straight to its kernel: fresh inputs stay bit-exact, every argument that
    differs (a value, its type, a stride, an optional tensor) is checked again, and reset() forgets them."""
    from tkjit.compat.tile_kernels import moe as compat_moe

    spec = get_spec(NAME)
    shape = spec.canonical_shape(_shape(64, 6, 8, 2, n=37))
    tkjit.reset()  # (another test's calls may have checked this signature)
    checks = []
    real_tensor = compat_moe.tensor
    monkeypatch.setattr(compat_moe, "tensor", lambda *a, **kw: (checks.append(a[1]), real_tensor(*a, **kw))[1])
    for seed in range(3):
        x, b = _inputs(seed=seed)
        got = tk_moe.top2_sum_gate(x, b, *ARGS)
        want = tkjit.ops.top2_sum_gate(x, b, *ARGS)  # the checked path, same kernel
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[0], spec.reference(shape, x, b, 2.5, 0, 16, 1, 2)[0])
    assert checks == ["logits", "bias"]  # the first call only
    with pytest.raises(ShapeError, match=r"num_topk \(65\) must be in"):
        tk_moe.top2_sum_gate(x, b, 65, *ARGS[1:])
    with pytest.raises(ShapeError, match="use_shared_as_routed must be a bool"):
        tk_moe.top2_sum_gate(x, b, *ARGS[:3], 0, *ARGS[4:])  # equal to False, not a bool
    with pytest.raises(TensorError, match="logits and bias must be contiguous"):
        tk_moe.top2_sum_gate(x.t().contiguous().t(), b, *ARGS)
    with pytest.raises(TensorError, match="mask has 36 entries"):
        tk_moe.top2_sum_gate(x, b, *ARGS, mask=torch.ones(36, dtype=torch.bool))
    other = tk_moe.top2_sum_gate(x, b, *ARGS[:5], 1.0, *ARGS[6:])  # another scale: checked, its own scalars
    torch.testing.assert_close(other[1] * 2.5, got[1], rtol=1e-6, atol=0)
    checks.clear()
    tkjit.reset()
    tk_moe.top2_sum_gate(x, b, *ARGS)
    assert checks == ["logits", "bias"]
