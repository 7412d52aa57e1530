"""fused_weight: the Engram gate's two RMSNorm weights multiplied once (TileKernels' `engram.fused_weight`).

weight_hidden, weight_embed (hc_mult, hidden_size) bfloat16 -> weight_fused (hc_mult, hidden_size)
float32 = float32(weight_hidden) * float32(weight_embed), one IEEE float32 multiply per element,
bit-identical to torch's `weight_hidden.float() * weight_embed.float()`. Two bf16 significands (8
bits each) multiply exactly into float32's 24, so the product rounds only where it leaves float32's
normal range: overflow to inf, or a subnormal result. No fast math, so those round as IEEE says and
subnormal inputs and results are kept (flushing them to zero would differ from torch).

Layout: one block row per weight row (blockIdx.y), `block_elems` consecutive elements per block; each
thread converts `vec` consecutive elements per step (vec = 8: 16-byte bf16 loads, two 16-byte float32
stores), neighbouring threads neighbouring vectors. hidden_size % vec == 0, so a vector never crosses a
row; elements past the row's end are skipped. The tensors are a model's weights (hc_mult x hidden_size,
~57 KiB at 4 x 7168): the launch, not the bytes, is the cost, so the tunables trade blocks for steps.
bf16 loads: CUDA targets only (TileLang's C target has no bf16).
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Static, TensorArg, Tolerance, cuda_only, ieee_plain_threads

MAX_HC = 64
MAX_HIDDEN = 1 << 20


def default(shape):
    hidden = shape["hidden_size"]
    vec = next(v for v in (8, 4, 2, 1) if hidden % v == 0)
    # Enough blocks to reach many SMs at once (4 x 7168: 28 blocks of one 128-thread step); very wide
    # rows take a few steps per thread instead of thousands of blocks.
    steps = 1 if hidden <= 128 * vec * 64 else 4
    return {"block_elems": 128 * vec * steps, "threads": 128, "vec": vec}


def constraint(shape, c):
    hidden, block, threads, vec = shape["hidden_size"], c["block_elems"], c["threads"], c["vec"]
    if hidden % vec:
        return f"vec={vec} accesses need hidden_size={hidden} to be a multiple of {vec}"
    if block % (threads * vec):
        return "block_elems must be a multiple of threads * vec"
    if block // (threads * vec) > 16:
        return "more than 16 vector steps per thread"
    return None


arch_constraint = cuda_only("reads bfloat16, which TileLang's C target does not lower")


# IEEE multiplies with subnormals (torch's result): never fast math / flush to zero.
pass_configs = ieee_plain_threads


def build(shape, c):
    from tilelang import language as T

    hc, hidden = shape["hc_mult"], shape["hidden_size"]
    block, threads, vec = c["block_elems"], c["threads"], c["vec"]
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def fused_weight(
        weight_hidden: T.Tensor[(hc, hidden), bf16],
        weight_embed: T.Tensor[(hc, hidden), bf16],
        weight_fused: T.Tensor[(hc, hidden), f32],
    ):
        with T.Kernel(T.ceildiv(hidden, block), hc, threads=threads) as (bx, row):
            a = T.alloc_local((vec,), bf16)
            b = T.alloc_local((vec,), bf16)
            for t in T.Parallel(block // vec):
                base = bx * block + t * vec
                if base < hidden:
                    for v in T.vectorized(vec):  # one 16-byte load each at vec = 8, converted in registers
                        a[v] = weight_hidden[row, base + v]
                    for v in T.vectorized(vec):
                        b[v] = weight_embed[row, base + v]
                    for v in T.vectorized(vec):
                        weight_fused[row, base + v] = T.cast(a[v], f32) * T.cast(b[v], f32)

    return fused_weight


def make_inputs(shape, device="cpu", seed=0):
    """Even seeds: RMSNorm weights around 1. Odd seeds: every finite bf16 bit pattern (all magnitudes,
    signed zeros, subnormals), so that products overflow to inf and fall into float32's subnormals,
    and some infinities (times nonzero values: no NaN, which bit_equal never matches)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hc, hidden = shape["hc_mult"], shape["hidden_size"]
    if seed % 2 == 0:
        wh = (1.0 + 0.1 * torch.randn(hc, hidden, generator=g)).to(torch.bfloat16)
        we = (1.0 + 0.1 * torch.randn(hc, hidden, generator=g)).to(torch.bfloat16)
    else:
        sign = torch.randint(0, 2, (2, hc, hidden), generator=g, dtype=torch.int32) << 15
        exp = torch.randint(0, 255, (2, hc, hidden), generator=g, dtype=torch.int32) << 7  # never 255: finite
        mant = torch.randint(0, 128, (2, hc, hidden), generator=g, dtype=torch.int32)
        wh, we = (sign | exp | mant).to(torch.int16).view(torch.bfloat16)
        pairs = torch.tensor([[0.0, 3e38], [-0.0, 1.0], [float("inf"), 2.0], [-float("inf"), 1e-30],
                              [1e-39, 0.5], [-3e-40, -3e-40], [1e30, 1e30], [2.0**-70, 2.0**-70],
                              [2.0**-80, 2.0**-60], [3e38, -2.0]]).to(torch.bfloat16)
        n = min(wh.numel(), len(pairs))
        wh.view(-1)[:n], we.view(-1)[:n] = pairs[:n, 0], pairs[:n, 1]
    return wh.to(device), we.to(device)


def reference(shape, weight_hidden, weight_embed):
    return weight_hidden.float() * weight_embed.float()


SPEC = register(
    KernelSpec(
        name="fused_weight",
        family="engram",
        doc="weight_hidden * weight_embed, bf16 (hc_mult, hidden_size) -> float32, one IEEE multiply each",
        params=(
            Static("hc_mult", lo=1, hi=MAX_HC, default=4, doc="mHC expansion rate: the weights' rows"),
            Static("hidden_size", lo=1, hi=MAX_HIDDEN, doc="the weights' columns"),
        ),
        space={
            "block_elems": (128, 256, 512, 1024, 2048, 4096, 8192),
            "threads": (32, 64, 128, 256),
            "vec": (1, 2, 4, 8),
        },
        default=default,
        constraint=constraint,
        arch_constraint=arch_constraint,
        build=build,
        pass_configs=pass_configs,
        inputs=(
            TensorArg("weight_hidden", "bfloat16", ("hc_mult", "hidden_size"), align=lambda s, c: 2 * c["vec"]),
            TensorArg("weight_embed", "bfloat16", ("hc_mult", "hidden_size"), align=lambda s, c: 2 * c["vec"]),
        ),
        outputs=(TensorArg("weight_fused", "float32", ("hc_mult", "hidden_size"), align=lambda s, c: 4 * c["vec"]),),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        bytes_moved=lambda s: s["hc_mult"] * s["hidden_size"] * (2 + 2 + 4),
        flops=lambda s: s["hc_mult"] * s["hidden_size"],
        examples=(
            {"hc_mult": 4, "hidden_size": 7168},
            {"hc_mult": 4, "hidden_size": 4096},
            {"hc_mult": 4, "hidden_size": 2560},
        ),
    )
)
