"""tkjit.compat.tile_kernels on a CPU host: TileKernels' public API, name for name and signature for
signature (against tests/data/tile_kernels_signatures.json, extracted from TileKernels 1.0.0's source by
tools/tile_kernels_signatures.py), the NotImplementedError of every op and option tkjit lacks, and the
return values' dtypes, shapes and strides.

sinkhorn_normalize and transpose run for real on TileLang's C target. topk_gate and per_token_cast are
CUDA-only kernels: here they run as CompiledKernels whose launch writes the spec's reference, so the
compat layer's checks, layouts and return types are exercised all the same
(tests/gpu/test_gpu_compat_tile_kernels.py compares them with TileKernels on the GPU).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tkjit
import tkjit.compat.tile_kernels as tk
import tkjit.torch_ops

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")  # one cache: each C-target kernel compiles once

ROOT = Path(__file__).resolve().parent.parent
DATA = json.loads((ROOT / "tests" / "data" / "tile_kernels_signatures.json").read_text())
MODULES = DATA["modules"]
# What tkjit serves; every other function of the list raises NotImplementedError.
SERVED = {
    "config": {"get_device_num_sms", "set_num_sms", "get_num_sms", "get_max_smem_per_sm"},
    "": {"get_num_sms", "get_device_num_sms", "set_num_sms"},
    "moe": {"get_fused_mapping", "topk_gate", "normalize_weight", "mask_indices_by_tp", "inplace_unique_group_indices",
            "group_count", "aux_fi", "topk_sum_and_topk_group_idx", "expand_to_fused", "reduce_fused",
            "expand_to_fused_with_sf", "top2_sum_gate"},
    "quant": {"per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf",
              "unpack_from_e2m1fn_x2", "cast_back",
              "per_token_cast_back", "per_block_cast", "per_block_cast_with_sf_only",
              "per_block_cast_with_precomputed_sf", "per_channel_cast", "per_channel_cast_and_transpose",
              "per_channel_cast_fused", "swiglu_forward_and_per_token_cast",
              "swiglu_backward_and_per_token_cast",
              "swiglu_forward_and_per_channel_cast_and_transpose", "per_block_cast_lossless"},
    "transpose": {"transpose", "batched_transpose"},
    "modeling.mhc.ops": {"sinkhorn_normalize", "expand_to_mhc", "mhc_pre_apply_mix", "mhc_post", "mhc_post_fwd",
                         "mhc_post_bwd", "mhc_head_compute_mix", "mhc_pre_split_mixes", "mhc_pre_norm_fn",
                         "mhc_multilayer_recompute", "mhc_pre_big_fuse"},
    "modeling.mhc": {"expand_from_embedding", "mhc_pre", "mhc_head"},
    "engram": {"engram_hash", "fused_weight", "engram_gate_fwd", "engram_gate_bwd", "grad_w_reduce"},
}
FAMILY = {"engram": "engram", "modeling.engram": "engram", "modeling.mhc": "mhc", "modeling.mhc.ops": "mhc",
          "moe": "moe", "quant": "quant"}
CUDA_ONLY = ("topk_gate", "per_token_cast", "per_token_cast_colmajor")


def _module(name: str):
    return importlib.import_module("tkjit.compat.tile_kernels" + (f".{name}" if name else ""))


def _functions():
    return [(m, n, r) for m, names in MODULES.items() for n, r in names.items() if r["kind"] == "function"]


# -- the committed list ---------------------------------------------------------------------------

def test_the_list_is_tile_kernels_1_0_0():
    assert DATA["package"] == "tile_kernels" and DATA["version"] == "1.0.0" == tk.__version__
    assert set(MODULES) == {"", "config", "engram", "mhc", "modeling", "modeling.engram", "modeling.mhc",
                            "modeling.mhc.ops", "moe", "quant", "transpose"}
    assert MODULES["quant"]["per_token_cast"]["params"][3] == {
        "name": "x_block_size", "kind": "positional_or_keyword", "default": "None",
        "annotation": "Optional[tuple[int, int]]"}
    assert len(_functions()) == 56


def test_the_list_is_the_generators_output_where_tile_kernels_is_installed():
    """Where TileKernels is installed (its source is found, never imported), the committed list is what
    the generator extracts from it: a newer TileKernels shows up here as a diff."""
    spec = importlib.util.find_spec("tile_kernels")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("tile_kernels is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "tile_kernels_signatures.py"), str(root)],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == DATA


def test_generator_reads_source_without_importing(tmp_path):
    """The generator follows re-exports, aliases and plain modules on a tiny package of its own."""
    pkg = tmp_path / "tile_kernels"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import tilelang\nfrom . import sub, config\nfrom .config import f\n")
    (pkg / "_version.py").write_text("__version__ = version = '9.9'\n")
    (pkg / "config.py").write_text("import torch\n_x = 0\ndef f(a: int, *b, c=1e-6, **d) -> int: ...\n"
                                   "def _private(): ...\n")
    (pkg / "sub" / "__init__.py").write_text("from .impl import g, G, h\n")
    (pkg / "sub" / "impl.py").write_text(
        "class G(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x): ...\n"
        "def g(x, /, y: 'T' = (32, 32), *, z: str = 'e4m3'): ...\nh = G.apply\n")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import tile_kernels_signatures as gen

        # Another test may have imported tilelang already: what counts is what extract() imports.
        before = set(sys.modules)
        real = gen.MIRRORED
        gen.MIRRORED = ("", "config", "sub")
        data = gen.extract(pkg)
    finally:
        gen.MIRRORED = real
        sys.path.remove(str(ROOT / "tools"))
    assert data["version"] == "9.9"
    assert not {"tilelang", "torch", "tile_kernels"} & (set(sys.modules) - before)
    mods = data["modules"]
    assert mods[""] == {"sub": {"kind": "module"}, "config": {"kind": "module"}, "f": mods["config"]["f"]}
    assert gen.signature_text(mods["config"]["f"]) == "(a: int, *b, c=1e-06, **d) -> int"
    assert gen.signature_text(mods["sub"]["g"]) == "(x, /, y: 'T' = (32, 32), *, z: str = 'e4m3')"
    assert mods["sub"]["h"] == {"kind": "alias", "value": "G.apply"}
    assert mods["sub"]["G"]["methods"]["forward"]["params"][0]["name"] == "ctx"


# -- names and signatures ---------------------------------------------------------------------------

class _Modernise(ast.NodeTransformer):
    """Optional[X] -> X | None, Union[A, B] -> A | B: TileKernels' annotations spell them the old way,
    ours the way the linter asks for; the types are the same."""

    def visit_Subscript(self, node):
        node = self.generic_visit(node)
        name = getattr(node.value, "id", None)
        if name not in ("Optional", "Union"):
            return node
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if name == "Optional":
            items = [*items, ast.Constant(None)]
        out = items[0]
        for item in items[1:]:
            out = ast.BinOp(out, ast.BitOr(), item)
        return out


def _annotation(text):
    if text is None or text is inspect.Parameter.empty:
        return None
    return ast.unparse(_Modernise().visit(ast.parse(text, mode="eval")))


def _default(value):
    return None if value is inspect.Parameter.empty else value


def _same_default(ours, theirs: str | None) -> bool:
    if theirs is None:
        return ours is None
    if repr(ours) == theirs:
        return True
    try:
        return type(ours) is type(ast.literal_eval(theirs)) and ours == ast.literal_eval(theirs)
    except ValueError:
        return False


def _check_function(fn, rec, where):
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    assert [p.name for p in params] == [p["name"] for p in rec["params"]], where
    for ours, theirs in zip(params, rec["params"]):
        assert ours.kind.name.lower() == theirs["kind"], (where, ours.name)
        assert _same_default(_default(ours.default), theirs["default"]), (where, ours.name, ours.default)
        assert _annotation(ours.annotation) == _annotation(theirs["annotation"]), (where, ours.name)
    assert _annotation(sig.return_annotation) == _annotation(rec["returns"]), (where, "return")


@pytest.mark.parametrize("module", list(MODULES), ids=lambda m: m or "tile_kernels")
def test_every_public_name_with_its_signature(module):
    mod = _module(module)
    for name, rec in MODULES[module].items():
        if name in DATA["not_mirrored"] and not module:
            continue
        where = f"{module}.{name}"
        assert hasattr(mod, name), f"missing: {where}"
        obj = getattr(mod, name)
        if rec["kind"] == "module":
            assert inspect.ismodule(obj) and obj.__name__.endswith(f".{name}"), where
        elif rec["kind"] == "function":
            assert callable(obj) and not inspect.isclass(obj), where
            _check_function(obj, rec, where)
        elif rec["kind"] == "class":
            assert inspect.isclass(obj), where
            assert [f"{b.__module__}.{b.__qualname__}" for b in obj.__bases__] == [
                b.replace("torch.autograd.Function", "torch.autograd.function.Function") for b in rec["bases"]]
            for method, mrec in rec["methods"].items():
                _check_function(getattr(obj, method), mrec, f"{where}.{method}")
        elif rec["kind"] == "alias":
            assert obj == eval(rec["value"], vars(mod)), where  # e.g. engram_gate is EngramGateFn.apply
        else:
            raise AssertionError(rec)


@pytest.mark.parametrize("module", list(MODULES), ids=lambda m: m or "tile_kernels")
def test_no_public_name_tile_kernels_does_not_have(module):
    mod = _module(module)
    public = set(getattr(mod, "__all__", ()))
    theirs = set(MODULES[module]) - set(DATA["not_mirrored"] if not module else ())
    submodules = {n for n in public if inspect.ismodule(getattr(mod, n))}
    assert public - submodules == theirs - submodules
    for name, obj in vars(mod).items():  # what the module defines itself, exported or not
        if not name.startswith("_") and getattr(obj, "__module__", None) == mod.__name__ and callable(obj):
            assert name in theirs, f"{module}.{name} is not TileKernels API (make it private)"


def test_torch_references_and_test_helpers_are_not_mirrored():
    for name in ("torch", "testing"):
        with pytest.raises(AttributeError, match=f"does not mirror tile_kernels.{name}"):
            getattr(tk, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tk.nope  # noqa: B018


def test_import_pulls_in_neither_tile_kernels_nor_tilelang():
    code = textwrap.dedent("""
        import sys
        import tkjit.compat.tile_kernels as tile_kernels
        import tkjit.compat.tile_kernels.modeling.mhc.ops
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("tile_kernels", "tilelang", "tvm")))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]"]


def test_no_tkjit_source_imports_tile_kernels():
    bad = []
    for path in (ROOT / "tkjit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "tile_kernels"]
    assert bad == []


# -- what tkjit lacks: NotImplementedError naming the op and the family -----------------------------

@pytest.mark.parametrize("module, name", [(m, n) for m, n, _ in _functions() if n not in SERVED.get(m, ())])
def test_unserved_ops_raise_not_implemented_naming_op_and_family(module, name):
    fn = getattr(_module(module), name)
    rec = MODULES[module][name]
    args = [None for p in rec["params"] if p["default"] is None and p["kind"] == "positional_or_keyword"]
    kwargs = {p["name"]: None for p in rec["params"] if p["default"] is None and p["kind"] == "keyword_only"}
    with pytest.raises(NotImplementedError) as err:
        fn(*args, **kwargs)
    fam = FAMILY[module]
    assert str(err.value) == (f"tile_kernels.{module}.{name}: tkjit has no kernel for this op yet; it will come "
                              f"with tkjit's '{fam}' kernel family (kernel_specs/{fam}/)")


def test_engram_gate_checks_its_tensors():
    # served (tests/test_spec_engram_gate_bwd.py runs it): float32 tensors are refused naming the argument
    x = torch.zeros(2, 4, 512, requires_grad=True)
    for f in (tk.modeling.engram.engram_gate, tk.modeling.engram.EngramGateFn.apply):
        with pytest.raises(tkjit.TensorError, match=r"engram.fused_weight: weight_hidden must be torch.bfloat16"):
            f(x, x, x[:, 0], x[0], x[0], 1.0, 1e-6)


def _cast(x=None, *a, **kw):
    return tk.quant.per_token_cast(torch.zeros(4, 256) if x is None else x, *a, **kw)


@pytest.mark.parametrize("call, option", [
    (lambda: _cast(torch.zeros(4, 200), "e4m3", 32), "hidden (x.shape[1])=200"),
    (lambda: _cast(torch.zeros(3, 1 << 16 + 1), "e4m3", 128), "hidden (x.shape[1])=131072"),
    (lambda: tk.moe.topk_gate(torch.zeros(4, 2048), 8), "num_experts (scores.shape[1])=2048"),
    (lambda: tk.transpose.transpose(torch.zeros(4, 4, dtype=torch.bool)), "x.dtype='bool'"),
    (lambda: tk.transpose.batched_transpose(torch.zeros(4, 4, 4, dtype=torch.complex64)), "x.dtype='torch.complex64'"),
    (lambda: tk.modeling.mhc.ops.sinkhorn_normalize(torch.zeros(4, 17, 17)), "n (x.shape[-1])=17"),
    (lambda: tk.modeling.mhc.ops.sinkhorn_normalize(torch.zeros(4, 4, 4), 0), "repeat=0"),
    (lambda: tk.modeling.mhc.ops.sinkhorn_normalize(torch.zeros(4, 4, 4), 10, -1.0), "eps=-1.0"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_unsupported_options_raise_not_implemented_naming_the_option(call, option):
    with pytest.raises(NotImplementedError) as err:
        call()
    msg = str(err.value)
    assert msg.startswith("tile_kernels.") and f": {option}" in msg, msg
    assert "is not supported by tkjit yet; it will come with tkjit's '" in msg


@pytest.mark.parametrize("call, error, match", [
    (lambda: _cast(None, "e3m4", 32), tkjit.ShapeError, "fmt must be one of"),
    (lambda: _cast(None, "e4m3", 32, None, False, True, True), tkjit.ShapeError,
     "use_packed_ue8m0=True needs use_tma_aligned_col_major_sf=True"),
    (lambda: _cast(None, "e4m3", 48), tkjit.ShapeError, "num_per_channels=48 must be one of"),
    (lambda: _cast(None, "e4m3", 32, (1, 128)), tkjit.ShapeError, "is for a \\(values, scales\\) x only"),
    (lambda: _cast(torch.zeros(4, 96), "e4m3", 96), tkjit.ShapeError, r"equal to hidden \(96\) when hidden"),
    (lambda: _cast(None, "e4m3", "32"), tkjit.ShapeError, "num_per_channels must be an int"),
    (lambda: _cast(torch.zeros(4, 256, dtype=torch.float16), "e4m3", 32), tkjit.TensorError, "x must be"),
    (lambda: _cast(torch.zeros(2, 4, 256), "e4m3", 32), tkjit.TensorError, "x must be 2-D"),
    (lambda: tk.quant.per_token_cast_with_sf_only(torch.zeros(4, 256), "e5m6", 32), tkjit.ShapeError,
     "no scales-only form"),
    (lambda: _cast(None, "e5m6", 32), tkjit.ShapeError, r"num_per_channels == hidden \(256\)"),
    (lambda: tk.moe.topk_gate(torch.zeros(4, 8), 9), tkjit.ShapeError, r"num_topk \(9\) must be in \[1, "),
    (lambda: tk.moe.topk_gate(torch.zeros(4, 8), 0), tkjit.ShapeError, "num_topk"),
    (lambda: tk.moe.topk_gate(torch.zeros(4, 8, dtype=torch.float16), 2), tkjit.TensorError, "float32"),
    (lambda: tk.moe.topk_gate(torch.zeros(8), 2), tkjit.TensorError, "2-D"),
    (lambda: tk.transpose.transpose(torch.zeros(2, 4, 4)), tkjit.TensorError, "x must be 2-D"),
    (lambda: tk.transpose.batched_transpose(torch.zeros(4, 4)), tkjit.TensorError, "x must be 3-D"),
    (lambda: tk.transpose.transpose([[1]]), tkjit.TensorError, "must be a torch.Tensor"),
    (lambda: tk.modeling.mhc.ops.sinkhorn_normalize(torch.zeros(4, 4, 3)), tkjit.TensorError, r"\(\.\.\., n, n\)"),
    (lambda: tk.modeling.mhc.ops.sinkhorn_normalize(torch.zeros(4, 4, 4).double()), tkjit.TensorError, "float32"),
    (lambda: tk.quant.unpack_from_e2m1fn_x2(torch.zeros(4)), tkjit.TensorError, "int8 or uint8"),
    (lambda: tk.quant.unpack_from_e2m1fn_x2(torch.tensor(3, dtype=torch.uint8)), ValueError, "at least 1 dim"),
])
def test_input_tile_kernels_refuses_is_refused_naming_it(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -- config ---------------------------------------------------------------------------------------------

def test_num_sms_is_process_wide(monkeypatch):
    monkeypatch.setattr(tk.config, "_num_sms", 0)
    tk.set_num_sms(20)
    assert tk.get_num_sms() == tk.config.get_num_sms() == 20
    tk.config.set_num_sms(torch.tensor(7).item())
    assert tk.get_num_sms() == 7
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(tkjit.ShapeError, match="num_sms"):
            tk.set_num_sms(bad)
    assert tk.get_num_sms() == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU host's answer")
def test_device_queries_without_a_gpu_say_so(monkeypatch):
    monkeypatch.setattr(tk.config, "_num_sms", 0)
    for f in (tk.get_device_num_sms, tk.get_num_sms, tk.config.get_max_smem_per_sm):
        with pytest.raises(tkjit.TkjitError, match="no CUDA GPU found"):
            f()


# -- served ops: results, dtypes, shapes, strides ---------------------------------------------------

@pytest.fixture
def reference_kernels(monkeypatch):
    """The CUDA-only kernels as CPU CompiledKernels that write their reference (real shape checks and
    output allocation; the launch is torch)."""
    serve_references(monkeypatch, CUDA_ONLY)


def _sinkhorn_ref(x, repeat=10, eps=1e-6):  # TileKernels' sinkhorn_normalize_ref
    x = x.softmax(-1) + eps
    x = x / (x.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        x = x / (x.sum(-1, keepdim=True) + eps)
        x = x / (x.sum(-2, keepdim=True) + eps)
    return x


@pytest.mark.parametrize("shape", [(37, 4, 4), (2, 3, 4, 4), (4, 4), (0, 4, 4)])
def test_sinkhorn_normalize_forward_and_backward(shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g).requires_grad_()
    y = tk.modeling.mhc.ops.sinkhorn_normalize(x)
    assert y.shape == x.shape and y.dtype == torch.float32 and y.is_contiguous()
    xr = x.detach().clone().requires_grad_()
    ref = _sinkhorn_ref(xr)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn(*shape, generator=g)
    y.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)


def test_sinkhorn_normalize_takes_a_non_contiguous_x_and_positional_args():
    x = torch.randn(4, 4, 6)[:, :, :4].transpose(1, 2)
    assert not x.is_contiguous()
    y = tk.modeling.mhc.ops.sinkhorn_normalize(x, 10, 1e-6)
    torch.testing.assert_close(y, _sinkhorn_ref(x), rtol=1e-5, atol=1e-6)
    assert y.is_contiguous() and y.shape == x.shape


@pytest.mark.parametrize("dynamic", [False, True])
def test_compat_ops_trace_in_one_graph(dynamic):
    # The compat layer's shape checks run at trace time (a constant of the graph): a compat op compiles with
    # fullgraph=True, static or dynamic shapes, and a size tkjit lacks is still named as NotImplementedError.
    f = torch.compile(lambda x: tk.modeling.mhc.ops.sinkhorn_normalize(x, 10, 1e-6) * 2, fullgraph=True,
                      backend="aot_eager", dynamic=dynamic)
    for shape in ((3, 4, 4), (5, 4, 4), (2, 2, 2)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
        torch.testing.assert_close(f(x), _sinkhorn_ref(x) * 2, rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match=r"sinkhorn_normalize: n \(x.shape\[-1\]\)=33 .* not supported by tkjit"):
        f(torch.randn(2, 33, 33))


def _tk_transpose_expect(x):
    return x.transpose(-1, -2).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_transpose_and_batched_transpose_are_bit_exact(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-(2**30), 2**30, (3, 128, 64), generator=g, dtype=torch.int32).view(dtype)
    for fn, t in ((tk.transpose.transpose, x[1]), (tk.transpose.batched_transpose, x)):
        y = fn(t)
        want = _tk_transpose_expect(t)
        assert y.dtype == t.dtype and y.shape == want.shape and y.stride() == want.stride()
        assert torch.equal(y.view(torch.int32), want.view(torch.int32))


def test_transpose_row_strided_views_in_place_or_copied():
    buf = torch.randn(128, 200)
    aligned = buf[:, 8:8 + 64]  # rows 800 bytes apart: not on 32 bytes, copied first
    assert torch.equal(tk.transpose.transpose(aligned), _tk_transpose_expect(aligned))
    wide = torch.randn(128, 256)[:, 64:128]  # rows 1024 bytes apart, start 256 bytes in: read in place
    assert torch.equal(tk.transpose.transpose(wide), _tk_transpose_expect(wide))
    batched = torch.randn(2, 64, 136)[:, :, 4:68]
    assert torch.equal(tk.transpose.batched_transpose(batched), _tk_transpose_expect(batched))


@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (0, 0)])
def test_transpose_of_empty_tensors(shape):
    x = torch.empty(shape)
    assert tk.transpose.transpose(x).shape == shape[::-1]
    assert tk.transpose.batched_transpose(x[None].expand(3, *shape)).shape == (3, *shape[::-1])


def test_rows_aligned_copies_only_misaligned_views():
    from tkjit.compat.tile_kernels._support import rows_aligned

    x = torch.randn(8, 64)
    assert rows_aligned(x) is x
    assert rows_aligned(torch.randn(8, 128)[:, 64:]).data_ptr() != 0
    v = torch.randn(8, 128)[:, 64:]
    assert rows_aligned(v) is v
    odd = torch.randn(8, 68)[:, 4:]  # rows 272 bytes apart
    copy = rows_aligned(odd)
    assert copy is not odd and copy.is_contiguous() and torch.equal(copy, odd)
    shifted = torch.randn(65)[1:]  # contiguous, but 4 bytes off the allocation's alignment
    assert rows_aligned(shifted) is not shifted and torch.equal(rows_aligned(shifted), shifted)


def test_topk_gate_returns_tile_kernels_layout(reference_kernels):
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(37, 64, generator=g).round(decimals=1)  # ties: the smaller index first
    idx = tk.moe.topk_gate(scores, 6)
    assert idx.dtype == torch.int64 and idx.shape == (37, 6) and idx.stride() == (6, 1)
    assert torch.equal(idx, torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :6])
    assert torch.equal(tk.moe.topk_gate(scores, num_topk=1), scores.argmax(1, keepdim=True))


@pytest.mark.parametrize("num_experts", [64, 72, 2048])
def test_topk_gate_of_no_tokens_launches_nothing(num_experts):
    """TileKernels returns an empty (0, num_topk) int64 tensor without a kernel, for any expert count."""
    idx = tk.moe.topk_gate(torch.empty(0, num_experts), 8)
    assert idx.shape == (0, 8) and idx.dtype == torch.int64


def _tk_scale_layout(num_tokens, num_groups, col_major):
    """Shape and strides of TileKernels' scales (alloc_scaling_factors + cast_epilogue, float32)."""
    if col_major:
        aligned = -(-num_tokens // 4) * 4
        t = torch.empty(num_groups, aligned)[:, :num_tokens].T
    else:
        t = torch.empty(num_tokens, num_groups)
    return tuple(t.shape), t.stride()


def _cast_ref(x, group, round_sf):
    """TileKernels' torch reference `cast` for 1 x group blocks (e4m3), with its partial-group masking."""
    n, h = x.shape
    ng = -(-h // group)
    xf = torch.nn.functional.pad(x.float(), (0, ng * group - h)).view(n, ng, group)
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    sf = amax / torch.full_like(amax, 448.0)
    if round_sf:
        sf = ((sf.view(torch.int32) + 0x007FFFFF) & 0x7F800000).view(torch.float32)
        inv = 1.0 / sf
    else:
        inv = torch.full_like(amax, 448.0) / amax
    q = (xf * inv).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, ng * group)[:, :h]
    return q, sf.view(n, ng)


@pytest.mark.parametrize("col_major", [False, True])
@pytest.mark.parametrize("num_tokens, hidden, group, dtype, round_sf", [
    (37, 256, 128, torch.bfloat16, False),
    (37, 256, 64, torch.float32, True),
    (5, 576, 128, torch.bfloat16, False),  # partial last group: 4.5 groups -> 5 scales
    (9, 512, 512, torch.bfloat16, True),  # one scale per token
    (6, 256, 16, torch.float32, False),
    (0, 256, 128, torch.bfloat16, False),
])
def test_per_token_cast_returns_tile_kernels_layout(reference_kernels, col_major, num_tokens, hidden, group, dtype,
                                                    round_sf):
    g = torch.Generator().manual_seed(num_tokens + hidden)
    x = (torch.randn(num_tokens, hidden, generator=g) * torch.exp(torch.randn(num_tokens, 1, generator=g))).to(dtype)
    out = tk.quant.per_token_cast(x, "e4m3", group, use_tma_aligned_col_major_sf=col_major, round_sf=round_sf)
    assert type(out) is tuple and len(out) == 2
    q, sf = out
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    assert sf.dtype == torch.float32
    shape, strides = _tk_scale_layout(num_tokens, -(-hidden // group), col_major)
    assert tuple(sf.shape) == shape
    if num_tokens:
        assert sf.stride() == strides
        q_ref, sf_ref = _cast_ref(x, group, round_sf)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf, sf_ref)
    only = tk.quant.per_token_cast_with_sf_only(x, "e4m3", group, None, col_major, round_sf)
    assert tuple(only.shape) == shape and (not num_tokens or (only.stride() == strides and torch.equal(only, sf)))


def _packed_ref(sf):
    """TileKernels' reference packing (tile_kernels.torch.cast, step 6), from (num_tokens, num_groups) float32
    scales: exponent fields padded to align(tokens, 4) x align(groups, 4), int8, viewed as int32, column-major."""
    bits = sf.view(torch.int32)
    padded = torch.nn.functional.pad(bits, (0, (-bits.shape[1]) % 4, 0, (-bits.shape[0]) % 4))
    return (padded >> 23).to(torch.int8).view(torch.int32).T.contiguous().T[: sf.shape[0], :]


@pytest.mark.parametrize("num_tokens, hidden, group, round_sf", [
    (37, 256, 32, True),  # 8 groups: two words per token
    (5, 576, 128, True),  # 5 groups (partial last): the second word holds one exponent, three zeros
    (9, 512, 64, False),  # exponents of unrounded scales, truncated (as TileKernels' reference)
    (4, 1024, 16, True),
    (0, 256, 32, True),
])
def test_per_token_cast_packed_ue8m0_is_tile_kernels_layout(reference_kernels, num_tokens, hidden, group, round_sf):
    g = torch.Generator().manual_seed(num_tokens + group)
    x = (torch.randn(num_tokens, hidden, generator=g) * torch.exp(3 * torch.randn(num_tokens, 1, generator=g)))
    q, sf = tk.quant.per_token_cast(x.bfloat16(), "e4m3", group, None, True, round_sf, True)
    groups = -(-hidden // group)
    assert sf.dtype == torch.int32 and tuple(sf.shape) == (num_tokens, -(-groups // 4))
    if not num_tokens:
        return
    assert sf.stride() == (1, -(-num_tokens // 4) * 4)  # column-major, TMA-aligned, as TileKernels
    q_ref, sf_ref = _cast_ref(x.bfloat16(), group, round_sf)
    want = _packed_ref(sf_ref)
    assert torch.equal(sf, want) and sf.stride() == want.stride()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # Each byte is the exponent of its group's float32 scale: 2^(e - 127) is the scale when rounded.
    exps = sf.contiguous().view(torch.uint8).view(num_tokens, -1)[:, :groups].to(torch.int32)
    assert torch.equal(exps, sf_ref.view(torch.int32) >> 23)
    if round_sf:
        assert torch.equal(torch.pow(2.0, (exps - 127).float()), sf_ref)
    only = tk.quant.per_token_cast_with_sf_only(x.bfloat16(), "e4m3", group, None, True, round_sf, True)
    assert torch.equal(only, sf) and only.stride() == sf.stride()


def test_per_token_cast_takes_a_row_strided_x(reference_kernels):
    buf = torch.randn(7, 512, dtype=torch.bfloat16)
    for x in (buf[:, 128:384], buf[:, 8:264]):  # rows 1024 bytes apart; the second starts 16 bytes in
        q, sf = tk.quant.per_token_cast(x, "e4m3", 128)
        q_ref, sf_ref = _cast_ref(x, 128, False)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf, sf_ref)


def test_unpack_from_e2m1fn_x2_decodes_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    e2m1 = values + [-v for v in values]
    want = torch.tensor([[e2m1[c & 15], e2m1[c >> 4]] for c in range(256)]).view(16, 32)
    for x in (codes.view(16, 16), codes.view(torch.int8).view(16, 16)):
        out = tk.quant.unpack_from_e2m1fn_x2(x)
        assert out.dtype == torch.float32 and out.shape == (16, 32)
        assert torch.equal(out, want) and torch.equal(torch.signbit(out), torch.signbit(want))
    assert tk.quant.unpack_from_e2m1fn_x2(codes[:4], torch.bfloat16).dtype == torch.bfloat16
