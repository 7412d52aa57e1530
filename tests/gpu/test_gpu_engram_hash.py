"""engram_hash on the GPU: every config of the space bit-exact against the spec reference (wrapping
products, negative ids, extreme table sizes and offsets on odd seeds), the default config at every shape,
the TileKernels package as oracle, the op under torch.compile and CUDA graphs."""

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as compat
from tkjit.testing import check, check_configs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]
NAME = "engram_hash"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# (max_ngram_size, num_ngram_layers, num_embed_table_per_ngram): TileKernels' defaults first.
SHAPES = [(3, 2, 8), (2, 1, 3), (4, 3, 6), (3, 1, 1), (5, 2, 16), (8, 4, 64)]
ORACLE_SHAPES = SHAPES[:-1]  # TileKernels keeps 3 x 448 ints per thread at the last one: not a shape to hold it to


def _shape(n=3, layers=2, e=8, t=4001):
    return {"num_tokens": t, "max_ngram_size": n, "num_ngram_layers": layers, "num_embed_table_per_ngram": e}


def _inputs(n, layers, e, t, seed):
    spec = tkjit.get_spec(NAME)
    return spec.make_inputs(spec.canonical_shape(_shape(n, layers, e, t)), device="cuda", seed=seed)


@pytest.mark.parametrize("n, layers, e", [(3, 2, 8), (4, 1, 6)])
def test_every_config_in_the_space(n, layers, e):
    sizes = [{"num_tokens": t} for t in (1, 7, 4001, 65537)]
    failures = check_configs(NAME, [_shape(n, layers, e)], sizes, seeds=(0, 1))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("n, layers, e", SHAPES)
def test_default_config_and_empty_batch(n, layers, e):
    kern = tkjit.get(NAME, _shape(n, layers, e))
    big = min(1 << 20, (1 << 25) // (layers * (n - 1) * e))  # the CPU reference's int64 temporaries stay small
    for t in (1, 4001, big):
        for seed in (t, t + 1):  # an even and an odd seed: Engram's own data, then everything wrapping
            assert check(kern, _shape(n, layers, e, t), seed=seed) is None
    _, *tables = _inputs(n, layers, e, 1, 0)
    out = kern(torch.empty(0, n, dtype=torch.int32, device="cuda"), *tables)
    assert out.shape == (layers, 0, (n - 1) * e)


@pytest.mark.parametrize("n, layers, e", ORACLE_SHAPES)
def test_tile_kernels_is_the_oracle(n, layers, e):
    tk = pytest.importorskip("tile_kernels")
    from tile_kernels.torch.engram import engram_hash_ref, make_offsets

    for t, seed in ((1, 0), (4001, 0), (4001, 1), (65537, 2), (65537, 3)):
        ids, mult, vocab, offsets = _inputs(n, layers, e, t, seed)
        if seed % 2 == 0:
            offsets = make_offsets(vocab)  # TileKernels' own offsets (our even seeds compute the same)
        want = tk.engram.engram_hash(ids, mult, vocab, offsets)
        assert torch.equal(compat.engram.engram_hash(ids, mult, vocab, offsets), want), (t, seed)
        assert torch.equal(tkjit.ops.engram_hash(ids, mult, vocab, offsets), want), (t, seed)
        assert torch.equal(engram_hash_ref(ids, mult, vocab, offsets), want), (t, seed)


def test_bad_tensors_raise():
    kern = tkjit.get(NAME, _shape(t=64))
    ids, mult, vocab, offsets = _inputs(3, 2, 8, 64, 0)
    with pytest.raises(tkjit.TensorError, match="dtype"):
        kern(ids.long(), mult, vocab, offsets)
    with pytest.raises(tkjit.TensorError, match="axis 1 must be 16"):
        kern(ids, mult, vocab, offsets[:, :8].contiguous())
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        kern(ids, mult, vocab, offsets.t().contiguous().t())
    with pytest.raises(tkjit.TensorError, match="needs cuda"):
        kern(ids.cpu(), mult, vocab, offsets)
    with pytest.raises(tkjit.TensorError, match="multipliers must be torch.int64"):
        compat.engram.engram_hash(ids, mult.int(), vocab, offsets)


def test_op_opcheck_compile_and_cuda_graph():
    op = torch.ops.tkjit.engram_hash.default
    args = _inputs(3, 2, 8, 333, 1)
    assert torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    eager = tkjit.ops.engram_hash(*args)
    f = torch.compile(lambda *a: tkjit.ops.engram_hash(*a), fullgraph=True)
    assert torch.equal(f(*args), eager)
    ids = args[0]
    g = torch.cuda.CUDAGraph()
    tkjit.ops.engram_hash(*args)  # compiled and planned before capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        got = tkjit.ops.engram_hash(*args)
    ids.copy_(_inputs(3, 2, 8, 333, 3)[0])
    g.replay()
    torch.cuda.synchronize()
    want = tkjit.get_spec(NAME).reference({}, *(a.cpu() for a in args))
    assert torch.equal(got.cpu(), want)
