"""What the Engram gate kernels share (engram_gate_fwd, engram_gate_bwd, grad_w_reduce): shapes, tensor
arguments, test data and the float64 maths.

TileKernels' fused Engram gate (`modeling.engram.EngramGateFn`), per token t and head h of hc_mult:

    rstd_x = rsqrt(mean(x**2) + eps)          rstd_k = rsqrt(mean(k**2) + eps)
    dot    = sum(x * weight_fused * k)        (raw: the kernels save it unscaled)
    s      = dot * rstd_x * rstd_k / sqrt(hidden_size)
    gate   = sigmoid(copysign(sqrt(max(|s|, clamp_value)), s))
    out    = x + gate * v                     (v is shared by the hc_mult heads of a token)

x = hidden_states[t, h] and k[t, h] (hidden_size,) bfloat16, v[t] (hidden_size,) bfloat16,
weight_fused = weight_hidden * weight_embed (hc_mult, hidden_size) float32 (`fused_weight`).
The sign is copysign's, as TileKernels' kernel takes it: a dot of exactly 0 gives gate
sigmoid(+sqrt(clamp_value)) (-0.0: the negative root), where TileKernels' torch reference
(sign(0) = 0) gives 0.5. The references here follow the kernel, which is what a TileKernels user gets.

  PARAMS, COMMON          shape params and KernelSpec fields the gate kernels have
  gate_inputs             make_inputs' tensors (odd seeds: rows of many magnitudes, zero rows)
  forward64               the forward in float64 (the references, and the tests' autograd)
  gate_grad64             dL/d dot from the saved forward values, as the backward kernel forms it
  PARTIALS, partial_sums  the backward's per-block partial sums of weight_fused's gradient (TileKernels'
                          persistent blocks: block b sums the tokens [b * ceil(N / P), (b + 1) * ceil(N / P)))
  backward64              engram_gate_bwd's outputs in float64 from the saved values
"""

from __future__ import annotations

import torch

from tkjit.spec import Runtime, Static, TensorArg, Tolerance, ieee_plain_threads, stride_name

MAX_HC = 16
MAX_HIDDEN = 1 << 16
VECS = (1, 2, 4, 8)  # channels per chunk: 2..16-byte bf16 vectors
NUM_SMS = 132  # H200: the backward's default block count (TileKernels takes the GPU's SM count)
MAX_PARTIALS = 4096

PARAMS = (
    Runtime("num_tokens", hi=1 << 24, doc="tokens (the flattened leading dims); runtime size"),
    Static("hc_mult", lo=1, hi=MAX_HC, default=4, doc="mHC expansion rate: heads per token"),
    Static("hidden_size", lo=1, hi=MAX_HIDDEN, doc="channels per head"),
    Static("eps", type=float, lo=0.0, hi=1.0, default=1e-6, doc="RMSNorm epsilon"),
    Static("clamp_value", type=float, lo=0.0, hi=1e6, default=1e-6, doc="|score| floor before the signed sqrt"),
)


PARTIALS = Static("num_partials", lo=1, hi=MAX_PARTIALS, default=NUM_SMS,
                  doc="backward blocks: rows of partial sums of weight_fused's gradient (TileKernels' num_sms)")


def partials_check(shape):
    """The partials' int32 indexing: num_partials * hc_mult * hidden_size elements at most 2**31 - 1."""
    n = shape["num_partials"] * shape["hc_mult"] * shape["hidden_size"]
    if n >= 1 << 31:
        return (f"num_partials * hc_mult * hidden_size = {n} partial sums: the kernels index at most 2**31 - 1 "
                "(use fewer num_partials)")
    return None


def arch_constraint(arch, c, shape):
    if arch == "cpu":
        return "reads and writes bfloat16 and uses warp shuffles, which TileLang's C target does not lower"
    return None


# IEEE float32 maths (TileKernels' kernels do not use fast math either).
pass_configs = ieee_plain_threads


COMMON = dict(
    family="engram",
    arch_constraint=arch_constraint,
    pass_configs=pass_configs,
    # bf16 outputs: the kernels accumulate in float32 (their own order) and round once, the reference
    # rounds the float64 value once; they differ by one bf16 ulp where float32's error crosses a rounding
    # boundary (relative L2 ~1e-5). 1e-3 still fails any systematic error (truncation: ~2e-3).
    tolerance=Tolerance(rtol=1e-3),
)


def _align(shape, c):
    return 2 * c["vec"]


def _w_align(shape, c):
    return 4 * c["vec"]


def heads_arg(name, strided=False):
    """A (num_tokens, hc_mult, hidden_size) bf16 tensor, read or written in vec-channel vectors."""
    return TensorArg(name, "bfloat16", ("num_tokens", "hc_mult", "hidden_size"), strided=strided, align=_align)


def v_arg(name, strided=False):
    """A (num_tokens, hidden_size) bf16 tensor: v, shared by a token's heads, or its gradient."""
    return TensorArg(name, "bfloat16", ("num_tokens", "hidden_size"), strided=strided, align=_align)


def weight_arg(name):
    """The (hc_mult, hidden_size) float32 fused weight."""
    return TensorArg(name, "float32", ("hc_mult", "hidden_size"), align=_w_align)


def saved_arg(name):
    """A (num_tokens, hc_mult) float32 value the forward saves for the backward."""
    return TensorArg(name, "float32", ("num_tokens", "hc_mult"), align=4)


SAVED = ("dot", "gate_score", "rstd_x", "rstd_k")


def gate_dims(T):
    """A gate builder's runtime sizes: num_tokens, k's strides (token, head, 1) and v's (token, 1) (k and v
    may be views: the launcher binds their strides, see heads_arg / v_arg)."""
    num_tokens = T.dynamic("num_tokens")
    ks = (T.dynamic(stride_name("k", 0)), T.dynamic(stride_name("k", 1)), 1)
    vs = (T.dynamic(stride_name("v", 0)), 1)
    return num_tokens, ks, vs


def widest_vec(hidden: int, most: int = 8) -> int:
    return next(v for v in sorted(VECS, reverse=True) if v <= most and hidden % v == 0)


def vec_constraint(shape, c):
    if shape["hidden_size"] % c["vec"]:
        return f"vec={c['vec']} chunks need hidden_size={shape['hidden_size']} to be a multiple of {c['vec']}"
    return None


def gate_inputs(shape, device="cpu", seed=0, grad=False):
    """(grad_out if grad,) hidden_states, k, v bf16 (standard normal) and weight_fused float32 (the
    product of two bf16 RMSNorm weights around 1, as `fused_weight` makes it). Odd seeds scale each
    token's rows by 2^j, j in [-6, 6], and zero some x and k rows and some v rows (a zero dot: the
    copysign gate, rstd = rsqrt(eps))."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    t, m, h = shape["num_tokens"], shape["hc_mult"], shape["hidden_size"]
    go = torch.randn(t, m, h, generator=g) if grad else None
    x = torch.randn(t, m, h, generator=g)
    k = torch.randn(t, m, h, generator=g)
    v = torch.randn(t, h, generator=g)
    wh = (1.0 + 0.1 * torch.randn(m, h, generator=g)).bfloat16()
    we = (1.0 + 0.1 * torch.randn(m, h, generator=g)).bfloat16()
    if seed % 2:
        x = x * torch.exp2(torch.randint(-6, 7, (t, m, 1), generator=g).float())
        k = k * torch.exp2(torch.randint(-6, 7, (t, m, 1), generator=g).float())
        x[1::7, 0] = 0.0
        k[2::5, -1] = 0.0
        v[3::6] = 0.0
    w = wh.float() * we.float()
    out = ([go.bfloat16()] if grad else []) + [x.bfloat16(), k.bfloat16(), v.bfloat16(), w]
    return tuple(a.to(device) for a in out)


def forward64(hidden_states, k, v, weight_fused, eps, clamp_value):
    """(out, dot, gate_score, rstd_x, rstd_k) in float64, out before rounding. Differentiable in every
    tensor (the tests' autograd): torch.copysign's gradient in its magnitude is the magnitude's sign,
    the clamp's is 0 below clamp_value, as the backward kernel forms them."""
    x, kk, vv, w = hidden_states.double(), k.double(), v.double(), weight_fused.double()
    h = x.shape[-1]
    rstd_x = torch.rsqrt((x * x).mean(-1) + eps)
    rstd_k = torch.rsqrt((kk * kk).mean(-1) + eps)
    dot = (x * w * kk).sum(-1)
    s = dot * rstd_x * rstd_k * h**-0.5
    gate = torch.sigmoid(torch.copysign(s.abs().clamp_min(clamp_value).sqrt(), s.detach()))
    out = x + gate.unsqueeze(-1) * vv.unsqueeze(-2)
    return out, dot, gate, rstd_x, rstd_k


def gate_grad64(dldg, dot, gate_score, rstd_x, rstd_k, hidden_size, clamp_value):
    """dL/d dot (the raw, unscaled dot) in float64 given dL/d gate and the forward's saved values:
    0 where the score's magnitude is under clamp_value, else dldg * g (1 - g) / (2 sqrt(|dot| c)) * c
    with c = rstd_x rstd_k / sqrt(hidden_size)."""
    c = hidden_size**-0.5 * rstd_x.double() * rstd_k.double()
    d, g = dot.double(), gate_score.double()
    scaled = d.abs() * c
    grad = dldg * g * (1.0 - g) * 0.5 * torch.sqrt(c / d.abs())
    return torch.where(scaled < clamp_value, torch.zeros_like(grad), grad)


def row_bytes(s) -> int:
    """Bytes of one (num_tokens, hc_mult, hidden_size) bf16 tensor."""
    return s["num_tokens"] * s["hc_mult"] * s["hidden_size"] * 2


def saved_bytes(s) -> int:
    """Bytes of the four (num_tokens, hc_mult) float32 saved values."""
    return 4 * s["num_tokens"] * s["hc_mult"] * 4


EXAMPLES = (
    {"num_tokens": 4096, "hc_mult": 4, "hidden_size": 7168},
    {"num_tokens": 4096, "hc_mult": 4, "hidden_size": 4096},
    {"num_tokens": 1024, "hc_mult": 4, "hidden_size": 2560},
)


def clamped(dot, rstd_x, rstd_k, hidden_size, clamp_value):
    """Where the backward zeroes a head's gate gradient: |dot| * scalar * rstd_x * rstd_k < clamp_value,
    evaluated in float32 left to right as the kernels (and TileKernels') do, so that a score at the clamp
    boundary falls on the kernel's side (the float64 value could fall on the other)."""
    scalar = torch.tensor(hidden_size**-0.5, dtype=torch.float32)
    return dot.float().abs() * scalar * rstd_x.float() * rstd_k.float() < torch.tensor(clamp_value, dtype=torch.float32)


def partial_sums(per_token, num_partials):
    """(num_tokens, ...) -> (num_partials, ...): row b sums the tokens [b * ceil(N / P), (b + 1) * ceil(N / P))
    (zeros for a block past the end), the backward kernel's block ranges."""
    n = per_token.shape[0]
    per = -(-n // num_partials) if n else 1
    pad = per_token.new_zeros((per * num_partials - n, *per_token.shape[1:]))
    return torch.cat([per_token, pad]).view(num_partials, per, *per_token.shape[1:]).sum(1)


def backward64(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value,
               num_partials):
    """(grad_x, grad_k, grad_v, grad_w_partial) in float64 from the forward's saved values: TileKernels'
    closed forms (`gate_grad64`; tests check them against autograd through `forward64`), the clamp test
    as the kernel evaluates it (`clamped`), weight_fused's gradient summed per block (`partial_sums`)."""
    go, x, kk, vv, w = (t.double() for t in (grad_out, hidden_states, k, v, weight_fused))
    h = x.shape[-1]
    dldg = (go * vv.unsqueeze(1)).sum(-1)
    dr = gate_grad64(dldg, dot, gate_score, rstd_x, rstd_k, h, 0.0)  # ungated: the clamp test follows
    dr = torch.where(clamped(dot, rstd_x, rstd_k, h, clamp_value), torch.zeros_like(dr), dr).unsqueeze(-1)
    d = dot.double().unsqueeze(-1)
    rx2, rk2 = rstd_x.double().unsqueeze(-1) ** 2, rstd_k.double().unsqueeze(-1) ** 2
    grad_x = go + dr * (kk * w - x * (d * rx2 / h))
    grad_k = dr * (x * w - kk * (d * rk2 / h))
    grad_v = (go * gate_score.double().unsqueeze(-1)).sum(1)
    return grad_x, grad_k, grad_v, partial_sums(dr * x * kk, num_partials)
