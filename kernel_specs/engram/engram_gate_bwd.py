"""engram_gate_bwd: the Engram gate's backward (TileKernels' `engram.engram_gate_bwd`).

Given grad_out = dL/d out (num_tokens, hc_mult, hidden_size) bf16, the forward's inputs and the four
values it saved (`engram_gate_fwd`: dot unscaled, gate_score, rstd_x, rstd_k), per token and head:

    dldg   = sum(grad_out * v)                                    (dL/d gate)
    dr     = 0 if |dot| * scalar * rstd_x * rstd_k < clamp_value
             else dldg * g (1 - g) * 0.5 * sqrt(scalar * rstd_x * rstd_k / |dot|)     (dL/d dot)
    grad_x = bf16(grad_out + dr * (k * w - x * dot * rstd_x**2 / hidden_size))
    grad_k = bf16(dr * (x * w - k * dot * rstd_k**2 / hidden_size))
    grad_v = bf16(sum over heads of grad_out * gate)              (v is shared by a token's heads)
    grad_w_partial[b] = sum over block b's tokens of dr * x * k   (num_partials, hc_mult, hidden_size) f32

(scalar = 1 / sqrt(hidden_size), w = weight_fused), TileKernels' closed forms in its operation order
(`_gate.backward64` is them in float64; the tests check them against torch autograd). Like TileKernels'
kernel this one is persistent: `num_partials` blocks (TileKernels: the GPU's SM count), block b taking
the tokens [b * ceil(N / P), (b + 1) * ceil(N / P)) and writing one row of weight_fused's gradient summed
over them; `grad_w_reduce` sums the rows. Since a block's range does not depend on the config, the
reference computes the same partials.

Layout: the block's threads split a row into `vec`-channel chunks (thread tx: chunks tx, tx + threads,
...) and take every head of a token. Pass 1 reads v's chunk and each head's grad_out chunk, stores grad_v
(float32 multiply-adds over the heads in order from 0, rounded once) and sums grad_out * v per head; the
block reduces the hc_mult sums (warp shuffles, the warps' partials in shared memory, added in the same
order by every thread). Pass 2 reads grad_out (again: an L1/L2 hit), x, k and weight_fused's chunks and
stores grad_x and grad_k. weight_fused's gradient accumulates over the block's tokens in registers
(`grad_w="regs"`: hc_mult * steps * vec floats a thread, stored once at the end) or in the block's own
row of grad_w_partial (`"global"`: read-modify-write per token, L2-resident; for rows too wide for
registers). The sums' order is not TileKernels' (two warps per head there), so the float32 results agree
with its kernel to float32 rounding (bf16 outputs: within one ulp), not bit for bit.

With one block an SM, a token costs two DRAM round trips one after the other: pass 1's loads, the block's
reduction, then pass 2's loads of x and k. `stage` takes the second off that path. "none" is the two passes
above. "xk": each thread starts its own x and k chunks of the token on their way to shared memory (cp.async,
one group) before pass 1, and pass 2 waits for the group and reads them there; "xk_go" also keeps pass 1's
grad_out chunks in shared memory, so pass 2 does not read grad_out from L2 again. A thread reads back only what
it wrote, so no barrier guards the copies (the end-of-token barrier orders pass 2's reads before the next
token's copies), and TileLang's own barrier placement, which would add two a token, is off for these configs
(`_pass_configs`). Shared bytes: 2 or 3 x hc_mult x hidden_size x 2 (TileKernels keeps grad_out and v there).
bf16 and warp shuffles: CUDA targets only.
"""

from tkjit.registry import register
from tkjit.spec import KernelSpec, TensorArg, ieee_plain_threads
from tkjit_kernels.engram._gate import (
    COMMON,
    EXAMPLES,
    PARAMS,
    PARTIALS,
    SAVED,
    backward64,
    gate_dims,
    gate_inputs,
    heads_arg,
    partials_check,
    row_bytes,
    saved_arg,
    saved_bytes,
    v_arg,
    vec_constraint,
    weight_arg,
    widest_vec,
)
from tkjit_kernels.mhc._post import idle_threads_problem

BWD_PARAMS = tuple(p for p in PARAMS if p.name != "eps") + (PARTIALS,)  # rstd is saved: no eps here
THREADS = (32, 64, 128, 256, 512, 1024)
STAGES = {"none": 0, "xk": 2, "xk_go": 3}  # bf16 rows of hc_mult x hidden_size a block keeps in shared memory
SMEM_MAX = 227 * 1024  # shared bytes a block may opt in to (sm_90)


def _stage_bytes(shape, c) -> int:
    return STAGES[c["stage"]] * shape["hc_mult"] * shape["hidden_size"] * 2


def _pass_configs(c) -> dict:
    configs = ieee_plain_threads(c)
    if c.get("stage", "none") != "none":
        # A staged chunk is read back only by the thread whose cp.async wrote it, after its own wait; TileLang's
        # barrier placement sees shared memory other threads write and would put a block barrier after the
        # copies' commit and another after the wait. The barriers the kernel needs (the warps' partial sums in
        # `red`, the end of a token) are its own T.sync_threads, which stay.
        configs["tl.disable_thread_storage_sync"] = True
    return configs


def _steps(shape, c) -> int:
    return -(-(shape["hidden_size"] // c["vec"]) // c["threads"])


def _acc_regs(shape, c) -> int:
    """Registers of a thread's weight-gradient accumulators (grad_w="regs")."""
    return shape["hc_mult"] * _steps(shape, c) * c["vec"]


def _acc_cap(threads: int) -> int:
    # At most half of what a thread may hold at this block size (65536 registers a block, 255 a thread),
    # so that the chunks in flight and the addresses keep the rest.
    return min(128, 65536 // threads // 2)


def default(shape):
    # 16-byte vectors; num_partials blocks (one an SM) keep the whole GPU's loads in flight only with many
    # threads: 512 (or fewer for a narrow row: no more than twice as many threads as the row has chunks),
    # and the accumulators in registers where they fit (4 x 7168: 2 chunks a thread, 64 floats).
    h = shape["hidden_size"]
    vec = widest_vec(h)
    cpr = h // vec
    threads = 512
    while threads > 32 and idle_threads_problem(cpr, threads):
        threads //= 2
    c = {"vec": vec, "threads": threads, "grad_w": "regs", "stage": "none"}
    if _acc_regs(shape, c) > _acc_cap(threads):
        c["grad_w"] = "global"
    return c


def constraint(shape, c):
    problem = vec_constraint(shape, c)
    if problem:
        return problem
    problem = idle_threads_problem(shape["hidden_size"] // c["vec"], c["threads"])
    if problem:
        return problem
    if c["grad_w"] == "regs" and _acc_regs(shape, c) > _acc_cap(c["threads"]):
        return (f"grad_w='regs' needs hc_mult * chunks a thread * vec = {_acc_regs(shape, c)} accumulator "
                f"registers, more than {_acc_cap(c['threads'])} at {c['threads']} threads: use grad_w='global' "
                "or more threads")
    if c["stage"] != "none":
        if c["vec"] < 2:
            return f"stage={c['stage']!r} copies chunks with cp.async, 4 bytes at least: vec >= 2"
        need = _stage_bytes(shape, c) + (c["threads"] // 32) * shape["hc_mult"] * 4
        if need > SMEM_MAX:
            return f"stage={c['stage']!r} needs {need} bytes of shared memory a block, more than {SMEM_MAX}"
    return None


def build(shape, c):
    from tilelang import language as T

    m, h, clamp, P = shape["hc_mult"], shape["hidden_size"], shape["clamp_value"], shape["num_partials"]
    vec, threads, regs = c["vec"], c["threads"], c["grad_w"] == "regs"
    stage_xk, stage_go = c["stage"] != "none", c["stage"] == "xk_go"
    cpr = h // vec  # chunks per row
    steps = _steps(shape, c)
    loop = T.unroll  # constraint: at most 128 accumulators; "global" rows: steps <= 2 * hidden / threads
    if not regs and steps > 8:
        loop = T.serial
    warps = threads // 32
    scalar = h**-0.5
    num_tokens, ks, vs = gate_dims(T)
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def engram_gate_bwd(
        grad_out: T.Tensor[(num_tokens, m, h), bf16],
        hidden_states: T.Tensor[(num_tokens, m, h), bf16],
        k: T.StridedTensor[(num_tokens, m, h), ks, bf16],
        v: T.StridedTensor[(num_tokens, h), vs, bf16],
        weight_fused: T.Tensor[(m, h), f32],
        dot: T.Tensor[(num_tokens, m), f32],
        gate_score: T.Tensor[(num_tokens, m), f32],
        rstd_x: T.Tensor[(num_tokens, m), f32],
        rstd_k: T.Tensor[(num_tokens, m), f32],
        grad_x: T.Tensor[(num_tokens, m, h), bf16],
        grad_k: T.Tensor[(num_tokens, m, h), bf16],
        grad_v: T.Tensor[(num_tokens, h), bf16],
        grad_w_partial: T.Tensor[(P, m, h), f32],
    ):
        # Rows start chunk-aligned (the launcher checks it): strides written as multiples of vec, so that
        # the index analysis proves the chunk loads aligned and emits vector loads (as engram_gate_fwd).
        k = T.view(k, strides=((ks[0] // vec) * vec, (ks[1] // vec) * vec, 1))
        v = T.view(v, strides=((vs[0] // vec) * vec, 1))
        with T.Kernel(P, threads=threads) as b:
            tx = T.get_thread_binding()
            gs = T.alloc_local((vec,), bf16)
            xs = T.alloc_local((vec,), bf16)
            kv = T.alloc_local((vec,), bf16)
            vv = T.alloc_local((vec,), bf16)
            ws = T.alloc_local((vec,), f32)
            pw = T.alloc_local((vec,), f32)
            acc = T.alloc_local((vec,), f32)
            ys = T.alloc_local((vec,), bf16)
            zs = T.alloc_local((vec,), bf16)
            gate = T.alloc_local((m,), f32)
            part = T.alloc_local((m,), f32)
            tot = T.alloc_local((m,), f32)
            dr = T.alloc_local((m,), f32)  # dL/d dot
            dx = T.alloc_local((m,), f32)  # dot * rstd_x**2 / hidden
            dk = T.alloc_local((m,), f32)  # dot * rstd_k**2 / hidden
            gw = T.alloc_local((m * steps * vec if regs else 1,), f32)
            red = T.alloc_shared((warps, m), f32)
            if stage_xk:  # a thread's own chunks: written and read by it alone
                xsm = T.alloc_shared((m, h), bf16)
                ksm = T.alloc_shared((m, h), bf16)
            if stage_go:
                gsm = T.alloc_shared((m, h), bf16)
            per = T.ceildiv(num_tokens, P)
            t0 = T.min(per * b, num_tokens)
            t1 = T.min(per * (b + 1), num_tokens)
            if regs:
                for j in T.unroll(m * steps * vec):
                    gw[j] = 0.0
            else:  # this block's row of grad_w_partial accumulates in place: zero the thread's elements
                for s in loop(steps):
                    q = s * threads + tx
                    if q < cpr:
                        for i in T.unroll(m):
                            for e in T.vectorized(vec):
                                grad_w_partial[b, i, q * vec + e] = 0.0
            for tt in T.serial(t1 - t0):
                tok = T.cast(t0, "int64") + tt
                for i in T.unroll(m):
                    gate[i] = gate_score[tok, i]
                    part[i] = 0.0
                if stage_xk:  # x and k on their way while pass 1 and the reduction run
                    for s in loop(steps):
                        q = s * threads + tx
                        col = q * vec
                        if q < cpr:
                            for i in T.unroll(m):
                                T.ptx_cp_async(T.access_ptr(xsm[i, col], "w", vec),
                                               T.access_ptr(hidden_states[tok, i, col], "r", vec), vec)
                                T.ptx_cp_async(T.access_ptr(ksm[i, col], "w", vec),
                                               T.access_ptr(k[tok, i, col], "r", vec), vec)
                    T.ptx_commit_group()
                # pass 1: grad_v, and sum(grad_out * v) per head
                for s in loop(steps):
                    q = s * threads + tx
                    col = q * vec
                    if q < cpr:
                        for e in T.vectorized(vec):
                            vv[e] = v[tok, col + e]
                        for e in T.unroll(vec):
                            acc[e] = 0.0
                        for i in T.unroll(m):
                            for e in T.vectorized(vec):
                                gs[e] = grad_out[tok, i, col + e]
                            if stage_go:
                                for e in T.vectorized(vec):
                                    gsm[i, col + e] = gs[e]
                            for e in T.unroll(vec):
                                part[i] = part[i] + T.cast(gs[e], f32) * T.cast(vv[e], f32)
                                acc[e] = acc[e] + T.cast(gs[e], f32) * gate[i]
                        for e in T.unroll(vec):
                            ys[e] = T.cast(acc[e], bf16)
                        for e in T.vectorized(vec):
                            grad_v[tok, col + e] = ys[e]
                for i in T.unroll(m):
                    part[i] = T.warp_reduce_sum(part[i])
                if warps > 1:
                    if tx % 32 == 0:
                        for i in T.unroll(m):
                            red[tx // 32, i] = part[i]
                    T.sync_threads()
                    for i in T.unroll(m):
                        tot[i] = red[0, i]
                        for w in T.unroll(1, warps):
                            tot[i] = tot[i] + red[w, i]
                else:
                    for i in T.unroll(m):
                        tot[i] = part[i]
                # the gate's derivative, as TileKernels forms it (float32, its operation order)
                for i in T.unroll(m):
                    dot_i = dot[tok, i]
                    rx = rstd_x[tok, i]
                    rk = rstd_k[tok, i]
                    dr[i] = T.if_then_else(
                        T.abs(dot_i) * scalar * rx * rk < clamp,
                        T.float32(0),
                        tot[i] * gate[i] * (T.float32(1) - gate[i]) * T.float32(0.5)
                        * T.sqrt(scalar * rx * rk / T.abs(dot_i)),
                    )
                    dx[i] = dot_i * rx * rx / T.float32(h)
                    dk[i] = dot_i * rk * rk / T.float32(h)
                # pass 2: grad_x, grad_k, and weight_fused's gradient
                if stage_xk:
                    T.ptx_wait_group(0)
                for s in loop(steps):
                    q = s * threads + tx
                    col = q * vec
                    if q < cpr:
                        for i in T.unroll(m):
                            if stage_go:
                                for e in T.vectorized(vec):
                                    gs[e] = gsm[i, col + e]
                            else:
                                for e in T.vectorized(vec):
                                    gs[e] = grad_out[tok, i, col + e]
                            if stage_xk:
                                for e in T.vectorized(vec):
                                    xs[e] = xsm[i, col + e]
                                for e in T.vectorized(vec):
                                    kv[e] = ksm[i, col + e]
                            else:
                                for e in T.vectorized(vec):
                                    xs[e] = hidden_states[tok, i, col + e]
                                for e in T.vectorized(vec):
                                    kv[e] = k[tok, i, col + e]
                            for e in T.vectorized(vec):
                                ws[e] = weight_fused[i, col + e]
                            for e in T.unroll(vec):
                                ys[e] = T.cast(T.cast(gs[e], f32) + dr[i] * (T.cast(kv[e], f32) * ws[e]
                                                                             - T.cast(xs[e], f32) * dx[i]), bf16)
                                zs[e] = T.cast(dr[i] * (T.cast(xs[e], f32) * ws[e] - T.cast(kv[e], f32) * dk[i]),
                                               bf16)
                            for e in T.vectorized(vec):
                                grad_x[tok, i, col + e] = ys[e]
                            for e in T.vectorized(vec):
                                grad_k[tok, i, col + e] = zs[e]
                            if regs:
                                for e in T.unroll(vec):
                                    gw[(i * steps + s) * vec + e] = gw[(i * steps + s) * vec + e] + dr[i] * T.cast(
                                        xs[e], f32) * T.cast(kv[e], f32)
                            else:
                                for e in T.vectorized(vec):
                                    pw[e] = grad_w_partial[b, i, col + e]
                                for e in T.unroll(vec):
                                    pw[e] = pw[e] + dr[i] * T.cast(xs[e], f32) * T.cast(kv[e], f32)
                                for e in T.vectorized(vec):
                                    grad_w_partial[b, i, col + e] = pw[e]
                if warps > 1 or stage_xk:
                    T.sync_threads()  # red is reused by the next token; pass 2's reads before the next copies
            if regs:
                for s in T.unroll(steps):
                    q = s * threads + tx
                    if q < cpr:
                        for i in T.unroll(m):
                            for e in T.vectorized(vec):
                                grad_w_partial[b, i, q * vec + e] = gw[(i * steps + s) * vec + e]

    return engram_gate_bwd


def make_inputs(shape, device="cpu", seed=0):
    """grad_out, hidden_states, k, v, weight_fused (`gate_inputs`), then the forward's saved values computed
    from them with the forward's default eps 1e-6 (float64 rounded once to float32, as engram_gate_fwd writes
    them to rounding)."""
    from tkjit_kernels.engram._gate import forward64

    go, x, k, v, w = gate_inputs(shape, "cpu", seed, grad=True)
    _, *saved = forward64(x, k, v, w, 1e-6, shape["clamp_value"])
    out = (go, x, k, v, w, *(t.float() for t in saved))
    return tuple(t.to(device) for t in out)


def reference(shape, grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k):
    """The closed forms in float64 from the saved values (`_gate.backward64`), each rounded once."""
    gx, gk, gv, gw = backward64(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k,
                                shape["clamp_value"], shape["num_partials"])
    return gx.to(hidden_states.dtype), gk.to(k.dtype), gv.to(v.dtype), gw.float()


def _partial_bytes(s) -> int:
    return s["num_partials"] * s["hc_mult"] * s["hidden_size"] * 4


SPEC = register(
    KernelSpec(
        name="engram_gate_bwd",
        doc="Engram gate backward: grad_x, grad_k, grad_v (bf16) and per-block partial sums of weight_fused's "
            "gradient (float32)",
        params=BWD_PARAMS,
        space={
            "vec": (1, 2, 4, 8),
            "threads": THREADS,
            "grad_w": ("regs", "global"),
            "stage": tuple(STAGES),
        },
        added={"stage": "none"},
        default=default,
        constraint=constraint,
        check_shape=partials_check,
        build=build,
        inputs=(heads_arg("grad_out"), heads_arg("hidden_states"), heads_arg("k", strided=True),
                v_arg("v", strided=True), weight_arg("weight_fused"), *(saved_arg(n) for n in SAVED)),
        outputs=(heads_arg("grad_x"), heads_arg("grad_k"), v_arg("grad_v"),
                 TensorArg("grad_w_partial", "float32", ("num_partials", "hc_mult", "hidden_size"),
                           align=lambda s, c: 4 * c["vec"])),
        make_inputs=make_inputs,
        reference=reference,
        # grad_out read twice (the second an L2 hit, not counted), x and k once, v once; grad_x, grad_k,
        # grad_v written once; the saved values; weight_fused and the partials once per block.
        bytes_moved=lambda s: 5 * row_bytes(s) + 2 * s["num_tokens"] * s["hidden_size"] * 2 + saved_bytes(s)
        + _partial_bytes(s) + s["hc_mult"] * s["hidden_size"] * 4,
        flops=lambda s: 16 * s["num_tokens"] * s["hc_mult"] * s["hidden_size"],
        examples=EXAMPLES,
        **{**COMMON, "pass_configs": _pass_configs},
    )
)
