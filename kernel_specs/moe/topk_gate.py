"""topk_gate: the k highest-scoring experts of every token, best first, ties to the smaller index.

scores (num_tokens, num_experts) float32 -> indices (num_tokens, k) int64, equal to
`torch.sort(scores, -1, descending=True, stable=True).indices[:, :k]` (TileKernels' `stable_topk`).
-0.0 and +0.0 compare equal (as in torch); NaN scores are not supported.

Any num_experts from 1 to 1024 and any k <= num_experts.

Layout: a token is owned by a group of `lanes` consecutive lanes of one warp (1 = a thread per
token, 32 = a warp per token). Lane l holds ceil(num_experts / (lanes * vec)) chunks of `vec`
consecutive experts in registers: chunk c = j * lanes + l covers experts [c * vec, c * vec + vec),
so a warp's loads are coalesced and, inside one lane, the expert index grows with the register slot.
When lanes * vec does not divide num_experts, the last chunk row is partial: lanes past the end
load nothing (no read beyond the row) and their slots hold key 0, the "taken" key, so they never
win while a real score is left (k <= num_experts). vec=4 needs num_experts % 4 == 0, so a chunk
is wholly inside the row and 16-byte aligned. Counts that lanes * vec divides compile exactly as
before; a non-power-of-two count takes the next power of two's lanes and vec (`default`), so no
lane holds more than there and the per-token time stays at or below it.

Scores become order-preserving uint32 keys (-0 folded into +0); key 0 marks "taken". Two ways to
pick k winners, `cache`:
  0     k rounds of: lane-local argmax over all its keys, group reduction on (key, index) with the
        tie rule, the owner clears the winner. ~5 ALU ops per register per round.
  t>0   each lane first keeps a sorted list of its t best (key, index) plus the (t+1)-th key; the
        k rounds only reduce the list heads and the winner pops its head (O(t) per round,
        independent of num_experts). A lane that used up its t entries knows only a bound on its
        next key; if that bound reaches a round's winning key, the warp redoes its tokens with the
        `cache=0` rounds (always exact; for random scores, a warp per token and k=8 that is ~3% of
        tokens with cache=2, ~0.1% with 3).
Up to 32 rounds are unrolled and each lane keeps its results in registers; for larger k the
rounds are a loop (cache=0) and the winner's owner stores it at once (correct, O(k * per_lane)).
Group reductions use `shfl` butterflies, or for a warp per token `redux` (`redux.sync` max on the
key, then min on the index among lanes holding the max: two instructions instead of ten shuffles).
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance, plain_threads

MAX_EXPERTS = 1024
MAX_PER_LANE = 64  # registers of keys per lane (plus the float staging copy): beyond this it spills
MAX_UNROLLED_K = 32  # more rounds than this run as a loop: unrolled, code size grows as k * per_lane


def _pow2_ceil(e):
    return 1 << max(0, e - 1).bit_length()


def layout(e: int, lanes: int, vec: int) -> tuple[int, int, int]:
    """(slots per lane, chunk rows every lane holds, lanes holding a chunk of the partial row after them).

    Slot s of lane l is expert (s // vec * lanes + l) * vec + s % vec; the partial row exists when
    slots > rows * vec, and there only lanes below the third value hold experts (the rest: key 0).
    """
    rows = e // (lanes * vec)
    return -(-e // (lanes * vec)) * vec, rows, (e - rows * lanes * vec) // vec


def default(shape):
    e, k = shape["num_experts"], shape["k"]
    # A warp per token for wide rows (8-16 scores per lane, redux reductions, head lists: the k
    # rounds cost O(1) each); narrower groups for small expert counts so no lane idles.
    # A count that is not a power of two takes the next power of two's layout: each lane holds at
    # most what it holds there (the last chunk partial), and the row has fewer bytes to read.
    # (16..512 keep the layouts they always had: 384 takes 512's, which is the same.)
    p = _pow2_ceil(e)
    lanes = 32 if p >= 256 else max(1, min(32, p // 8))
    vec = 4 if (p // lanes) % 4 == 0 and e % 4 == 0 else 1
    per_lane = layout(e, lanes, vec)[0]
    # Head lists pay off while a lane rarely supplies more than `cache` of the k winners (random
    # scores, a warp per token, k=8: 2 entries fall back on ~3% of tokens, 3 on ~0.1%).
    cache = (2 if k <= 8 else 3) if lanes == 32 else 3 if lanes == 16 else 4
    if cache >= per_lane or k == 1 or 4 * k > lanes * (cache + 1) or k > MAX_UNROLLED_K:
        cache = 0
    return {
        "lanes": lanes,
        "vec": vec,
        "threads": 128,
        "tokens_per_group": 1,
        "cache": cache,
        "reduce": "redux" if lanes == 32 else "shfl",
    }


def check_shape(shape):
    if shape["k"] > shape["num_experts"]:
        return f"k={shape['k']} must be <= num_experts={shape['num_experts']}"
    return None


def constraint(shape, c):
    e, lanes, vec = shape["num_experts"], c["lanes"], c["vec"]
    if e % vec:
        return f"vec={vec} loads need num_experts={e} to be a multiple of {vec} (aligned, inside the row)"
    if lanes * vec > e:
        return f"lanes*vec={lanes * vec} > num_experts={e}: some lanes would hold no expert"
    per_lane = layout(e, lanes, vec)[0]
    if per_lane > MAX_PER_LANE:
        return f"{per_lane} scores per lane would spill (max {MAX_PER_LANE})"
    if c["threads"] % lanes:
        return "threads must be a multiple of lanes"
    if c["reduce"] == "redux" and lanes != 32:
        return "redux.sync reduces a whole warp: needs lanes=32"
    if c["cache"] and c["cache"] >= per_lane:
        return "cache holds every score of a lane: same as cache=0"
    if c["cache"] and shape["k"] == 1:
        return "k=1 is a single round: cache adds nothing"
    if c["cache"] and shape["k"] > MAX_UNROLLED_K:
        return f"k > {MAX_UNROLLED_K} runs its rounds as a loop: head lists need unrolled rounds (cache=0)"
    return None


def arch_constraint(arch, c, shape):
    if arch == "cpu":
        return "needs warp shuffles: CUDA targets only"
    if c["reduce"] == "redux" and int(arch[3:].rstrip("af")) < 80:
        return "redux.sync needs sm_80 or newer"
    return None


def build(shape, c):
    from tilelang import language as T

    E, K = shape["num_experts"], shape["k"]
    L, vec, threads, tpg = c["lanes"], c["vec"], c["threads"], c["tokens_per_group"]
    cache, use_redux = c["cache"], c["reduce"] == "redux"
    per_lane, full_chunks, valid_lanes = layout(E, L, vec)
    partial = per_lane > full_chunks * vec  # static: counts that lanes * vec divides compile as before
    big_k = K > MAX_UNROLLED_K
    rounds = T.serial if big_k else T.unroll
    LOG_L = L.bit_length() - 1
    groups = threads // L  # tokens in flight per block
    block_tokens = groups * tpg
    nres = (K + L - 1) // L  # results each lane stores
    num_tokens = T.dynamic("num_tokens")
    u32, i32 = T.uint32, T.int32
    FULL = T.uint32(0xFFFFFFFF)
    NONE = T.uint32(0xFFFFFFFF)  # "no index" for the min-reduction

    def slot_index(s):
        # Expert index of register slot s of this lane, minus lane * vec.
        return (s // vec) * (L * vec) + s % vec

    @T.macro
    def reduce_pair(key, gi):
        # (key, gi) <- the group's best pair: larger key, then smaller index. Every lane gets it.
        if use_redux:
            m = T.call_extern("uint32", "__reduce_max_sync", FULL, key[0])
            gi[0] = T.call_extern("uint32", "__reduce_min_sync", FULL, T.if_then_else(key[0] == m, gi[0], NONE))
            key[0] = m
        else:
            for step in T.unroll(LOG_L):
                off = (L // 2) >> step
                ok = T.shfl_xor(key[0], off)
                oi = T.shfl_xor(gi[0], off)
                take = (ok > key[0]) | ((ok == key[0]) & (oi < gi[0]))
                key[0] = T.if_then_else(take, ok, key[0])
                gi[0] = T.if_then_else(take, oi, gi[0])

    @T.macro
    def record(res, r, gi, lane, tok, topk_idx):
        if big_k:
            # Rounds are a loop: a dynamic index would put `res` in local memory; store at once.
            if (lane == r % L) & (tok < num_tokens):
                topk_idx[tok, r] = T.cast(gi[0], T.int64)
        elif lane == r % L:
            res[r // L] = gi[0]

    @T.macro
    def rescan_rounds(keys, res, bk, gi, lane, lane_off, tok, topk_idx):
        for r in rounds(K):
            bk[0] = keys[0]
            gi[0] = T.uint32(slot_index(0)) + lane_off
            for s in T.unroll(1, per_lane):
                better = keys[s] > bk[0]
                bk[0] = T.if_then_else(better, keys[s], bk[0])
                gi[0] = T.if_then_else(better, T.uint32(slot_index(s)) + lane_off, gi[0])
            reduce_pair(bk, gi)
            record(res, r, gi, lane, tok, topk_idx)
            if r + 1 < K:
                for s in T.unroll(per_lane):
                    keys[s] = T.if_then_else(gi[0] == T.uint32(slot_index(s)) + lane_off, T.uint32(0), keys[s])

    @T.prim_func
    def topk_gate(
        scores: T.Tensor[(num_tokens, E), T.float32],
        topk_idx: T.Tensor[(num_tokens, K), T.int64],
    ):
        with T.Kernel(T.ceildiv(num_tokens, block_tokens), threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((per_lane,), T.float32)
            keys = T.alloc_local((per_lane,), u32)
            res = None
            if not big_k:
                res = T.alloc_local((nres,), u32)
            bk = T.alloc_local((1,), u32)
            gi = T.alloc_local((1,), u32)
            if cache > 0:
                hk = T.alloc_local((cache + 1,), u32)  # the t best keys, then the (t+1)-th: a bound
                hi = T.alloc_local((cache,), u32)  # expert indices of the t best
                bad = T.alloc_local((1,), i32)
            lane = tx % L
            lane_off = T.cast(lane * vec, u32)
            for it in T.serial(tpg):
                tok = bx * block_tokens + it * groups + tx // L
                tc = T.min(tok, num_tokens - 1)  # tail groups compute a valid row, store nothing
                for j in T.unroll(full_chunks):
                    for v in T.vectorized(vec):
                        xs[j * vec + v] = scores[tc, (j * L + lane) * vec + v]
                if partial:
                    # Lanes past the row's end read nothing (their slots become key 0 below).
                    if lane < valid_lanes:
                        for v in T.vectorized(vec):
                            xs[full_chunks * vec + v] = scores[tc, (full_chunks * L + lane) * vec + v]
                    else:
                        for v in T.unroll(vec):
                            xs[full_chunks * vec + v] = T.float32(0.0)
                for s in T.unroll(per_lane):
                    # Order-preserving key; adding +0 turns -0 into +0 so they tie like in torch.
                    b = T.reinterpret(T.ieee_add(xs[s], T.float32(0.0)), u32)
                    keys[s] = b ^ (T.reinterpret(T.reinterpret(b, i32) >> 31, u32) | T.uint32(0x80000000))
                if partial:
                    # Key 0 ("taken") never wins while a real score is left: k <= num_experts.
                    for v in T.unroll(vec):
                        keys[full_chunks * vec + v] = T.if_then_else(
                            lane < valid_lanes, keys[full_chunks * vec + v], T.uint32(0)
                        )
                if not big_k:
                    for q in T.unroll(nres):
                        res[q] = T.uint32(0)
                if cache:
                    for j in T.unroll(cache + 1):
                        hk[j] = T.uint32(0)
                    for j in T.unroll(cache):
                        hi[j] = NONE
                    for s in T.unroll(per_lane):
                        # Insert (keys[s], index) into the descending list; equal keys keep the
                        # earlier (smaller) index first because slots are visited in index order.
                        # From the tail up, so entry j-1 is still the old one when j reads it.
                        mine = T.uint32(slot_index(s)) + lane_off
                        for jj in T.unroll(cache + 1):
                            j = cache - jj
                            up = T.max(j - 1, 0)
                            shift = (j > 0) & (keys[s] > hk[up])
                            if j < cache:
                                hi[T.min(j, cache - 1)] = T.if_then_else(
                                    keys[s] > hk[j], T.if_then_else(shift, hi[up], mine), hi[T.min(j, cache - 1)]
                                )
                            hk[j] = T.if_then_else(keys[s] > hk[j], T.if_then_else(shift, hk[up], keys[s]), hk[j])
                    bad[0] = 0
                    for r in T.unroll(K):
                        bk[0] = hk[0]
                        gi[0] = hi[0]
                        reduce_pair(bk, gi)
                        # A lane that used up its t entries only knows a bound on its next key; if
                        # that bound reaches the winning key, the winner may be wrong: redo.
                        bad[0] = bad[0] | T.if_then_else((hi[0] == NONE) & (hk[0] >= bk[0]), 1, 0)
                        record(res, r, gi, lane, tok, topk_idx)
                        if r + 1 < K:
                            won = hi[0] == gi[0]
                            for j in T.unroll(cache):
                                hk[j] = T.if_then_else(won, hk[j + 1], hk[j])
                            for j in T.unroll(cache - 1):
                                hi[j] = T.if_then_else(won, hi[j + 1], hi[j])
                            hk[cache] = T.if_then_else(won, T.uint32(0), hk[cache])
                            hi[cache - 1] = T.if_then_else(won, NONE, hi[cache - 1])
                    if T.any_sync(bad[0]) != 0:
                        rescan_rounds(keys, res, bk, gi, lane, lane_off, tok, topk_idx)
                else:
                    rescan_rounds(keys, res, bk, gi, lane, lane_off, tok, topk_idx)
                if not big_k:
                    if tok < num_tokens:
                        for q in T.unroll(nres):
                            if q * L + lane < K:
                                topk_idx[tok, q * L + lane] = T.cast(res[q], T.int64)

    return topk_gate


def make_inputs(shape, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, e = shape["num_tokens"], shape["num_experts"]
    x = torch.randn(n, e, generator=g, dtype=torch.float32)
    if seed % 2 == 1:
        # Odd seeds: coarse values (ties everywhere), signed zeros, infinities.
        x = (x * 4).round() / 4
        x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
        if n * e > 8:
            flat = x.view(-1)
            pos = torch.randint(0, n * e, (max(1, n * e // 64),), generator=g)
            flat[pos] = torch.where(torch.rand(pos.numel(), generator=g) < 0.5, float("inf"), float("-inf"))
    return (x.to(device),)


def reference(shape, scores):
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : shape["k"]].contiguous()


pass_configs = plain_threads


SPEC = register(
    KernelSpec(
        name="topk_gate",
        family="moe",
        doc="indices of the k best experts per token (descending, ties to the smaller index)",
        params=(
            Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
            Static("num_experts", lo=1, hi=MAX_EXPERTS, default=256, doc="experts (scores per token)"),
            Static("k", lo=1, hi=MAX_EXPERTS, default=8, doc="experts selected per token (<= num_experts)"),
        ),
        space={
            "lanes": (1, 2, 4, 8, 16, 32),
            "vec": (1, 4),
            "threads": (128, 256),
            "tokens_per_group": (1, 2),
            "cache": (0, 2, 3, 4),
            "reduce": ("shfl", "redux"),
        },
        default=default,
        constraint=constraint,
        arch_constraint=arch_constraint,
        check_shape=check_shape,
        build=build,
        pass_configs=pass_configs,
        inputs=(TensorArg("scores", "float32", ("num_tokens", "num_experts")),),
        outputs=(TensorArg("topk_idx", "int64", ("num_tokens", "k")),),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        bytes_moved=lambda s: s["num_tokens"] * (s["num_experts"] * 4 + s["k"] * 8),
        examples=(
            {"num_tokens": 4096, "num_experts": 256, "k": 8},
            {"num_tokens": 65536, "num_experts": 256, "k": 8},
            {"num_tokens": 4096, "num_experts": 64, "k": 6},
            {"num_tokens": 16384, "num_experts": 64, "k": 6},
        ),
    )
)
