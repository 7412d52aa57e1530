#!/usr/bin/env python
"""Record, on the CPU build host, the kernels tests/gpu/test_gpu_compat_tile_kernels.py asks tkjit for, so that
prebuild.py can cross-compile them before a GPU run (`h200_verify.sh compat`):

    PYTHONPATH=$TK:$PYTHONPATH python benchmarks/h200/scripts/record_compat.py /tmp/gets_compat.json
    python benchmarks/h200/scripts/prebuild.py --arch sm_90a --from-json /tmp/gets_compat.json
    tkjit bundle export --from-cache --arch sm_90a -o .gpu/prebuilt.tgz

record_gets.py cannot: the file's fixtures read the GPU's arch, and each test stops at its first CUDA tensor.
This imports the module (TileKernels must import: its torch references build the pre-quantised inputs), runs its
fixtures' compile lists with the arch set to sm_90a, then calls each compat op the tests call on CPU tensors of
the same shapes, with `tkjit.get` recording instead of building (record_gets' stand-in); nothing runs.
$TK: a folder holding the `tile_kernels` package (`tar -xJf .gpu/site.tar.xz -C $TK ./tile_kernels`). TileKernels
imports `tilelang.utils.target`, which the GPU bundle's TileLang has and PyPI's 0.1.15 does not: it is aliased
here to `tilelang.backend.target` when missing. On 2026-12-06: 451 kernels, 7.7 MB as a bundle.
"""
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import torch

import tkjit
import tkjit.api
import tkjit.pool
from tkjit.kernel import dtype_name

if importlib.util.find_spec("tilelang.utils.target") is None:  # TileKernels' import path (see above)
    import tilelang.backend.target

    sys.modules["tilelang.utils.target"] = tilelang.backend.target

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks/h200/scripts"), str(ROOT / "tests/gpu")]

import record_gets  # noqa: E402
import test_gpu_compat_tile_kernels as m  # noqa: E402

tkjit.api._resolve = record_gets._record
m._gpu_arch = lambda: "sm_90a"
m.compile_many = lambda jobs: (record_gets._JOBS.extend(jobs), [(None, None) for _ in jobs])[1]
c = m.compat


def rec(f, *args, **kwargs) -> None:
    """f(*args, **kwargs); the recording stand-in stops it at its first kernel (anything else is printed)."""
    try:
        f(*args, **kwargs)
    except BaseException as e:  # pytest's Skipped is a BaseException
        if "recorded" not in str(e):
            print("!", type(e).__name__, str(e)[:150])


def fixtures() -> None:
    m._precompile("topk_gate", [{"num_tokens": max(1, t), "num_experts": e, "k": k} for t, e, k in m.TOPK_CASES])
    shapes = [{"rows": max(1, t), "cols": h, "dtype": dtype_name(d)} for t, h, d in m.TRANSPOSE_CASES]
    m._precompile("transpose", shapes)
    m._precompile("batched_transpose", [{**s, "batch": 3} for s in shapes])
    m._precompile_casts("per_token_cast", m.CAST_CASES)
    m._precompile_casts("per_token_cast_e2m1", [(t, h, torch.bfloat16, g, o) for t, h, g, o in m.E2M1_CASES])


def calls() -> None:
    """What the tests ask for beyond their fixtures (precomputed scales, cast_back of quantised inputs,
    Sinkhorn), and the fixtures' kernels once more as the ops ask for them."""
    q, tr = c.quant, c.transpose
    for t, e, k in m.TOPK_CASES:
        if t:
            rec(c.moe.topk_gate, torch.randn(t, e), k)
    for t, h, d in m.TRANSPOSE_CASES:
        if t:
            x = torch.randn(t, 2 * h).to(d)
            for view in (x[:, :h].contiguous(), x[:, :h].T.contiguous(), x[:, h // 2: h // 2 + h]):
                rec(tr.transpose, view)
            rec(tr.batched_transpose, torch.randn(3, t, h).to(d))
    for t, h, d, g, (col, round_sf, packed) in m.CAST_CASES:
        if t:
            x = torch.randn(t, h, dtype=d)
            rec(q.per_token_cast, x, "e4m3", g, use_tma_aligned_col_major_sf=col, round_sf=round_sf,
                use_packed_ue8m0=packed)
            if not col and not packed and g % 32 == 0:
                rec(q.per_token_cast_with_precomputed_sf, x, "e4m3", g, torch.rand(t, -(-h // g)))
    for t, h, g, (col, round_sf, packed) in m.E2M1_CASES:
        if t:
            rec(q.per_token_cast, torch.randn(t, h, dtype=torch.bfloat16), "e2m1", g,
                use_tma_aligned_col_major_sf=col, round_sf=round_sf, use_packed_ue8m0=packed)
    for in_fmt, xb in [("e4m3", (128, 128)), ("e4m3", (1, 128)), ("e2m1", (1, 32))]:
        xq = m.tile_kernels.torch.cast(torch.randn(4001, 2048, dtype=torch.bfloat16), in_fmt, xb, round_sf=True)
        rec(q.per_token_cast, xq, "e4m3", 32, x_block_size=xb, round_sf=True)  # its cast_back
        for fmt in ("e4m3", "e2m1"):  # the cast of the float32 cast_back returns
            rec(q.per_token_cast, torch.randn(4001, 2048), fmt, 32, round_sf=True)
    for t in (4001, 8001):
        for shape, rep in [((4, 4), 10), ((4, 4), 20), ((2, 4, 4), 10), ((8, 8), 10)]:
            tokens = t * (2 if len(shape) == 3 else 1)
            rec(c.modeling.mhc.ops.sinkhorn_normalize, torch.randn(t, *shape), rep, 1e-6)
            rec(tkjit.get, "sinkhorn_bwd", num_tokens=tokens, n=shape[-1], repeat=rep, eps=1e-6, arch="sm_90a")


if __name__ == "__main__":
    fixtures()
    calls()
    jobs = tkjit.pool.unique_jobs(record_gets._JOBS)
    with open(sys.argv[1], "w") as f:
        json.dump(jobs, f, indent=0)
    print(len(jobs), "kernels:", dict(Counter(j[0] for j in jobs)))
