"""transpose / batched_transpose on a GPU: every config against the exact reference, odd shapes,
bad tensors, and the 16384 x 7168 bf16 timing (run with -s to see the numbers)."""


import pytest
import torch

import tkjit
from tkjit.arch import current_arch
from tkjit.pool import compile_many
from tkjit.testing import check
from tkjit.timing import median, time_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cache")]



# (spec, static shape, runtime sizes to run each kernel at)
CASES = [
    ("transpose", {"dtype": "bfloat16", "cols": 7168}, [{"rows": r} for r in (16384, 4001, 1000, 65, 1)]),
    ("transpose", {"dtype": "bfloat16", "cols": 129}, [{"rows": r} for r in (65, 3, 1, 4096)]),
    ("transpose", {"dtype": "bfloat16", "cols": 5}, [{"rows": r} for r in (3, 1, 8192)]),
    ("transpose", {"dtype": "bfloat16", "cols": 1}, [{"rows": r} for r in (1, 7, 64)]),
    ("transpose", {"dtype": "float32", "cols": 4096}, [{"rows": r} for r in (4096, 4001, 1)]),
    ("transpose", {"dtype": "float32", "cols": 129}, [{"rows": r} for r in (65, 128, 2)]),
    ("transpose", {"dtype": "float16", "cols": 2112}, [{"rows": r} for r in (4001, 64)]),
    ("transpose", {"dtype": "float8_e4m3fn", "cols": 7168}, [{"rows": r} for r in (8192, 4001, 16, 1)]),
    ("transpose", {"dtype": "float8_e5m2", "cols": 136}, [{"rows": r} for r in (130, 64)]),
    ("transpose", {"dtype": "uint8", "cols": 3}, [{"rows": r} for r in (5, 1, 1000)]),
    ("transpose", {"dtype": "int32", "cols": 96}, [{"rows": r} for r in (200, 33)]),
    ("transpose", {"dtype": "float64", "cols": 65}, [{"rows": r} for r in (129, 64)]),
    ("transpose", {"dtype": "int64", "cols": 64}, [{"rows": r} for r in (64, 3)]),
    ("batched_transpose", {"dtype": "bfloat16", "cols": 2048},
     [{"rows": 1000, "batch": 3}, {"rows": 4096, "batch": 2}, {"rows": 1, "batch": 5}]),
    ("batched_transpose", {"dtype": "float32", "cols": 65}, [{"rows": 129, "batch": 7}, {"rows": 64, "batch": 1}]),
    ("batched_transpose", {"dtype": "float8_e4m3fn", "cols": 512}, [{"rows": 300, "batch": 4}]),
]

# Static shapes whose whole space is compiled and run.
EVERY_CONFIG = [  # ~600 variants: compile_many takes ~3 minutes on 16 cores
    ("transpose", {"dtype": "bfloat16", "cols": 7168}, [{"rows": r} for r in (512, 1001, 65, 1)]),
    ("transpose", {"dtype": "float8_e4m3fn", "cols": 7168}, [{"rows": r} for r in (1024, 1001, 1)]),
    ("batched_transpose", {"dtype": "float32", "cols": 129}, [{"rows": 1000, "batch": 3}, {"rows": 64, "batch": 2}]),
]


def _arch():
    return current_arch()


@pytest.mark.parametrize("name, static, sizes", CASES, ids=lambda v: str(v))
def test_default_config(name, static, sizes):
    k = tkjit.get(name, {**static, **sizes[0]})
    for i, rt in enumerate(sizes):
        for seed in (i, 100 + i):
            assert check(k, {**static, **rt}, seed=seed) is None


@pytest.mark.parametrize("name, static, sizes", EVERY_CONFIG, ids=lambda v: str(v))
def test_every_config(name, static, sizes):
    spec = tkjit.get_spec(name)
    full = spec.canonical_shape({**static, **sizes[0]})
    cfgs = spec.configs(full, _arch())
    jobs = [(name, spec.static_shape(full), c, _arch(), "explicit") for c in cfgs]
    errors = [(c, err) for c, (_, err) in zip(cfgs, compile_many(jobs)) if err]
    assert not errors, errors[:3]
    failures = []
    for c in cfgs:
        k = tkjit.get(name, full, config=c)
        for i, rt in enumerate(sizes):
            problem = check(k, {**static, **rt}, seed=i)
            if problem:
                failures.append(problem)
    assert not failures, f"{len(failures)} failures, e.g. {failures[:3]}"


def test_bad_tensors():
    k = tkjit.get("transpose", {"dtype": "bfloat16", "cols": 64, "rows": 128})
    x = torch.randn(128, 64, device="cuda").bfloat16()
    assert torch.equal(k(x), x.T.contiguous())
    with pytest.raises(tkjit.TensorError, match="dtype"):
        k(x.float())
    with pytest.raises(tkjit.TensorError, match="axis 1"):
        k(torch.zeros(128, 65, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(tkjit.TensorError, match="dims"):
        k(x.unsqueeze(0))
    with pytest.raises(tkjit.TensorError, match="cuda"):
        k(x.cpu())
    with pytest.raises(tkjit.TensorError, match="contiguous"):
        k(torch.zeros(64, 128, device="cuda", dtype=torch.bfloat16).T)
    assert k(torch.zeros(0, 64, device="cuda", dtype=torch.bfloat16)).shape == (64, 0)
    kb = tkjit.get("batched_transpose", {"dtype": "bfloat16", "cols": 64, "rows": 128, "batch": 2})
    with pytest.raises(tkjit.TensorError, match="dims"):
        kb(x)


def _time_us(fn, iters=50):
    return median(time_cuda(fn, reps=iters))


def test_speed_16384x7168_bf16():
    shape = {"dtype": "bfloat16", "cols": 7168, "rows": 16384}
    k = tkjit.get("transpose", shape)
    x = torch.randn(16384, 7168, device="cuda").bfloat16()
    y = torch.empty(7168, 16384, device="cuda", dtype=torch.bfloat16)
    us = _time_us(lambda: k(x, out=y))
    torch_us = _time_us(lambda: x.T.contiguous())
    gbps = 2 * x.numel() * 2 / us / 1e3
    print(f"\ntranspose 16384x7168 bf16 default {k.config}: {us:.1f} us ({gbps:.0f} GB/s); torch {torch_us:.1f} us")
    assert torch.equal(y, x.T)
    assert us < 200  # target <= 115 us on an H200; this only catches a broken fast path


def test_speed_all_configs_16384x7168_bf16():
    """Prints every config's time (the tuner's view); asserts nothing but correctness of the best."""
    spec = tkjit.get_spec("transpose")
    full = spec.canonical_shape({"dtype": "bfloat16", "cols": 7168, "rows": 16384})
    cfgs = spec.configs(full, _arch())
    compile_many([("transpose", spec.static_shape(full), c, _arch(), "explicit") for c in cfgs])
    x = torch.randn(16384, 7168, device="cuda").bfloat16()
    y = torch.empty(7168, 16384, device="cuda", dtype=torch.bfloat16)
    times = []
    for c in cfgs:
        k = tkjit.get("transpose", full, config=c)
        times.append((_time_us(lambda k=k: k(x, out=y), iters=20), c))
    times.sort(key=lambda t: t[0])
    print("\n" + "\n".join(f"{us:8.1f} us  {c}" for us, c in times[:15]))
    best = tkjit.get("transpose", full, config=times[0][1])
    assert check(best, full, seed=3) is None


# -- row-strided views: x = buf[:, off:off + cols] of a wider buffer, read in place ---------------------
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    return t.view(_BITS[t.element_size()])


def _wide(dtype, rows, width, seed, batch=None):
    """Fresh random bits (no NaN: the poison), on the GPU."""
    from tkjit_kernels.transpose.transpose import make_inputs

    shape = {"dtype": dtype, "cols": width, "rows": rows, **({"batch": batch} if batch else {})}
    return make_inputs(shape, seed=seed)[0].cuda()


def _poisoned_like(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device="cuda")
    return t.fill_(float("nan")) if dtype.is_floating_point and t.element_size() > 1 else _bits(t).fill_(-1).view(dtype)


# (dtype, cols, rows, buffer width, offset): offsets are multiples of the load width (see x_align).
STRIDED = [
    ("bfloat16", 7168, 16384, 14336, 0),  # the benchmark case: a 16384 x 14336 buffer's left half
    ("bfloat16", 7168, 4001, 7168 + 64, 64),
    ("bfloat16", 129, 65, 200, 3),  # odd cols: element loads, any offset
    ("bfloat16", 5, 8192, 16, 7),
    ("float32", 4096, 4001, 4096 + 4, 4),
    ("float16", 2112, 64, 4096, 8),
    ("float8_e4m3fn", 7168, 1000, 7168 + 16, 16),
    ("int64", 64, 3, 66, 2),
]


@pytest.mark.parametrize("dtype, cols, rows, width, off", STRIDED)
def test_strided_view_is_bit_exact(dtype, cols, rows, width, off):
    k = tkjit.get("transpose", {"dtype": dtype, "cols": cols, "rows": rows})
    x = _wide(dtype, rows, width, seed=rows)[:, off:off + cols]
    assert x.stride() == (width, 1)
    want = k(x.contiguous(), out=_poisoned_like((cols, rows), x.dtype))
    got = k(x, out=_poisoned_like((cols, rows), x.dtype))
    torch.cuda.synchronize()
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(got), _bits(x.T.contiguous()))
    assert torch.equal(_bits(tkjit.ops.transpose(x)), _bits(want))


def test_batched_strided_view_is_bit_exact():
    k = tkjit.get("batched_transpose", {"dtype": "bfloat16", "cols": 2048, "rows": 1000, "batch": 3})
    buf = _wide("bfloat16", 1024, 2048 + 128, seed=1, batch=4)
    # the permuted view is (3, 4, 2048): batch stride 2176 < row stride 4 * 2176
    for x in (buf[:3, :1000, 64:64 + 2048], buf.permute(1, 0, 2)[:3, :1000, :2048]):
        got = k(x, out=_poisoned_like((x.shape[0], 2048, x.shape[1]), x.dtype))
        assert torch.equal(_bits(got), _bits(x.transpose(1, 2).contiguous())), x.stride()


def test_misaligned_view_is_refused():
    k = tkjit.get("transpose", {"dtype": "bfloat16", "cols": 7168, "rows": 64})
    x = _wide("bfloat16", 64, 7168 + 8, seed=0)
    with pytest.raises(tkjit.TensorError, match="not 16-byte aligned"):
        k(x[:, 3:3 + 7168])
    with pytest.raises(tkjit.TensorError, match="contiguous last axis"):
        k(torch.empty(7168, 64, device="cuda", dtype=torch.bfloat16).T)


def test_speed_strided_vs_contiguous_16384x7168_bf16():
    """For the benchmark note: the same kernel on a 16384 x 14336 buffer's left half and on a contiguous
    copy of it, and what a .contiguous() copy before the call would cost."""
    k = tkjit.get("transpose", {"dtype": "bfloat16", "cols": 7168, "rows": 16384})
    buf = _wide("bfloat16", 16384, 14336, seed=5)
    x = buf[:, :7168]
    xc = x.contiguous()
    y = torch.empty(7168, 16384, device="cuda", dtype=torch.bfloat16)
    strided = median(time_cuda(lambda: k(x, out=y)))
    contiguous = median(time_cuda(lambda: k(xc, out=y)))
    copy_then = median(time_cuda(lambda: k(x.contiguous(), out=y)))
    print(f"\ntranspose 16384x7168 bf16 {k.config}: strided view {strided:.1f} us, contiguous {contiguous:.1f} us, "
          f".contiguous() + kernel {copy_then:.1f} us")
    assert torch.equal(_bits(k(x, out=y)), _bits(x.T.contiguous()))
