"""Every TileKernels-compatible op traces into one graph: `torch.compile(fullgraph=True)` of a compat call, with static
or dynamic shapes, gives the eager call's results (kernels served by reference-writing CPU kernels, as in the other
compat tests). The compat layer's checks run at trace time: its shape checks are constants of the graph, a tensor's
address is not read. On FakeTensors each gives the eager call's dtypes, shapes and strides."""

import sys
from pathlib import Path

import pytest
import torch

import tkjit.compat.tile_kernels as tk
from tkjit.registry import all_specs, get_spec

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")


@pytest.fixture
def refs(monkeypatch):
    from tkjit.compat.tile_kernels import config

    monkeypatch.setattr(config, "_num_sms", 8)  # set_num_sms(8) on a host without a GPU, undone after the test
    return serve_references(monkeypatch, {s.name for s in all_specs()})


def bf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).bfloat16()


def _engram_gate_inputs():
    spec = get_spec("engram_gate_fwd")
    shape = spec.canonical_shape({"num_tokens": 16, "hc_mult": 4, "hidden_size": 512, "eps": 1e-5,
                                  "clamp_value": 1e-3})
    return (*spec.make_inputs(shape, seed=1), 1e-5, 1e-3)


def _engram_bwd_inputs():
    spec = get_spec("engram_gate_bwd")
    shape = spec.canonical_shape({"num_tokens": 16, "hc_mult": 4, "hidden_size": 1024,
                                  "num_partials": tk.get_num_sms()})
    return (*spec.make_inputs(shape, seed=2), 1e-6)


def _grad_w_reduce(*args):  # in place: the two updated gradients are the result
    tk.engram.grad_w_reduce(*args)
    return args[3], args[4]


def _grad_w_reduce_inputs():
    spec = get_spec("grad_w_reduce")
    return spec.make_inputs(spec.canonical_shape({"hc_mult": 4, "hidden_size": 512, "num_partials": 8}), seed=3)


def _recompute(*args):  # in place: the layer inputs and residuals are the result
    tk.modeling.mhc.ops.mhc_multilayer_recompute(*args)
    return args[5], args[6]


def _recompute_inputs(L=3, P=2, m=4, h=64):
    ir = bf(1, 6, m, h)
    pre = [torch.randn(1, 6, m, 1) for _ in range(L)]
    lo, post = [bf(1, 6, h) for _ in range(P)], [torch.randn(1, 6, m, 1) for _ in range(P)]
    comb = [torch.randn(1, 6, m, m) for _ in range(P)]
    li = [torch.empty(1, 6, h, dtype=torch.bfloat16) for _ in range(L)]
    res = [torch.empty(1, 6, m, h, dtype=torch.bfloat16) for _ in range(P)]
    return ir, pre, lo, post, comb, li, res


def _lossless_inputs():
    spec = get_spec("per_block_cast_lossless")
    shape = spec.canonical_shape({"num_tokens": 64, "hidden": 256, "in_block_m": 1, "in_block_k": 32,
                                  "out_block_m": 32, "out_block_k": 128})
    return tuple(spec.make_inputs(shape, "cpu", 4)), "e4m3", (1, 32), (32, 128)


def _swiglu_bwd_inputs():
    spec = get_spec("swiglu_backward_and_per_token_cast")
    shape = spec.canonical_shape({"num_expand_tokens": 64, "num_tokens": 20, "num_topk": 4, "hidden": 256,
                                  "num_per_channels": 128})
    x, x_sf, grad, weight, pos, t2p, _ = spec.make_inputs(shape, "cpu", 5)
    return (x, x_sf), grad, weight, pos, t2p, 128


def _unique(g: torch.Tensor, n: int) -> torch.Tensor:  # in place: the updated tensor is the result
    tk.moe.inplace_unique_group_indices(g, n)
    return g


mhc = tk.modeling.mhc.ops
CASES = {  # compat function (its name) -> a call's arguments
    "moe.topk_gate": lambda: (tk.moe.topk_gate, (torch.randn(7, 64), 4)),
    "moe.normalize_weight": lambda: (tk.moe.normalize_weight, (torch.rand(7, 6),)),
    "moe.aux_fi": lambda: (tk.moe.aux_fi, (torch.randint(0, 64, (7, 6)), 64, 6)),
    "moe.group_count": lambda: (tk.moe.group_count, (torch.randint(0, 8, (7, 6)), 8)),
    "moe.mask_indices_by_tp": lambda: (tk.moe.mask_indices_by_tp, (torch.randint(0, 64, (7, 6)), 64, 2, 0, 2)),
    "moe.topk_sum_and_topk_group_idx": lambda: (tk.moe.topk_sum_and_topk_group_idx, (torch.randn(7, 8, 32), 2, 4)),
    "moe.get_fused_mapping": lambda: (tk.moe.get_fused_mapping, (torch.randint(0, 16, (7, 4)), 16, 256, 8)),
    "moe.expand_to_fused": lambda: (tk.moe.expand_to_fused, (bf(7, 256), torch.arange(28).view(7, 4).int(),
                                                             torch.arange(28).int() % 4)),
    "moe.reduce_fused": lambda: (tk.moe.reduce_fused, (bf(28, 256), torch.rand(7, 4),
                                                       torch.arange(28).view(7, 4).int())),
    "moe.expand_to_fused_with_sf": lambda: (tk.moe.expand_to_fused_with_sf, (
        tk.quant.per_token_cast(bf(7, 256), "e4m3", 128), 128, torch.arange(28).view(7, 4).int(),
        torch.arange(28).int() % 4)),
    "moe.inplace_unique_group_indices": lambda: (_unique, (torch.randint(0, 8, (7, 4)), 8)),
    "moe.top2_sum_gate": lambda: (tk.moe.top2_sum_gate, (torch.randn(7, 64), torch.randn(64), 6, 4, 8, False, 0, 2.5,
                                                         0, 1, 0, 1, "sigmoid")),
    "quant.per_token_cast": lambda: (tk.quant.per_token_cast, (bf(7, 256), "e4m3", 128)),
    "quant.per_token_cast_with_sf_only": lambda: (tk.quant.per_token_cast_with_sf_only, (bf(7, 256), "e4m3", 128)),
    "quant.per_token_cast_with_precomputed_sf": lambda: (tk.quant.per_token_cast_with_precomputed_sf,
                                                         (bf(7, 256), "e4m3", 128, torch.rand(7, 2) + 0.1)),
    "quant.per_token_cast_back": lambda: (tk.quant.per_token_cast_back,
                                          (tk.quant.per_token_cast(bf(7, 256), "e4m3", 128), "bf16", 128)),
    "quant.per_block_cast": lambda: (tk.quant.per_block_cast, (bf(64, 256), "e4m3", (32, 32))),
    "quant.per_block_cast_with_sf_only": lambda: (tk.quant.per_block_cast_with_sf_only,
                                                  (bf(64, 256), "e4m3", (32, 32))),
    "quant.per_block_cast_with_precomputed_sf": lambda: (tk.quant.per_block_cast_with_precomputed_sf,
                                                         (bf(64, 256), "e4m3", (32, 32), torch.rand(2, 8) + 0.1)),
    "quant.cast_back": lambda: (tk.quant.cast_back,
                                (tk.quant.per_block_cast(bf(64, 256), "e4m3", (32, 32)), "bf16", (32, 32))),
    "quant.per_channel_cast": lambda: (tk.quant.per_channel_cast, (bf(256, 256), "e4m3", 128)),
    "quant.per_channel_cast_fused": lambda: (tk.quant.per_channel_cast_fused, (bf(256, 256), "e4m3", 128)),
    "quant.per_channel_cast_and_transpose": lambda: (tk.quant.per_channel_cast_and_transpose,
                                                     (bf(256, 256), "e4m3", 128)),
    "quant.swiglu_forward_and_per_token_cast": lambda: (tk.quant.swiglu_forward_and_per_token_cast,
                                                        (bf(7, 512), "e4m3", 128)),
    "quant.swiglu_forward_and_per_channel_cast_and_transpose": lambda: (
        tk.quant.swiglu_forward_and_per_channel_cast_and_transpose, (bf(128, 512), "e4m3", 128)),
    "quant.per_block_cast_lossless": lambda: (tk.quant.per_block_cast_lossless, _lossless_inputs()),
    "quant.swiglu_backward_and_per_token_cast": lambda: (tk.quant.swiglu_backward_and_per_token_cast,
                                                         _swiglu_bwd_inputs()),
    "quant.unpack_from_e2m1fn_x2": lambda: (tk.quant.unpack_from_e2m1fn_x2,
                                            (torch.randint(-128, 127, (16, 16), dtype=torch.int8),)),
    "transpose.transpose": lambda: (tk.transpose.transpose, (bf(64, 128),)),
    "transpose.batched_transpose": lambda: (tk.transpose.batched_transpose, (bf(2, 64, 128),)),
    "engram.fused_weight": lambda: (tk.engram.fused_weight, (bf(4, 256), bf(4, 256))),
    "engram.engram_hash": lambda: (tk.engram.engram_hash, (
        torch.randint(0, 1000, (7, 3), dtype=torch.int32), torch.randint(1, 100, (2, 3), dtype=torch.int64),
        torch.randint(100, 1000, (2, 2, 4), dtype=torch.int32), torch.randint(0, 100, (2, 8), dtype=torch.int32))),
    "engram.engram_gate_fwd": lambda: (tk.engram.engram_gate_fwd, _engram_gate_inputs()),
    "engram.engram_gate_bwd": lambda: (tk.engram.engram_gate_bwd, _engram_bwd_inputs()),
    "engram.grad_w_reduce": lambda: (_grad_w_reduce, _grad_w_reduce_inputs()),
    "modeling.mhc.ops.mhc_multilayer_recompute": lambda: (_recompute, _recompute_inputs()),
    "modeling.mhc.ops.sinkhorn_normalize": lambda: (mhc.sinkhorn_normalize, (torch.randn(2, 3, 4, 4),)),
    "modeling.mhc.ops.expand_to_mhc": lambda: (mhc.expand_to_mhc, (bf(2, 3, 64), 4)),
    "modeling.mhc.ops.mhc_pre_apply_mix": lambda: (mhc.mhc_pre_apply_mix, (bf(2, 3, 4, 64), torch.rand(2, 3, 4, 1))),
    "modeling.mhc.ops.mhc_head_compute_mix": lambda: (mhc.mhc_head_compute_mix,
                                                      (torch.randn(2, 3, 4), torch.rand(1), torch.rand(4), 1e-6)),
    "modeling.mhc.ops.mhc_pre_split_mixes": lambda: (mhc.mhc_pre_split_mixes, (torch.randn(2, 3, 24), torch.rand(3),
                                                                             torch.rand(24), 4, 2.0, 1e-6)),
    "modeling.mhc.ops.mhc_pre_norm_fn": lambda: (mhc.mhc_pre_norm_fn, (bf(2, 3, 4, 64), torch.randn(24, 256), None,
                                                                     1e-6)),
    "modeling.mhc.ops.mhc_pre_big_fuse": lambda: (mhc.mhc_pre_big_fuse, (
        bf(2, 5, 4, 128), torch.randn(24, 512) / 512 ** 0.5, torch.randn(3), torch.randn(24), 1e-6, 1e-2, 1e-6, 2.0,
        10)),
    "modeling.mhc.ops.mhc_post": lambda: (mhc.mhc_post, (bf(2, 3, 64), bf(2, 3, 4, 64), torch.rand(2, 3, 4, 1),
                                                         torch.rand(2, 3, 4, 4))),
    "modeling.mhc.ops.mhc_post_bwd": lambda: (mhc.mhc_post_bwd, (bf(2, 3, 64), bf(2, 3, 4, 64), torch.rand(2, 3, 4, 1),
                                                                 torch.rand(2, 3, 4, 4), bf(2, 3, 4, 64), False)),
    "modeling.mhc.ops.mhc_post_fwd": lambda: (mhc.mhc_post_fwd, (bf(2, 3, 64), bf(2, 3, 4, 64), torch.rand(2, 3, 4, 1),
                                                                 torch.rand(2, 3, 4, 4), bf(2, 3, 4, 64))),
}


def test_every_compat_function_is_traced_here():
    import inspect

    mods = {"moe": tk.moe, "quant": tk.quant, "transpose": tk.transpose, "engram": tk.engram,
            "modeling.mhc.ops": tk.modeling.mhc.ops}
    public = {f"{m}.{n}" for m, mod in mods.items() for n in getattr(mod, "__all__", dir(mod))
              if not n.startswith("_") and inspect.isfunction(getattr(mod, n))}
    assert public == set(CASES)


def _copy(a):
    if isinstance(a, torch.Tensor):
        return a.clone()
    return type(a)(_copy(t) for t in a) if isinstance(a, (list, tuple)) else a


def _flat(x):
    """An op's result as a flat list of tensors and plain values."""
    if isinstance(x, (tuple, list)):
        return [v for item in x for v in _flat(item)]
    return [x]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(CASES))
def test_compat_op_traces_in_one_graph(refs, name, dynamic):
    torch._dynamo.reset()  # (one lambda compiled for every op: a fresh cache each, no recompile limit)
    torch.manual_seed(0)
    fn, args = CASES[name]()
    clone = [_copy(a) for a in args]  # (in-place ops change their inputs)
    want = fn(*clone)
    got = torch.compile(lambda *a: fn(*a), fullgraph=True, backend="aot_eager", dynamic=dynamic)(*args)
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                               b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
        else:
            assert a == b


@pytest.mark.filterwarnings("error")  # (reading a FakeTensor's data pointer warns)
@pytest.mark.parametrize("name", list(CASES))
def test_compat_op_on_fake_tensors_gives_the_eager_layout(refs, name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    fn, args = CASES[name]()
    want = _flat(fn(*[_copy(a) for a in args]))
    with FakeTensorMode() as mode:
        def fake(a):
            if isinstance(a, torch.Tensor):
                return mode.from_tensor(a)
            return type(a)(fake(t) for t in a) if isinstance(a, (list, tuple)) else a

        got = _flat(fn(*[fake(a) for a in args]))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if isinstance(a, torch.Tensor):
            assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        elif not isinstance(b, torch.Tensor):
            assert a == b or name == "moe.get_fused_mapping"  # (its counts list is read off the device)
