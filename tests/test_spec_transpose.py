"""transpose / batched_transpose specs on a CPU host: validation, reference, sm_90a cross-compiles,
and real runs on TileLang's C target (the same kernel, T.Parallel loops, for the dtypes C knows)."""

import re

import pytest
import torch

import tkjit
from tkjit.testing import check
from tkjit_kernels.transpose import transpose as tmod

BIG = {"dtype": "bfloat16", "cols": 7168, "rows": 16384}


def spec():
    return tkjit.get_spec("transpose")


def bspec():
    return tkjit.get_spec("batched_transpose")


# -- the spec as data ---------------------------------------------------------------------------

def test_registered_and_valid():
    for s in (spec(), bspec()):
        assert s.family == "transpose"
        assert s.tolerance.exact
        assert s.examples
    assert [p.name for p in spec().runtime_params] == ["rows"]
    assert [p.name for p in bspec().runtime_params] == ["rows", "batch"]


@pytest.mark.parametrize("dtype", tmod.DTYPES)
@pytest.mark.parametrize("cols", [1, 3, 5, 64, 129, 4096, 7168])
def test_default_fits_every_dtype_and_size(dtype, cols):
    for s in (spec(), bspec()):
        full = s.canonical_shape({"dtype": dtype, "cols": cols, "rows": 7, "batch": 2} if s is bspec()
                                 else {"dtype": dtype, "cols": cols, "rows": 7})
        cfg = s.default_config(full)
        assert s.constraint(full, cfg) is None
        assert len(s.configs(full)) >= 10


def test_default_for_the_big_case():
    cfg = spec().default_config(spec().canonical_shape(BIG))
    assert cfg == {"block_rows": 128, "block_cols": 128, "threads": 256, "vec_bytes": 16, "swizzle": True,
                   "min_threads_per_sm": 1024, "raster": "cols"}
    fp8 = spec().canonical_shape({**BIG, "dtype": "float8_e4m3fn"})
    assert spec().default_config(fp8)["vec_bytes"] == 8  # 16 x 16-byte micro-tiles need too many registers


def test_space_is_pruned_by_real_rules():
    full = spec().canonical_shape(BIG)
    for cfg in spec().configs(full):
        eb, k, groups = tmod._geometry(full, cfg)
        assert cfg["block_rows"] * cfg["block_cols"] * eb <= tmod.SMEM_LIMIT
        assert (cfg["block_rows"] // k) * (cfg["block_cols"] // k) % cfg["threads"] == 0
        if cfg["swizzle"]:
            assert (cfg["block_rows"] // k) % groups == 0


@pytest.mark.parametrize(
    "shape, match",
    [
        ({"dtype": "float128", "cols": 4, "rows": 4}, "dtype"),
        ({"dtype": "bfloat16", "cols": 0, "rows": 4}, "cols"),
        ({"dtype": "bfloat16", "rows": 4}, "cols"),
        ({"dtype": "bfloat16", "cols": 8, "rows": 0}, "rows"),
        ({"dtype": "bfloat16", "cols": 8, "rows": 4, "batch": 2}, "unknown"),
        ({"dtype": 2, "cols": 8, "rows": 4}, "dtype"),
    ],
)
def test_bad_shapes(shape, match):
    with pytest.raises(tkjit.ShapeError, match=match):
        spec().canonical_shape(shape)


def test_bad_batch():
    with pytest.raises(tkjit.ShapeError, match="batch"):
        bspec().canonical_shape({"dtype": "float32", "cols": 8, "rows": 4, "batch": 70000})


def test_bad_configs():
    full = spec().canonical_shape(BIG)
    good = spec().default_config(full)
    with pytest.raises(tkjit.ConfigError, match="swizzle"):
        spec().check_config(full, {**good, "block_rows": 32})  # 64 bytes per row: no swizzle
    with pytest.raises(tkjit.ConfigError, match="shared memory"):
        spec().check_config(full, {**good, "block_rows": 256, "block_cols": 256})
    with pytest.raises(tkjit.ConfigError, match="not in the space"):
        spec().check_config(full, {**good, "vec_bytes": 32})
    f64 = spec().canonical_shape({"dtype": "float64", "cols": 8, "rows": 4})
    assert all(c["vec_bytes"] >= 8 for c in spec().configs(f64))


def test_reference_and_inputs():
    s = spec()
    for dtype in ("bfloat16", "float8_e4m3fn", "float32", "uint8", "int64"):
        full = s.canonical_shape({"dtype": dtype, "cols": 5, "rows": 3})
        (x,) = s.make_inputs(full, seed=1)
        assert x.shape == (3, 5) and x.dtype == tkjit.kernel.torch_dtype(dtype)
        y = s.reference(full, x)
        assert y.shape == (5, 3) and y.is_contiguous()
        for r in range(3):
            for c in range(5):
                assert y[c, r:r + 1].view(torch.uint8).tolist() == x[r, c:c + 1].view(torch.uint8).tolist()
    for dtype in ("bfloat16", "float32", "int16", "int8"):
        big = s.canonical_shape({"dtype": dtype, "cols": 256, "rows": 256})
        (xb,) = s.make_inputs(big, seed=0)
        if xb.dtype.is_floating_point:
            assert not xb.isnan().any()
        else:
            assert not (xb == torch.iinfo(xb.dtype).min).any()
    f8 = s.canonical_shape({"dtype": "float8_e4m3fn", "cols": 256, "rows": 256})
    assert not (s.make_inputs(f8, seed=0)[0].view(torch.uint8) == 0xFF).any()
    (x2,) = s.make_inputs(full, seed=2)
    assert not torch.equal(x, x2)
    b = bspec().canonical_shape({"dtype": "float32", "cols": 4, "rows": 3, "batch": 2})
    (xb,) = bspec().make_inputs(b, seed=0)
    assert torch.equal(bspec().reference(b, xb), torch.stack([xb[0].T, xb[1].T]))
    assert s.bytes_moved(BIG) == 2 * 16384 * 7168 * 2
    assert bspec().bytes_moved({**b}) == 2 * 2 * 3 * 4 * 4


# -- sm_90a cross-compiles ------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, shape, config",
    [
        ("transpose", BIG, None),
        ("transpose", {"dtype": "float8_e4m3fn", "cols": 7168, "rows": 4096}, None),
        ("transpose", {"dtype": "float32", "cols": 129, "rows": 65},
         {"block_rows": 64, "block_cols": 64, "threads": 128, "vec_bytes": 8, "swizzle": False,
          "min_threads_per_sm": 0, "raster": "rows"}),
        ("batched_transpose", {"dtype": "bfloat16", "cols": 2048, "rows": 1000, "batch": 4}, None),
        ("transpose", {"dtype": "bfloat16", "cols": 576, "rows": 4001}, None),
    ],
)
def test_compiles_for_sm90a(name, shape, config):
    k = tkjit.get(name, shape, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    # The interior path must be vectorised end to end: global loads, shared stores, global stores.
    vec_types = {buf: t for t, buf in re.findall(r"\*\((\w+)\*\)\(([xys]) ", src)}
    want = {"bfloat16": "uint4", "float8_e4m3fn": "fp8_e4_8_t", "float32": "float2"}[shape["dtype"]]
    assert vec_types.get("y") == want and vec_types.get("s") == want, vec_types
    if shape["cols"] % 8 == 0:
        assert vec_types.get("x") == want
    assert "__syncthreads" in src
    # Where y's rows are not vector-aligned (rows % 8 for bf16), interior tiles store one element a lane, lanes
    # along y's row (threadIdx.x & (block_rows - 1)), unchecked: a warp writes whole 64-byte runs.
    if name == "transpose" and shape["cols"] == 576:
        assert re.search(r"\n\s*y\[[^;]*\(int64_t\)127\)\)\] = s\[", src), "element path: lanes along y's rows"


# -- real runs on the C target ---------------------------------------------------------------------

CPU_CASES = [
    ("float32", 1, [1, 3]),
    ("float32", 5, [3, 4001]),
    ("float32", 129, [65, 1, 256]),
    ("float32", 64, [128, 200]),
    ("float32", 128, [4001, 130]),  # interior tiles whose y rows are not vector-aligned: element-wise stores
    ("uint8", 129, [65, 256]),
    ("uint8", 256, [512]),
    ("int16", 7, [33]),
    ("float16", 9, [5, 130]),
    ("float64", 129, [65, 64]),
]


@pytest.mark.parametrize("dtype, cols, rows_list", CPU_CASES)
def test_runs_on_cpu(dtype, cols, rows_list):
    k = tkjit.get("transpose", {"dtype": dtype, "cols": cols, "rows": rows_list[0]}, arch="cpu")
    for i, rows in enumerate(rows_list):
        assert check(k, {"dtype": dtype, "cols": cols, "rows": rows}, device="cpu", seed=i) is None


@pytest.mark.parametrize(
    "config",
    [
        {"block_rows": 32, "block_cols": 64, "threads": 128, "vec_bytes": 8, "swizzle": False, "min_threads_per_sm": 0,
         "raster": "rows"},
        {"block_rows": 128, "block_cols": 32, "threads": 128, "vec_bytes": 16, "swizzle": True,
         "min_threads_per_sm": 1024, "raster": "cols"},
    ],
)
def test_other_configs_run_on_cpu(config):
    shape = {"dtype": "float32", "cols": 129, "rows": 65}
    k = tkjit.get("transpose", shape, arch="cpu", config=config)
    for rows in (65, 128, 3):
        assert check(k, {**shape, "rows": rows}, device="cpu", seed=rows) is None


def test_batched_runs_on_cpu():
    shape = {"dtype": "float32", "cols": 129, "rows": 65, "batch": 3}
    k = tkjit.get("batched_transpose", shape, arch="cpu")
    assert check(k, shape, device="cpu", seed=0) is None
    assert check(k, {**shape, "rows": 64, "batch": 1}, device="cpu", seed=1) is None


def test_cpu_kernel_rejects_bad_tensors():
    k = tkjit.get("transpose", {"dtype": "float32", "cols": 5, "rows": 3}, arch="cpu")
    assert torch.equal(k(torch.arange(15.0).view(3, 5)), torch.arange(15.0).view(3, 5).T)
    with pytest.raises(tkjit.TensorError, match="dtype"):
        k(torch.zeros(3, 5, dtype=torch.float64))
    with pytest.raises(tkjit.TensorError, match="axis 1"):
        k(torch.zeros(3, 6))
    with pytest.raises(tkjit.TensorError, match="dims"):
        k(torch.zeros(2, 3, 5))
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        k(torch.zeros(5, 3).T)
    assert k(torch.zeros(0, 5)).shape == (5, 0)
