"""engram_hash on a CPU host: the spec, its reference against a Python-int model of TileKernels' torch
reference, real runs on TileLang's C target, an sm_90a cross-compile, the torch op and the TileKernels
compat entry."""

import inspect

import pytest
import torch

import tkjit
import tkjit.ops
from tkjit.compat import tile_kernels as tk
from tkjit.errors import ConfigError, ShapeError, TensorError
from tkjit.testing import bit_equal, check

pytestmark = pytest.mark.usefixtures("module_cache")
NAME = "engram_hash"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def spec():
    return tkjit.get_spec(NAME)


def _shape(t=100, n=3, layers=2, e=8):
    return {"num_tokens": t, "max_ngram_size": n, "num_ngram_layers": layers, "num_embed_table_per_ngram": e}


def _wrap(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _model(ids, mult, vocab, offsets):
    """TileKernels' torch reference one Python int at a time: int64 products and xor (wrapped), Python's
    floor `%` (torch.remainder's sign rule), `.to(int32)`, then the int32 `+ offsets` (wrapped)."""
    ids, mult, vocab, offsets = (x.tolist() for x in (ids, mult, vocab, offsets))
    layers, n, e = len(mult), len(mult[0]), len(vocab[0][0])
    out = []
    for layer in range(layers):
        rows = []
        for tok in ids:
            h, row = _wrap(tok[0] * mult[layer][0], 64), []
            for i in range(1, n):
                h = _wrap(h ^ _wrap(tok[i] * mult[layer][i], 64), 64)
                for j in range(e):
                    v = vocab[layer][i - 1][j]
                    m = _wrap(h % v, 32)
                    row.append(_wrap(m + offsets[layer][(i - 1) * e + j], 32))
            rows.append(row)
        out.append(rows)
    return torch.tensor(out, dtype=torch.int32).view(layers, len(ids), (n - 1) * e)


def test_registered_and_valid():
    s = spec()
    assert s.family == "engram" and s.tolerance.exact
    assert [p.name for p in s.runtime_params] == ["num_tokens"]
    for ex in s.examples:
        full = s.canonical_shape(ex)
        assert s.default_config(full, "sm_90a") in s.configs(full, "sm_90a")
        assert s.default_config(full, "cpu") in s.configs(full, "cpu")
    full = s.canonical_shape({"num_tokens": 8192})  # TileKernels' defaults: N=3, 2 layers, 8 tables
    assert (full["max_ngram_size"], full["num_ngram_layers"], full["num_embed_table_per_ngram"]) == (3, 2, 8)
    assert s.default_config(full) == {"threads": 128, "vec": 4, "steps": 1}
    assert s.default_config(s.canonical_shape(_shape(t=1 << 20))) == {"threads": 128, "vec": 4, "steps": 2}
    assert len(s.configs(full)) == 60
    for e in (1, 2, 3, 5, 6, 8, 64):
        f = s.canonical_shape(_shape(e=e))
        assert s.constraint(f, s.default_config(f)) is None, e
    assert s.default_config(s.canonical_shape(_shape(e=6)))["vec"] == 2


@pytest.mark.parametrize("shape, match", [
    (_shape(n=1), "max_ngram_size"),
    (_shape(n=9), "max_ngram_size"),
    (_shape(layers=0), "num_ngram_layers"),
    (_shape(e=0), "num_embed_table_per_ngram"),
    (_shape(e=65), "num_embed_table_per_ngram"),
    (_shape(t=0), "num_tokens"),
    (_shape(t=1 << 26, layers=4, e=8), "exceeds int32"),
])
def test_bad_shapes(shape, match):
    with pytest.raises(ShapeError, match=match):
        spec().canonical_shape(shape)


def test_bad_configs():
    s = spec()
    full = s.canonical_shape(_shape(e=6))
    with pytest.raises(ConfigError, match="multiple of 4"):
        s.check_config(full, {"threads": 128, "vec": 4, "steps": 1})
    with pytest.raises(ConfigError):
        s.check_config(full, {"threads": 96, "vec": 2, "steps": 1})


def test_reference_hand_checked():
    s = spec()
    ids = torch.tensor([[1, 2, 3], [-1, 0, 0], [2**31 - 1, 2**31 - 1, -(2**31)]], dtype=torch.int32)
    mult = torch.tensor([[3, 5, 7]], dtype=torch.int64)
    vocab = torch.tensor([[[10, 11], [13, 17]]], dtype=torch.int32)
    offsets = torch.tensor([[0, 10, 21, 34]], dtype=torch.int32)
    out = s.reference(_shape(t=3, layers=1, e=2), ids, mult, vocab, offsets)
    # token 0: products 3, 10, 21; h1 = 3 ^ 10 = 9, h2 = 9 ^ 21 = 28
    assert out[0, 0].tolist() == [9 % 10, 9 % 11 + 10, 28 % 13 + 21, 28 % 17 + 34]
    # token 1: h = -3 (floor-mod: the sign of the table size), both prefixes
    assert out[0, 1].tolist() == [-3 % 10, -3 % 11 + 10, -3 % 13 + 21, -3 % 17 + 34] == [7, 18, 31, 48]
    assert bit_equal(out, _model(ids, mult, vocab, offsets))
    # Products past int64 wrap; offsets past int32 wrap.
    mult = torch.tensor([[2**62 + 1, -(2**63), 2**63 - 1]], dtype=torch.int64)
    offsets = torch.tensor([[2**31 - 1, 2**31 - 5, -(2**31), 7]], dtype=torch.int32)
    out = s.reference(_shape(t=3, layers=1, e=2), ids, mult, vocab, offsets)
    assert bit_equal(out, _model(ids, mult, vocab, offsets))
    assert int(out[0, 0, 0]) < 0  # 2**31 - 1 + a positive residue wrapped


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("n, layers, e", [(3, 2, 8), (2, 1, 3), (5, 3, 4)])
def test_reference_matches_the_int_model(seed, n, layers, e):
    s = spec()
    full = s.canonical_shape(_shape(t=40, n=n, layers=layers, e=e))
    ins = s.make_inputs(full, seed=seed)
    assert bit_equal(s.reference(full, *ins), _model(*ins))


def test_make_inputs_cover_the_wrapping_cases():
    s = spec()
    full = s.canonical_shape(_shape(t=200))
    ids, mult, vocab, offsets = s.make_inputs(full, seed=1)
    assert (ids.dtype, mult.dtype, vocab.dtype, offsets.dtype) == (torch.int32, torch.int64, torch.int32, torch.int32)
    assert bool((ids < 0).any()) and bool((mult < 0).any())
    assert bool((vocab == 1).any()) and bool((vocab == 2**31 - 1).any()) and bool((vocab >= 1).all())
    prods = [int(a) * int(b) for a, b in zip(ids[:, 0].tolist(), mult[0].tolist() * 200)]
    assert any(abs(p) >= 2**63 for p in prods)  # products that wrap
    ids, mult, vocab, offsets = s.make_inputs(full, seed=0)
    assert bool((ids >= 0).all()) and bool((mult % 2 == 1).all())
    flat = vocab.view(2, -1)
    assert torch.equal(offsets[:, 1:], flat[:, :-1].cumsum(1).int()) and not offsets[:, 0].any()
    assert s.bytes_moved(full) == 200 * 3 * 4 + 2 * (3 * 8 + 2 * 16 * 4) + 2 * 200 * 16 * 4


@pytest.mark.parametrize("n, layers, e", [(3, 2, 8), (2, 1, 3), (4, 3, 6)])
def test_c_target_runs_match_the_reference(n, layers, e):
    s = spec()
    full = s.canonical_shape(_shape(n=n, layers=layers, e=e))
    configs = [s.default_config(full, "cpu")]
    configs += [c for c in s.configs(full, "cpu") if c["threads"] == 64 and c["steps"] == 4][:2]
    for cfg in configs:
        kern = tkjit.get(NAME, full, arch="cpu", config=cfg)
        for t in (1, 7, 1001):
            for seed in (0, 1):
                assert check(kern, {**full, "num_tokens": t}, device="cpu", seed=seed) is None, (cfg, t)
        ins = s.make_inputs(s.canonical_shape({**full, "num_tokens": 1}))
        out = kern(torch.empty(0, n, dtype=torch.int32), *ins[1:])
        assert out.shape == (layers, 0, (n - 1) * e)


def test_zero_and_minus_one_table_sizes_divide_by_one(monkeypatch):
    s = spec()
    full = s.canonical_shape(_shape(t=5, layers=1, e=2))
    ids, mult, vocab, offsets = s.make_inputs(full, seed=1)
    vocab = torch.tensor([[[0, -1], [7, -7]]], dtype=torch.int32)
    out = tkjit.ops.engram_hash(ids, mult, vocab, offsets)
    assert torch.equal(out[0, :, :2], offsets[0, :2].expand(5, 2))  # h % 1 == 0: the offsets
    assert bit_equal(out, _model(ids, mult, torch.where(vocab.abs() <= 1, 1, vocab), offsets))
    assert bool((out[0, :, 3] - offsets[0, 3] <= 0).all())  # a negative size: residues in (-7, 0]
    monkeypatch.setenv("TKJIT_CHECK_INDICES", "1")
    with pytest.raises(TensorError, match=r"vocab_sizes\[0, 0, 0\] = 0 is out of range \[1, "):
        tkjit.ops.engram_hash(ids, mult, vocab, offsets)


def test_cross_compiles_for_sm90a():
    kern = tkjit.get(NAME, _shape(t=8192), arch="sm_90a")
    src = (kern.path / "kernel.cu").read_text()
    assert kern.config == {"threads": 128, "vec": 4, "steps": 1}
    assert "*(int4*)(output" in src  # 16-byte stores
    assert "(uint64_t)" in src and " % " in src  # unsigned products, a 64-bit remainder


# -- torch op ----------------------------------------------------------------------------------------

def _args(t=37, n=3, layers=2, e=8, seed=0):
    s = spec()
    return s.make_inputs(s.canonical_shape(_shape(t=max(t, 1), n=n, layers=layers, e=e)), seed=seed)


def test_op_opcheck_and_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.tkjit.engram_hash.default
    assert ("(Tensor ngram_token_ids, Tensor multipliers, Tensor vocab_sizes, Tensor offsets, str? config=None) "
            "-> Tensor") in str(op._schema)
    for t in (37, 0):
        ids, *rest = _args(t=37, seed=1)
        args = (ids[:t], *rest)
        assert torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS) == dict.fromkeys(OPCHECK_TESTS, "SUCCESS")
    with FakeTensorMode(allow_non_fake_inputs=True) as m:
        out = op(*(m.from_tensor(a) for a in _args(t=13, n=4, layers=3, e=2)))
        assert out.shape == (3, 13, 6) and out.dtype == torch.int32 and out.is_contiguous()
    out = op(*(a.to("meta") for a in _args(t=5)))
    assert out.shape == (2, 5, 16) and out.is_meta
    ids, mult, vocab, offsets = (a.to("meta") for a in _args(t=5))
    with pytest.raises(TensorError, match="multipliers has dtype torch.int32"):
        op(ids, mult.int(), vocab, offsets)
    with pytest.raises(TensorError, match="offsets has shape"):
        op(ids, mult, vocab, offsets[:, :8])
    with pytest.raises(TensorError, match="engram_hash: vocab_sizes: expected a 3-D"):
        op(ids, mult, vocab[0], offsets)
    with pytest.raises(ShapeError, match="max_ngram_size"):
        op(ids[:, :1], mult[:, :1], vocab[:, :0], offsets[:, :0])


def test_op_eager_and_compiled_are_bit_exact():
    args = _args(t=333, seed=1)
    want = _model(*args)
    assert bit_equal(tkjit.ops.engram_hash(*args), want)
    assert bit_equal(torch.ops.tkjit.engram_hash(*args), want)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(ids, mult, vocab, offsets):
        return tkjit.ops.engram_hash(ids + 0, mult, vocab, offsets) * 1

    assert bit_equal(f(*args), want)


# -- compat ------------------------------------------------------------------------------------------

def test_compat_signature_is_tile_kernels():
    params = inspect.signature(tk.engram.engram_hash).parameters.values()
    assert [(p.name, p.kind, p.default) for p in params] == [
        (name, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty)
        for name in ("ngram_token_ids", "multipliers", "vocab_sizes", "offsets")]


def test_compat_matches_the_int_model():
    for n, layers, e, seed in ((3, 2, 8, 0), (3, 2, 8, 1), (2, 1, 5, 3), (4, 2, 4, 5)):
        args = _args(t=129, n=n, layers=layers, e=e, seed=seed)
        out = tk.engram.engram_hash(*args)
        assert bit_equal(out, _model(*args)) and out.is_contiguous()
    ids, *rest = _args()
    out = tk.engram.engram_hash(ids[:0], *rest)
    assert out.shape == (2, 0, 16) and out.dtype == torch.int32
    # Views: a strided id tensor and tables that start off their vector alignment are read from copies.
    ids, mult, vocab, offsets = _args(t=50, seed=1)
    wide = torch.zeros(50, 5, dtype=torch.int32)
    wide[:, 1:4] = ids
    off2 = torch.zeros(offsets.numel() + 1, dtype=torch.int32)
    off2[1:] = offsets.view(-1)
    got = tk.engram.engram_hash(wide[:, 1:4], mult, vocab, off2[1:].view(offsets.shape))
    assert bit_equal(got, _model(ids, mult, vocab, offsets))


def _bad(**kw):
    ids, mult, vocab, offsets = _args()
    return {"ngram_token_ids": ids, "multipliers": mult, "vocab_sizes": vocab, "offsets": offsets, **kw}


@pytest.mark.parametrize("kw, err, match", [
    (lambda a: {"ngram_token_ids": a["ngram_token_ids"].long()}, TensorError, "ngram_token_ids must be torch.int32"),
    (lambda a: {"multipliers": a["multipliers"].int()}, TensorError, "multipliers must be torch.int64"),
    (lambda a: {"vocab_sizes": a["vocab_sizes"].long()}, TensorError, "vocab_sizes must be torch.int32"),
    (lambda a: {"offsets": a["offsets"].float()}, TensorError, "offsets must be torch.int32"),
    (lambda a: {"vocab_sizes": a["vocab_sizes"][0]}, TensorError, "vocab_sizes must be 3-D"),
    (lambda a: {"ngram_token_ids": [[1, 2, 3]]}, TensorError, "ngram_token_ids must be a torch.Tensor"),
    (lambda a: {"multipliers": a["multipliers"][:1]}, TensorError, r"multipliers has shape \(1, 3\), expected"),
    (lambda a: {"offsets": a["offsets"][:, :15]}, TensorError, r"offsets has shape \(2, 15\), expected \(2, 16\)"),
    (lambda a: {"vocab_sizes": a["vocab_sizes"][:, :1]}, TensorError, "vocab_sizes has shape"),
    (lambda a: {"ngram_token_ids": a["ngram_token_ids"][:, :1]}, ShapeError, "max_ngram_size .* must be >= 2"),
    (lambda a: {"vocab_sizes": a["vocab_sizes"][:, :, :0]}, ShapeError, "must be >= 1"),
])
def test_compat_argument_errors(kw, err, match):
    a = _bad()
    with pytest.raises(err, match=match):
        tk.engram.engram_hash(**{**a, **kw(a)})


def test_compat_sizes_tkjit_lacks_are_not_implemented():
    ids = torch.zeros(4, 9, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"engram_hash: max_ngram_size \(ngram_token_ids.shape\[1\]\)=9"):
        tk.engram.engram_hash(ids, torch.ones(1, 9, dtype=torch.int64), torch.ones(1, 8, 2, dtype=torch.int32),
                              torch.zeros(1, 16, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="num_embed_table_per_ngram .*=65"):
        tk.engram.engram_hash(ids[:, :2], torch.ones(1, 2, dtype=torch.int64), torch.ones(1, 1, 65, dtype=torch.int32),
                              torch.zeros(1, 65, dtype=torch.int32))
