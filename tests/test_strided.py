"""Row-strided inputs: a view such as `buf[:, off:off + cols]` of a wider buffer runs on its own
strides (runtime args of the kernel: one binary serves every stride), bit-exact with the contiguous
input; other layouts and rows that do not start on the kernel's vector width are refused, naming
the argument. transpose runs on the C target here; per_token_cast is cross-compiled for sm_90a."""

import json
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tkjit
import tkjit.ops
from tkjit import loader
from tkjit_kernels.transpose import transpose as tmod

pytestmark = pytest.mark.usefixtures("module_cache")  # one cache: each kernel compiles once


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    return t.view(_BITS[t.element_size()])


def _buffer(dtype, rows, width, seed, batch=None):
    """Fresh random bits of the dtype (no NaN: the poison), `width` wide."""
    shape = {"dtype": dtype, "cols": width, "rows": rows, **({"batch": batch} if batch else {})}
    return tmod.make_inputs(shape, seed=seed)[0]


def _poisoned(shape, dtype):
    t = torch.empty(shape, dtype=dtype)
    return t.fill_(float("nan")) if dtype.is_floating_point else t.fill_(-1)


def _kernel(dtype, cols, name="transpose", **runtime):
    return tkjit.get(name, {"dtype": dtype, "cols": cols, "rows": 64, **runtime}, arch="cpu")


# (dtype, cols, [(rows, buffer width, column offset)]): x = buf[:, off:off + cols]. The load width is
# the largest power of two dividing cols (capped at 16 bytes): odd cols take views at any offset.
STRIDED = [
    ("float32", 67, [(33, 72, 3), (130, 200, 5), (1, 68, 1), (64, 67 + 64, 0)]),
    ("float32", 64, [(33, 68, 4), (130, 128, 8), (1, 72, 0), (65, 256, 64)]),
    ("float16", 9, [(33, 16, 3), (257, 40, 7), (2, 10, 1)]),
    ("float16", 130, [(33, 136, 2), (129, 260, 6)]),
    ("float16", 64, [(17, 72, 8), (256, 128, 0)]),
]


@pytest.mark.parametrize("dtype, cols, views", STRIDED, ids=[f"{d}-{c}" for d, c, _ in STRIDED])
def test_strided_transpose_is_bit_exact(dtype, cols, views):
    k = _kernel(dtype, cols)
    for seed, (rows, width, off) in enumerate(views):
        buf = _buffer(dtype, rows, width, seed)
        x = buf[:, off:off + cols]
        assert x.stride() == (width, 1) and (rows == 1 or not x.is_contiguous())
        want = k(x.contiguous())
        assert torch.equal(_bits(want), _bits(x.T.contiguous()))
        out = _poisoned((cols, rows), x.dtype)
        got = k(x, out=out)
        assert got is out
        assert torch.equal(_bits(got), _bits(want)), (rows, width, off)
        assert torch.equal(buf[:, off:off + cols], x)  # the input is only read
    # One binary serves every stride (and every row count).
    assert _kernel(dtype, cols, rows=7).key == k.key


def test_batched_strided_transpose_is_bit_exact():
    k = _kernel("float32", 130, name="batched_transpose", batch=3)
    buf = _buffer("float32", 70, 140, seed=3, batch=5)
    views = [
        buf[:3, :64, 2:132],  # sliced on every axis
        buf[1:4, 3:67, 4:134],
        buf.permute(1, 0, 2)[:3, :64, 6:136],  # batch stride < row stride
        buf[:1, :1, :130],
    ]
    for x in views:
        out = _poisoned((x.shape[0], 130, x.shape[1]), x.dtype)
        k(x, out=out)
        assert torch.equal(_bits(out), _bits(x.transpose(1, 2).contiguous())), x.stride()


@pytest.mark.parametrize(
    "dtype, cols, width, off, align",
    [
        ("float32", 64, 68, 3, 16),  # start 12 bytes into a row
        ("float32", 64, 66, 0, 16),  # row stride 264 bytes: the second row starts misaligned
        ("float16", 130, 136, 1, 4),  # 2-element (4-byte) loads, odd start
        ("float16", 64, 72, 4, 16),
    ],
)
def test_misaligned_rows_are_refused_with_the_reason(dtype, cols, width, off, align):
    k = _kernel(dtype, cols)
    x = _buffer(dtype, 8, width, seed=0)[:, off:off + cols]
    with pytest.raises(tkjit.TensorError, match=rf"input x is a view whose rows are not {align}-byte aligned") as e:
        k(x)
    assert "vector" in str(e.value) and "strides" in str(e.value)
    # The same view copied is accepted (the kernel never makes a misaligned vector load).
    assert torch.equal(_bits(k(x.contiguous())), _bits(x.T.contiguous()))


def test_other_layouts_are_refused_naming_the_argument():
    k = _kernel("float32", 64)
    buf = torch.randn(64, 128)
    for x in (
        torch.randn(64, 64).T,  # column-major: last axis not contiguous
        buf[:, ::2],  # every other element
        torch.as_strided(buf, (8, 64), (32, 1)),  # rows overlap
    ):
        with pytest.raises(tkjit.TensorError, match=r"input x must have a contiguous last axis") as e:
            k(x)
        assert f"got {x.stride()}" in str(e.value) and "expected strides (>= 64, 1)" in str(e.value)
    # Outputs are not strided: a view is refused as before.
    with pytest.raises(tkjit.TensorError, match="output y must be contiguous"):
        k(buf[:, :64], out=torch.empty(64, 128)[:, :64])


def test_the_abi_records_the_stride():
    for name, runtime, want in [
        ("transpose", {}, [{"name": "rows", "arg": 0, "axis": 0}, {"name": "x_stride0", "arg": 0, "stride": 0}]),
        ("batched_transpose", {"batch": 2},
         [{"name": "batch", "arg": 0, "axis": 0}, {"name": "rows", "arg": 0, "axis": 1},
          {"name": "x_stride0", "arg": 0, "stride": 0}, {"name": "x_stride1", "arg": 0, "stride": 1}]),
    ]:
        k = _kernel("float32", 67, name=name, **runtime)
        spec = k.spec
        assert k.spec.inputs[0].strided and k.spec.inputs[0].stride_names() == tuple(
            d["name"] for d in want if "stride" in d)
        meta = json.loads((k.path / "manifest.json").read_text())["meta"]
        assert meta["abi"] == {"loader": "ctypes", "dynamic": want}
        assert loader.dynamic_args((*spec.inputs, *spec.outputs), [p.name for p in spec.runtime_params]) == want
        src = (k.path / "kernel.cu").read_text()
        assert re.search(r"_kernel\([^)]*int32_t x_stride0", src), "the kernel function takes the stride"


def test_ops_pass_strided_views_through():
    buf = _buffer("float32", 40, 80, seed=5)
    x = buf[:, 3:70]
    want = x.T.contiguous()
    assert torch.equal(_bits(tkjit.ops.transpose(x)), _bits(want))  # eager: the op's implementation
    assert torch.equal(_bits(torch.ops.tkjit.transpose.default(x)), _bits(want))  # through the dispatcher
    xb = _buffer("float32", 40, 80, seed=6, batch=2)[:, :, 1:68]
    assert torch.equal(_bits(tkjit.ops.transpose(xb)), _bits(xb.transpose(1, 2).contiguous()))


def test_fake_impls_accept_strided_views_and_give_contiguous_outputs():
    with FakeTensorMode():
        buf = torch.empty(40, 80)
        y = torch.ops.tkjit.transpose.default(buf[:, 3:70])
        assert y.shape == (67, 40) and y.is_contiguous()
        wide = torch.empty(32, 2 * 7168, dtype=torch.bfloat16)
        for op in (torch.ops.tkjit.per_token_cast.default, torch.ops.tkjit.per_token_cast_colmajor.default):
            q, s = op(wide[:, :7168], 128)
            assert q.shape == (32, 7168) and q.is_contiguous() and s.is_contiguous()
            assert s.shape == ((32, 56) if op is torch.ops.tkjit.per_token_cast.default else (56, 32))


def test_compiled_graph_takes_a_strided_view():
    f = torch.compile(lambda b: tkjit.ops.transpose(b[:, 3:70]) * 1, fullgraph=True, backend="eager")
    buf = _buffer("float32", 40, 80, seed=7)
    assert torch.equal(_bits(f(buf)), _bits(buf[:, 3:70].T.contiguous()))


# -- per_token_cast: sm_90a cross-compiles (it does not lower on the C target) --------------------------

@pytest.mark.parametrize(
    "name, shape, config",
    [
        ("per_token_cast", {"hidden": 7168, "group": 128}, None),
        ("per_token_cast_colmajor", {"hidden": 4096, "group": 128, "in_dtype": "float32"},
         {"vec": 8, "group_threads": 4, "threads": 256, "iters": 1}),
    ],
)
def test_per_token_cast_reads_a_runtime_row_stride(name, shape, config):
    k = tkjit.get(name, {"num_tokens": 4096, **shape}, arch="sm_90a", config=config)
    x_arg = k.spec.inputs[0]
    assert x_arg.strided and x_arg.stride_names() == ("x_stride0",)
    eb = 2 if shape.get("in_dtype", "bfloat16") == "bfloat16" else 4
    assert x_arg.align_bytes(k.shape, k.config) == k.config["vec"] * eb
    src = (k.path / "kernel.cu").read_text()
    kernel = re.search(r"__global__ void[^(]*\(([^)]*)\)", src).group(1)
    assert "int x_stride0" in kernel  # the stride is a runtime value of the one binary
    loads = re.findall(r"\*\((\w+)\*\)\(x \+ (.*)", src)
    assert loads and all(t in ("uint4", "float4") for t, _ in loads), "x is read with 16-byte vector loads"
    assert all("x_stride0" in idx for _, idx in loads)
