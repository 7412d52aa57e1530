"""top2_sum_gate: DeepSeek-V3-style grouped routing (TileKernels' `top2_sum_gate`, core path).

logits (num_tokens, num_experts) float32, bias (num_experts,) float32 -> topk_idx (num_tokens,
num_topk + num_shared_experts) int64 and topk_weights (same shape) float32. Per token:

1. scores = scoring_func(logits): sigmoid `1 / (1 + exp(-x))`; sqrtsoftplus `sqrt(x > 20 ? x :
   log1p(exp(x)))`; softmax `exp(x - max) / sum`, the sum taken in TileKernels' kernel order (lane l
   of a warp adds experts i * 128 + 4 l + j, i then j, from 0.0; then a butterfly over lanes 16, 8, 4,
   2, 1).
2. Selection keys: logits + bias for softmax, scores + bias otherwise (the bias only steers selection).
3. Groups (num_groups != num_topk_groups): a group's value is the sum of its two largest keys; the
   num_topk_groups best groups are kept (equal sums: the smaller group), the other experts are out.
4. The num_topk best keys among the kept experts, best first, equal keys to the smaller expert index
   (a stable descending sort, TileKernels' `stable_topk`); -0.0 and +0.0 compare equal.
   with has_fix: a token whose fix_routing_mask is non-zero skips 3-4 and takes the indices in its
   unmapped_topk_idx row, in that order (TileKernels' fixed routing).
5. weights = score / (1e-20 + s_0 + ... + s_{k-1}) * routed_scaling_factor (the sum added in order,
   as TileKernels' kernel; s_r: the unbiased score at the r-th index, clamped into [0, num_experts) for a
   fixed index); then num_shared_experts slots: expert num_experts + j, weight 1.0.
   with has_unmapped: unmapped_topk_idx[token, r] (r < num_topk) is set to the r-th index of this step (the
   logical expert, before 6 and 7), or -1 for a token its mask leaves out (8), in place; any row stride.
6. with has_map: every index i becomes to_physical_map[i, (ep_rank + token * 23333) % logical_count[i]]
   (int64 arithmetic); a count outside [1, num_duplicates] gives -1 (never an access out of bounds).
7. EP/TP remap with per_gpu = (num_experts + num_duplicates - 1) // num_ep_ranks experts per GPU (the
   caller passes it): GPU g = i // per_gpu keeps i only on TP rank g % num_tp_ranks, renumbered to
   (g // num_tp_ranks) * per_gpu + i % per_gpu; other indices (and negative ones) become -1.
8. with has_mask: a token whose mask is 0 gets -1 indices and 0.0 weights (TileKernels' bool `mask`,
   passed as int8: mask.view(torch.int8)).

num_experts % 4 == 0 and <= 1024 (TileKernels asserts the first), num_topk <= 32 (a lane per result),
num_topk + num_shared_experts <= 32; with groups: num_groups <= 32, num_experts % num_groups == 0, at
least 2 experts per group and num_topk <= num_topk_groups * experts per group. Non-finite logits are
not supported (TileKernels asserts on them): outputs are then unspecified but always in bounds. Neither
are fixed indices outside [0, num_experts) (TileKernels asserts >= 0): such an index is kept as it is (a
negative one, or one outside the map's rows, becomes -1 in topk_idx), its score read at the clamped index;
nothing is read or written out of bounds. fix_routing_mask is TileKernels' bool mask as int8, like the mask;
has_fix needs has_unmapped.

Layouts (`layout`):
  warp    a warp per token (TileKernels' layout): lane l holds experts i * 128 + 4 l + j (16-byte loads
          of logits and bias), computes scores, stages the keys and the scores in shared memory for the
          group sums (lane g < num_groups takes group g, ranks by shuffles, a ballot gives the kept groups)
          and the weights; num_topk rounds of lane argmax + warp reduction on order-preserving uint32
          keys (`reduce`: shuffle butterflies or `redux.sync`). `tokens_per_warp` tokens in turn per warp.
          A fixed token (has_fix) skips the groups and the rounds (a warp-uniform branch).
  thread  one thread per token, all in registers (float compares, no shuffles): TileLang's C target
          lowers it, so CPU hosts run it. A fixed token's selection is computed and left unused.
Tunable: layout, threads, tokens_per_warp, reduce.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, ScalarArg, Static, TensorArg, Tolerance, stride_name

SCORING = ("sigmoid", "sqrtsoftplus", "softmax")
MAX_EXPERTS = 1024
PRIME = 23333  # TileKernels' replica spreading: (ep_rank + token * PRIME) % logical_count


def _grouped(shape) -> bool:
    return shape["num_groups"] != shape["num_topk_groups"]


def default(shape):
    # A warp per token: 8 experts per lane at 256, 16-byte loads, redux reductions (two instructions
    # per round instead of ten shuffles); 4 warps per block keeps enough tokens in flight per SM.
    return {"layout": "warp", "threads": 128, "tokens_per_warp": 1, "reduce": "redux"}


def check_shape(shape):
    e, k, g, kg, s = (shape[n] for n in ("num_experts", "num_topk", "num_groups", "num_topk_groups",
                                         "num_shared_experts"))
    if e % 4:
        return f"num_experts={e} must be a multiple of 4 (TileKernels' vector loads)"
    if k > e:
        return f"num_topk={k} must be <= num_experts={e}"
    if k + s > 32:
        return f"num_topk + num_shared_experts = {k + s} must be <= 32 (a lane per result)"
    if (g == 0) != (kg == 0):
        return "num_groups and num_topk_groups must be both zero or both non-zero"
    if kg > g:
        return f"num_topk_groups={kg} must be <= num_groups={g}"
    if shape["has_fix"] and not shape["has_unmapped"]:
        return ("has_fix (fix_routing_mask) needs has_unmapped (unmapped_topk_idx): the fixed tokens' indices are "
                "read from it")
    if g != kg:
        if e % g:
            return f"num_experts={e} must be divisible by num_groups={g}"
        if e // g < 2:
            return f"groups need >= 2 experts each (top-2 sums), got {e // g}"
        if k > kg * (e // g):
            return f"num_topk={k} must be <= num_topk_groups * experts per group = {kg * (e // g)}"
    return None


def constraint(shape, c):
    if c["layout"] == "thread" and (c["tokens_per_warp"] != 1 or c["reduce"] != "shfl"):
        return "layout=thread has no warps: tokens_per_warp=1 and reduce=shfl only"
    if c["layout"] == "warp" and c["threads"] // 32 * shape["num_experts"] * 8 > 48 * 1024:
        return "two float rows of num_experts per warp exceed 48 KiB of shared memory: fewer threads"
    return None


def arch_constraint(arch, c, shape):
    if arch == "cpu":
        return "layout=warp needs warp shuffles: CUDA targets only" if c["layout"] != "thread" else None
    if c["reduce"] == "redux" and int(arch[3:].rstrip("af")) < 80:
        return "redux.sync needs sm_80 or newer"
    return None


def pass_configs(c):
    # The warp layout orders its shared-memory accesses with __syncwarp itself (a warp owns its rows).
    # No fast math: expf / IEEE division, as TileKernels' kernel (bit-exact with it on the H200).
    return {"tl.disable_warp_specialized": True, "tl.disable_thread_storage_sync": c["layout"] == "warp",
            "tl.enable_fast_math": False}


def build(shape, c):
    from tilelang import language as T

    E, K, G, KG = shape["num_experts"], shape["num_topk"], shape["num_groups"], shape["num_topk_groups"]
    S, scoring, has_map = shape["num_shared_experts"], shape["scoring_func"], shape["has_map"]
    has_mask, has_fix, has_unmapped = shape["has_mask"], shape["has_fix"], shape["has_unmapped"]
    grouped = _grouped(shape)
    EPG = E // G if grouped else E
    P = K + S
    f32, i32, i64, u32 = T.float32, T.int32, T.int64, T.uint32
    num_tokens = T.dynamic("num_tokens")
    num_dup = shape["num_duplicates"]
    NL = E + S  # logical experts (rows of the map)

    def score_of(x):
        if scoring == "sigmoid":
            return T.float32(1.0) / (T.float32(1.0) + T.exp(-x))
        if scoring == "sqrtsoftplus":
            return T.sqrt(T.if_then_else(x > T.float32(20.0), x, T.log1p(T.exp(x))))
        return x  # softmax: normalised by the caller

    @T.macro
    def finish(idx, tok, ep_rank, per_gpu, tp_rank, num_tp_ranks, to_physical_map, logical_count):
        # idx[0]: the logical expert (int64) -> physical (has_map) -> this TP rank's local index or -1.
        if has_map:
            li = idx[0]
            ok = (li >= 0) & (li < NL)
            lc = T.if_then_else(ok, T.cast(logical_count[T.if_then_else(ok, li, 0)], i64), T.int64(0))
            ok2 = ok & (lc >= 1) & (lc <= T.int64(num_dup))
            lcs = T.max(lc, T.int64(1))
            dup = T.truncmod(T.cast(ep_rank, i64) + T.cast(tok, i64) * PRIME, lcs)
            safe_li = T.if_then_else(ok2, li, 0)
            safe_dup = T.if_then_else(ok2 & (dup >= 0), dup, 0)
            idx[0] = T.if_then_else(ok2 & (dup >= 0), T.cast(to_physical_map[safe_li, safe_dup], i64),
                                    T.int64(-1))
        pg = T.cast(T.max(per_gpu, 1), i64)
        tps = T.cast(T.max(num_tp_ranks, 1), i64)
        g = T.truncdiv(idx[0], pg)  # idx >= 0 where it matters: trunc == floor
        q = T.truncdiv(g, tps)
        keep = (idx[0] >= 0) & (g - q * tps == T.cast(tp_rank, i64)) & (per_gpu > 0) & (num_tp_ranks > 0)
        idx[0] = T.if_then_else(keep, q * pg + (idx[0] - g * pg), T.int64(-1))

    if c["layout"] == "thread":
        threads = c["threads"]
        NSLOT = -(-E // 128) * 32 * 4  # the warp layout's padded expert range, for the softmax sum order

        @T.macro
        def body(tok, logits, bias, mask, to_physical_map, logical_count, fix_routing_mask, unmapped_topk_idx,
                 topk_idx, topk_weights, routed_scaling_factor, ep_rank, per_gpu, tp_rank, num_tp_ranks):
            act = T.alloc_local((1,), i32)  # 0: a masked token (-1 / 0.0 out)
            sc = T.alloc_local((E,), f32)
            key = T.alloc_local((E,), f32)
            out_ok = T.alloc_local((E,), i32)  # 1: still selectable
            lane_sum = T.alloc_local((32,), f32)
            tmp = T.alloc_local((32,), f32)
            gsum = T.alloc_local((G if grouped else 1,), f32)
            top = T.alloc_local((2,), f32)
            res = T.alloc_local((K,), i32)
            best = T.alloc_local((1,), f32)
            bi = T.alloc_local((1,), i32)
            rank = T.alloc_local((1,), i32)
            tot = T.alloc_local((1,), f32)
            idx = T.alloc_local((1,), i64)
            if has_fix:
                chosen = T.alloc_local((K,), i64)  # the logical indices: the selection's or the caller's
            for e in T.serial(E):
                sc[e] = score_of(logits[tok, e])
                out_ok[e] = 1
            if scoring == "softmax":
                best[0] = logits[tok, 0]
                for e in T.serial(E):
                    best[0] = T.max(best[0], logits[tok, e])
                for e in T.serial(E):
                    sc[e] = T.exp(logits[tok, e] - best[0])
                for ln in T.serial(32):
                    lane_sum[ln] = T.float32(0.0)
                for e in T.serial(NSLOT):
                    # Slot order of lane (e // 4) % 32: chunk e // 128, then e % 4.
                    if e < E:
                        lane_sum[(e // 4) % 32] = lane_sum[(e // 4) % 32] + sc[e]
                for st in T.serial(5):
                    off = 16 >> st
                    for ln in T.serial(32):
                        tmp[ln] = lane_sum[ln] + lane_sum[ln ^ off]
                    for ln in T.serial(32):
                        lane_sum[ln] = tmp[ln]
                for e in T.serial(E):
                    sc[e] = sc[e] / lane_sum[0]
                    key[e] = logits[tok, e] + bias[e]
            else:
                for e in T.serial(E):
                    key[e] = sc[e] + bias[e]
            if grouped:
                for g in T.serial(G):
                    top[0] = -T.infinity(f32)
                    top[1] = -T.infinity(f32)
                    for j in T.serial(EPG):
                        x = key[g * EPG + j]
                        top[1] = T.if_then_else(x > top[0], top[0], T.if_then_else(x > top[1], x, top[1]))
                        top[0] = T.if_then_else(x > top[0], x, top[0])
                    gsum[g] = top[0] + top[1]
                for g in T.serial(G):
                    rank[0] = 0
                    for h in T.serial(G):
                        rank[0] = rank[0] + T.if_then_else(
                            (gsum[h] > gsum[g]) | ((gsum[h] == gsum[g]) & (h < g)), 1, 0)
                    if rank[0] >= KG:
                        for j in T.serial(EPG):
                            out_ok[g * EPG + j] = 0
            for r in T.serial(K):
                bi[0] = -1
                best[0] = T.float32(0.0)
                for e in T.serial(E):
                    # First selectable expert, then strictly larger keys: ties to the smaller index.
                    if (out_ok[e] == 1) & ((bi[0] < 0) | (key[e] > best[0])):
                        bi[0] = e
                        best[0] = key[e]
                res[r] = T.max(bi[0], 0)
                out_ok[T.max(bi[0], 0)] = 0
            if has_fix:
                for r in T.serial(K):
                    chosen[r] = T.cast(res[r], i64)
                if fix_routing_mask[tok] != T.int8(0):
                    # A fixed token keeps the caller's indices, in their order (its selection above is unused);
                    # its scores are read at the index clamped into [0, E): any index stays in bounds.
                    for r in T.serial(K):
                        chosen[r] = unmapped_topk_idx[tok, r]
                        res[r] = T.cast(T.min(T.max(chosen[r], T.int64(0)), T.int64(E - 1)), i32)
            tot[0] = T.float32(1e-20)
            for r in T.serial(K):
                tot[0] = tot[0] + sc[res[r]]
            for r in T.serial(P):
                act[0] = 1
                if has_mask:
                    act[0] = T.if_then_else(mask[tok] != T.int8(0), 1, 0)
                if r < K:
                    if has_fix:
                        idx[0] = chosen[r]
                    else:
                        idx[0] = T.cast(res[r], i64)
                    topk_weights[tok, r] = T.if_then_else(act[0] == 1, sc[res[r]] / tot[0] * routed_scaling_factor,
                                                          T.float32(0.0))
                    if has_unmapped:  # the logical index, before the replica map and the EP/TP remap
                        unmapped_topk_idx[tok, r] = T.if_then_else(act[0] == 1, idx[0], T.int64(-1))
                else:
                    idx[0] = T.cast(E + r - K, i64)
                    topk_weights[tok, r] = T.if_then_else(act[0] == 1, T.float32(1.0), T.float32(0.0))
                finish(idx, tok, ep_rank, per_gpu, tp_rank, num_tp_ranks, to_physical_map, logical_count)
                topk_idx[tok, r] = T.if_then_else(act[0] == 1, idx[0], T.int64(-1))

        @T.macro
        def run(logits, bias, mask, to_physical_map, logical_count, fix_routing_mask, unmapped_topk_idx, topk_idx,
                topk_weights, routed_scaling_factor, ep_rank, per_gpu, tp_rank, num_tp_ranks):
            with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as bx:
                for t in T.Parallel(threads):
                    if bx * threads + t < num_tokens:
                        body(bx * threads + t, logits, bias, mask, to_physical_map, logical_count, fix_routing_mask,
                             unmapped_topk_idx, topk_idx, topk_weights, routed_scaling_factor, ep_rank, per_gpu,
                             tp_rank, num_tp_ranks)

        return _prim_func(T, run, shape, num_tokens)

    # -- warp layout ------------------------------------------------------------------------------
    threads, tpw, use_redux = c["threads"], c["tokens_per_warp"], c["reduce"] == "redux"
    warps = threads // 32
    block_tokens = warps * tpw
    ROWS = -(-E // 128)
    PER_LANE = ROWS * 4
    partial = E % 128 != 0  # the last row of 128 experts is only partly there
    VALID_LANES = (E % 128) // 4  # lanes holding a chunk of the partial row
    FULL = T.uint32(0xFFFFFFFF)
    NONE = T.uint32(0xFFFFFFFF)
    grp_loop = T.unroll if EPG <= 64 else T.serial

    def expert_of(s, lane):
        return (s // 4) * 128 + lane * 4 + s % 4

    @T.macro
    def reduce_pair(key, gi):
        # (key, gi) <- the warp's best pair: larger key, then smaller index. Every lane gets it.
        if use_redux:
            m = T.call_extern("uint32", "__reduce_max_sync", FULL, key[0])
            gi[0] = T.call_extern("uint32", "__reduce_min_sync", FULL, T.if_then_else(key[0] == m, gi[0], NONE))
            key[0] = m
        else:
            for step in T.unroll(5):
                ok = T.shfl_xor(key[0], 16 >> step)
                oi = T.shfl_xor(gi[0], 16 >> step)
                take = (ok > key[0]) | ((ok == key[0]) & (oi < gi[0]))
                key[0] = T.if_then_else(take, ok, key[0])
                gi[0] = T.if_then_else(take, oi, gi[0])

    @T.macro
    def run(logits, bias, mask, to_physical_map, logical_count, fix_routing_mask, unmapped_topk_idx, topk_idx,
            topk_weights, routed_scaling_factor, ep_rank, per_gpu, tp_rank, num_tp_ranks):
        with T.Kernel(T.ceildiv(num_tokens, block_tokens), threads=threads) as bx:
            tx = T.get_thread_binding()
            key_sh = T.alloc_shared((warps, E), f32)
            sc_sh = T.alloc_shared((warps, E), f32)
            xs = T.alloc_local((PER_LANE,), f32)
            bs = T.alloc_local((PER_LANE,), f32)
            keys = T.alloc_local((PER_LANE,), u32)
            top = T.alloc_local((2,), f32)
            red = T.alloc_local((1,), f32)
            mxv = T.alloc_local((1,), f32)
            act = T.alloc_local((1,), i32)
            bk = T.alloc_local((1,), u32)
            gi = T.alloc_local((1,), u32)
            mine = T.alloc_local((1,), u32)
            rank = T.alloc_local((1,), i32)
            wsc = T.alloc_local((1,), f32)
            tot = T.alloc_local((1,), f32)
            idx = T.alloc_local((1,), i64)
            if has_fix:
                fixed = T.alloc_local((1,), i32)
                chosen = T.alloc_local((1,), i64)  # lane r < K: the r-th logical index, selected or the caller's
            w = tx // 32
            lane = tx % 32
            for it in T.serial(tpw):
                tok = bx * block_tokens + it * warps + w
                tc = T.min(tok, num_tokens - 1)  # tail warps compute a valid row, store nothing
                T.sync_warp()  # the previous token's shared rows are read by now
                for i in T.unroll(ROWS):
                    if (not partial) or i < ROWS - 1:
                        for j in T.vectorized(4):
                            xs[i * 4 + j] = logits[tc, i * 128 + lane * 4 + j]
                        for j in T.vectorized(4):
                            bs[i * 4 + j] = bias[i * 128 + lane * 4 + j]
                    else:
                        # Lanes past the row's end read nothing; their slots are never selected.
                        if lane < VALID_LANES:
                            for j in T.vectorized(4):
                                xs[i * 4 + j] = logits[tc, i * 128 + lane * 4 + j]
                            for j in T.vectorized(4):
                                bs[i * 4 + j] = bias[i * 128 + lane * 4 + j]
                        else:
                            for j in T.unroll(4):
                                xs[i * 4 + j] = T.float32(0.0)
                                bs[i * 4 + j] = T.float32(0.0)
                if scoring == "softmax":
                    red[0] = -T.infinity(f32)
                    for s in T.unroll(PER_LANE):
                        if (not partial) or s < PER_LANE - 4:
                            red[0] = T.max(red[0], xs[s])
                        else:
                            red[0] = T.if_then_else(lane < VALID_LANES, T.max(red[0], xs[s]), red[0])
                    for step in T.unroll(5):
                        red[0] = T.max(red[0], T.shfl_xor(red[0], 16 >> step))
                    mxv[0] = red[0]
                    red[0] = T.float32(0.0)
                    for s in T.unroll(PER_LANE):
                        # TileKernels' order: the lane's slots in turn from 0.0, then the butterfly.
                        if (not partial) or s < PER_LANE - 4:
                            red[0] = red[0] + T.exp(xs[s] - mxv[0])
                        else:
                            red[0] = T.if_then_else(lane < VALID_LANES, red[0] + T.exp(xs[s] - mxv[0]), red[0])
                    for step in T.unroll(5):
                        red[0] = red[0] + T.shfl_xor(red[0], 16 >> step)
                for i in T.unroll(ROWS):
                    if (not partial) or i < ROWS - 1 or lane < VALID_LANES:
                        for j in T.unroll(4):
                            if scoring == "softmax":
                                sc_sh[w, i * 128 + lane * 4 + j] = T.exp(xs[i * 4 + j] - mxv[0]) / red[0]
                                key_sh[w, i * 128 + lane * 4 + j] = xs[i * 4 + j] + bs[i * 4 + j]
                            else:
                                sc_sh[w, i * 128 + lane * 4 + j] = score_of(xs[i * 4 + j])
                                key_sh[w, i * 128 + lane * 4 + j] = score_of(xs[i * 4 + j]) + bs[i * 4 + j]
                T.sync_warp()
                pick = True  # (a Python True: no branch in the variants without fix_routing_mask)
                if has_fix:
                    # Warp-uniform (one token per warp): a fixed token skips the selection, its lanes read
                    # the caller's indices below.
                    fixed[0] = T.if_then_else(fix_routing_mask[tc] != T.int8(0), 1, 0)
                    pick = fixed[0] == 0
                if pick:
                    if grouped:
                        gc = T.min(lane, G - 1)  # lanes past the groups compute a valid group, never count
                        top[0] = -T.infinity(f32)
                        top[1] = -T.infinity(f32)
                        for j in grp_loop(EPG):
                            # Start at a lane-dependent expert: fewer shared-memory bank conflicts; the top
                            # two (and so their sum) do not depend on the visiting order.
                            x = key_sh[w, gc * EPG + (j + gc) % EPG]
                            top[1] = T.if_then_else(x > top[0], top[0], T.if_then_else(x > top[1], x, top[1]))
                            top[0] = T.if_then_else(x > top[0], x, top[0])
                        gs = top[0] + top[1]
                        rank[0] = 0
                        for h in T.unroll(G):
                            other = T.shfl_sync(gs, h)
                            rank[0] = rank[0] + T.if_then_else((other > gs) | ((other == gs) & (h < lane)), 1, 0)
                        mine[0] = T.call_extern("uint32", "__ballot_sync", FULL,
                                                T.cast((lane < G) & (rank[0] < KG), i32))
                    for s in T.unroll(PER_LANE):
                        # Order-preserving key; adding +0 turns -0 into +0 so they tie as in torch.
                        b = T.reinterpret(T.ieee_add(key_sh[w, T.min(expert_of(s, lane), E - 1)], T.float32(0.0)), u32)
                        kv = b ^ (T.reinterpret(T.reinterpret(b, i32) >> 31, u32) | T.uint32(0x80000000))
                        if grouped:
                            # Key 0: never selected (past the row's end, or in a group that was not kept).
                            keys[s] = T.if_then_else(
                                (expert_of(s, lane) < E)
                                & (((mine[0] >> T.cast(T.min(expert_of(s, lane), E - 1) // EPG, u32)) & T.uint32(1))
                                   == T.uint32(1)), kv, T.uint32(0))
                        else:
                            keys[s] = T.if_then_else(expert_of(s, lane) < E, kv, T.uint32(0))
                    mine[0] = T.uint32(0)
                    for r in T.unroll(K):
                        bk[0] = keys[0]
                        gi[0] = T.uint32(expert_of(0, lane))
                        for s in T.unroll(1, PER_LANE):
                            better = keys[s] > bk[0]
                            bk[0] = T.if_then_else(better, keys[s], bk[0])
                            gi[0] = T.if_then_else(better, T.uint32(expert_of(s, lane)), gi[0])
                        reduce_pair(bk, gi)
                        mine[0] = T.if_then_else(lane == r, gi[0], mine[0])
                        if r + 1 < K:
                            for s in T.unroll(PER_LANE):
                                keys[s] = T.if_then_else(gi[0] == T.uint32(expert_of(s, lane)), T.uint32(0), keys[s])
                # Lane r < K holds the r-th winner; its score from shared memory (clamped: always in bounds).
                if has_fix:
                    if fixed[0] == 1:
                        chosen[0] = T.int64(0)
                        if (tok < num_tokens) & (lane < K):
                            chosen[0] = unmapped_topk_idx[tok, lane]
                    else:
                        chosen[0] = T.cast(T.min(T.cast(mine[0], i32), E - 1), i64)
                    wsc[0] = T.if_then_else(
                        lane < K, sc_sh[w, T.cast(T.min(T.max(chosen[0], T.int64(0)), T.int64(E - 1)), i32)],
                        T.float32(0.0))
                else:
                    wsc[0] = T.if_then_else(lane < K, sc_sh[w, T.min(T.cast(mine[0], i32), E - 1)], T.float32(0.0))
                tot[0] = T.float32(1e-20)
                for r in T.unroll(K):
                    tot[0] = tot[0] + T.shfl_sync(wsc[0], r)
                if has_fix:
                    idx[0] = T.if_then_else(lane < K, chosen[0], T.cast(E + lane - K, i64))
                else:
                    idx[0] = T.if_then_else(lane < K, T.cast(T.min(T.cast(mine[0], i32), E - 1), i64),
                                            T.cast(E + lane - K, i64))
                finish(idx, tok, ep_rank, per_gpu, tp_rank, num_tp_ranks, to_physical_map, logical_count)
                act[0] = 1
                if has_mask:  # a masked token: -1 / 0.0 (its routing is computed, never stored)
                    act[0] = T.if_then_else(mask[tc] != T.int8(0), 1, 0)
                if has_unmapped:  # the logical index (idx has been mapped by now); -1 for a masked token
                    if (tok < num_tokens) & (lane < K):
                        unmapped_topk_idx[tok, lane] = T.if_then_else(
                            act[0] == 1, chosen[0] if has_fix else T.cast(T.min(T.cast(mine[0], i32), E - 1), i64),
                            T.int64(-1))
                if (tok < num_tokens) & (lane < P):
                    topk_idx[tok, lane] = T.if_then_else(act[0] == 1, idx[0], T.int64(-1))
                    topk_weights[tok, lane] = T.if_then_else(
                        act[0] == 1,
                        T.if_then_else(lane < K, wsc[0] / tot[0] * routed_scaling_factor, T.float32(1.0)),
                        T.float32(0.0))

    return _prim_func(T, run, shape, num_tokens)


def _prim_func(T, run, shape, num_tokens):
    """The PrimFunc of this variant: logits, bias, [mask], [to_physical_map, logical_count], [fix_routing_mask],
    [unmapped_topk_idx], the outputs, then the scalars (the spec's inputs, outputs and scalars, in order). One
    definition with every param after the first two defaulting to None; the annotations of the tensors this
    variant does not take are deleted before T.prim_func reads them, so they are no params."""
    E, K, S = shape["num_experts"], shape["num_topk"], shape["num_shared_experts"]
    P, NL, D = K + S, E + S, shape["num_duplicates"]
    f32, i32, i64 = T.float32, T.int32, T.int64  # num_tokens: the builder's T.dynamic, which run() uses
    # unmapped_topk_idx may be a view (any row stride): its row stride is a runtime arg of the kernel.
    unmapped_rows = T.dynamic(stride_name("unmapped_topk_idx", 0)) if shape["has_unmapped"] else K

    def top2_sum_gate(
        logits: T.Tensor[(num_tokens, E), f32], bias: T.Tensor[(E,), f32],
        mask: T.Tensor[(num_tokens,), T.int8] = None,
        to_physical_map: T.Tensor[(NL, D), i32] = None, logical_count: T.Tensor[(NL,), i32] = None,
        fix_routing_mask: T.Tensor[(num_tokens,), T.int8] = None,
        unmapped_topk_idx: T.StridedTensor[(num_tokens, K), (unmapped_rows, 1), i64] = None,
        topk_idx: T.Tensor[(num_tokens, P), i64] = None, topk_weights: T.Tensor[(num_tokens, P), f32] = None,
        routed_scaling_factor: T.float32 = None, ep_rank: T.int32 = None, per_gpu: T.int32 = None,
        tp_rank: T.int32 = None, num_tp_ranks: T.int32 = None,
    ):
        run(logits, bias, mask, to_physical_map, logical_count, fix_routing_mask, unmapped_topk_idx, topk_idx,
            topk_weights, routed_scaling_factor, ep_rank, per_gpu, tp_rank, num_tp_ranks)

    flags = (("mask", ("mask",)), ("map", ("to_physical_map", "logical_count")), ("fix", ("fix_routing_mask",)),
             ("unmapped", ("unmapped_topk_idx",)))
    present = {"mask": shape["has_mask"], "map": shape["has_map"], "fix": shape["has_fix"],
               "unmapped": shape["has_unmapped"]}
    for flag, names in flags:
        if not present[flag]:
            for name in names:
                del top2_sum_gate.__annotations__[name]
    # Named by the tensors it takes, as the hand-written variants were (the name is the kernel's in the source).
    top2_sum_gate.__name__ = "top2_sum_gate" + "".join(f"_{flag}" for flag, _ in flags if present[flag])
    return T.prim_func(top2_sum_gate)


def scalars_for(shape: dict, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int) -> int:
    """per_gpu, the experts per GPU TileKernels divides by: (num_experts + num_extra_experts) // num_ep_ranks."""
    return (shape["num_experts"] + (shape["num_duplicates"] - 1 if shape["has_map"] else 0)) // num_ep_ranks


def make_inputs(shape, device="cpu", seed=0):
    """logits, bias (odd seeds: coarse values, so equal keys and equal group sums, and rows of one value),
    the mask (has_mask: 30% of the tokens not routed), the map tensors (has_map; odd seeds: some counts
    outside [1, num_duplicates]), fix_routing_mask (has_fix: 30% of the tokens fixed), unmapped_topk_idx
    (has_unmapped: a view of a wider buffer, each row num_topk distinct experts in random order; odd seeds:
    a few entries outside [0, num_experts), which a fixed row reads: unsupported, but in bounds), then the
    scalars routed_scaling_factor, ep_rank, per_gpu, tp_rank, num_tp_ranks (8 EP ranks, 2 TP ranks, rank 1;
    odd seeds 4 EP ranks, 1 TP rank)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, e = shape["num_tokens"], shape["num_experts"]
    x = torch.randn(n, e, generator=g, dtype=torch.float32) * 2
    b = torch.randn(e, generator=g, dtype=torch.float32) * 0.1
    if seed % 2 == 1:
        x = (x * 2).round() / 2
        if shape["scoring_func"] != "softmax":
            # No x and -x in one row: sigmoid(x) + sigmoid(-x) is 1 only up to rounding, so such pairs make
            # group sums that tie in exact arithmetic and differ by an ulp of exp, which is not the same
            # function in torch and in the kernel (equal inputs still tie exactly, as wanted).
            x = x.abs()
        b = (b * 16).round() / 16
        rows = torch.rand(n, generator=g) < 0.05
        x[rows] = x[rows][:, :1].expand(-1, e).clone()
        zero = x == 0
        x[zero] = torch.where(torch.rand(int(zero.sum()), generator=g) < 0.5, -0.0, 0.0)
    tensors = [x.to(device), b.to(device)]
    if shape["has_mask"]:
        tensors.append((torch.rand(n, generator=g) < 0.7).to(torch.int8).to(device))
    ep, tp_rank, tps = (min(8, e), 1, 2) if seed % 2 == 0 else (min(4, e), 0, 1)
    per_gpu = scalars_for(shape, ep, tp_rank, tps)
    if shape["has_map"]:
        nl, d = e + shape["num_shared_experts"], shape["num_duplicates"]
        phys = e + d - 1
        m = torch.randint(0, phys, (nl, d), generator=g, dtype=torch.int32)
        cnt = torch.randint(1, d + 1, (nl,), generator=g, dtype=torch.int32)
        if seed % 2 == 1:
            bad = torch.rand(nl, generator=g) < 0.1
            cnt[bad] = torch.where(torch.rand(int(bad.sum()), generator=g) < 0.5, 0, d + 1).to(torch.int32)
        tensors += [m.to(device), cnt.to(device)]
    if shape["has_fix"]:
        tensors.append((torch.rand(n, generator=g) < 0.3).to(torch.int8).to(device))
    if shape["has_unmapped"]:
        k = shape["num_topk"]
        picked = torch.rand(n, e, generator=g).argsort(dim=1)[:, :k]
        if seed % 2 == 1:
            odd = torch.rand(n, k, generator=g) < 0.03
            picked[odd] = torch.tensor([-1, e, -(2**40), 2**40])[torch.randint(0, 4, (int(odd.sum()),), generator=g)]
        wide = torch.full((n, k + 3), -7, dtype=torch.int64)  # rows of k + 3: the view's row stride is not k
        wide[:, 1:k + 1] = picked
        tensors.append(wide.to(device)[:, 1:k + 1])
    return (*tensors, 2.5 if seed % 2 == 0 else 1.0, seed % 3, per_gpu, tp_rank, tps)


def _lane_order_sum(ex: torch.Tensor) -> torch.Tensor:
    """Row sums of ex (num_tokens, num_experts) float32 in TileKernels' warp order: lane l adds experts
    i * 128 + 4 l + j (i, then j) from 0.0, then x += shfl_xor(x, 16, 8, 4, 2, 1)."""
    n, e = ex.shape
    rows = -(-e // 128)
    pad = torch.zeros(n, rows * 128, dtype=ex.dtype, device=ex.device)
    pad[:, :e] = ex
    v = pad.view(n, rows, 32, 4)
    acc = torch.zeros(n, 32, dtype=ex.dtype, device=ex.device)
    for i in range(rows):
        for j in range(4):
            acc = acc + v[:, i, :, j]  # a padded slot adds +0.0: no change (the lane skips it)
    lanes = torch.arange(32, device=ex.device)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[:, lanes ^ off]
    return acc[:, :1]


def scores_of(shape: dict, logits: torch.Tensor) -> torch.Tensor:
    """The scoring function, with the float ops the kernel uses (so also torch's CUDA ones)."""
    f = shape["scoring_func"]
    if f == "sigmoid":
        return torch.div(torch.ones_like(logits), 1.0 + torch.exp(-logits))
    if f == "sqrtsoftplus":
        return torch.where(logits > 20.0, logits, torch.log1p(torch.exp(logits))).sqrt()
    ex = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    return ex / _lane_order_sum(ex)


def reference(shape, logits, bias, *rest):
    """(unmapped_topk_idx after the call, when has_unmapped), topk_idx, topk_weights."""
    mask = to_physical_map = logical_count = fix = unmapped = None
    if shape["has_mask"]:
        mask, *rest = rest
    if shape["has_map"]:
        to_physical_map, logical_count, *rest = rest
    if shape["has_fix"]:
        fix, *rest = rest
    if shape["has_unmapped"]:
        unmapped, *rest = rest
    routed_scaling_factor, ep_rank, per_gpu, tp_rank, num_tp_ranks = rest
    n, e = logits.shape
    k, s = shape["num_topk"], shape["num_shared_experts"]
    scores = scores_of(shape, logits)
    keys = (logits + bias) if shape["scoring_func"] == "softmax" else (scores + bias)
    if _grouped(shape):
        ng = shape["num_groups"]
        grp = keys.view(n, ng, e // ng).topk(2, dim=-1, sorted=False).values.sum(-1)
        kept = torch.sort(grp, dim=-1, descending=True, stable=True).indices[:, : shape["num_topk_groups"]]
        drop = torch.ones(n, ng, dtype=torch.bool, device=logits.device).scatter_(1, kept, False)
        keys = keys.masked_fill(drop.repeat_interleave(e // ng, dim=1), float("-inf"))
    idx = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k]
    if fix is not None:  # fixed tokens: the given indices, their scores read at the index clamped into [0, e)
        idx = torch.where((fix != 0).unsqueeze(1), unmapped, idx)
    w = scores.gather(1, idx.clamp(0, e - 1))
    routed = torch.ones(n, 1, dtype=torch.bool, device=logits.device) if mask is None else (mask != 0).unsqueeze(1)
    logical = torch.where(routed, idx, -1) if unmapped is not None else None
    tot = torch.full((n, 1), 1e-20, dtype=torch.float32, device=logits.device)
    for j in range(k):
        tot = tot + w[:, j : j + 1]
    w = w / tot * torch.tensor(routed_scaling_factor, dtype=torch.float32, device=logits.device)
    if s:
        idx = torch.cat([idx, torch.arange(e, e + s, device=logits.device).expand(n, s)], dim=1)
        w = torch.cat([w, torch.ones(n, s, dtype=torch.float32, device=logits.device)], dim=1)
    if shape["has_map"]:
        inside = (idx >= 0) & (idx < logical_count.numel())  # (only a fixed index may be outside)
        safe = torch.where(inside, idx, 0)
        cnt = logical_count.long()[safe]
        ok = inside & (cnt >= 1) & (cnt <= shape["num_duplicates"])
        tok = torch.arange(n, device=logits.device).unsqueeze(1)
        dup = (ep_rank + tok * PRIME) % cnt.clamp(min=1)
        idx = torch.where(ok, to_physical_map.long()[safe, torch.where(ok, dup, 0)], -1)
    gpu = idx.div(per_gpu, rounding_mode="floor")
    keep = (idx >= 0) & (gpu.remainder(num_tp_ranks) == tp_rank)
    idx = torch.where(keep, gpu.div(num_tp_ranks, rounding_mode="floor") * per_gpu + idx.remainder(per_gpu), -1)
    if mask is not None:  # tokens not routed: -1 / 0.0 (the others keep their global token index above)
        idx = torch.where(routed, idx, -1)
        w = torch.where(routed, w, torch.zeros((), dtype=torch.float32, device=w.device))
    return (logical, idx, w) if logical is not None else (idx, w)


def _bytes(s):
    p = s["num_topk"] + s["num_shared_experts"]
    return s["num_tokens"] * (s["num_experts"] * 4 + p * 12) + s["num_experts"] * 4


SPEC = register(
    KernelSpec(
        name="top2_sum_gate",
        family="moe",
        doc="grouped (top-2-sum) MoE routing: scores, bias, top groups, top-k experts, weights, EP/TP remap",
        params=(
            Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
            Static("num_experts", lo=4, hi=MAX_EXPERTS, default=256, doc="routed experts (a multiple of 4)"),
            Static("num_topk", lo=1, hi=32, default=8, doc="routed experts selected per token"),
            Static("num_groups", lo=0, hi=32, default=8, doc="expert groups (0: none)"),
            Static("num_topk_groups", lo=0, hi=32, default=4, doc="groups kept per token (0: none)"),
            Static("num_shared_experts", lo=0, hi=2, default=0, doc="shared experts appended (weight 1)"),
            Static("scoring_func", str, values=SCORING, default="sigmoid", doc="scoring function"),
            Static("has_mask", bool, default=False, doc="mask given (False: the token is not routed)"),
            Static("has_map", bool, default=False, doc="to_physical_map / logical_count given"),
            Static("num_duplicates", lo=1, hi=64, default=1, doc="to_physical_map columns (num_extra_experts + 1)"),
            Static("has_fix", bool, default=False,
                   doc="fix_routing_mask given (True: the token keeps its unmapped_topk_idx row); needs has_unmapped"),
            Static("has_unmapped", bool, default=False,
                   doc="unmapped_topk_idx given (updated in place: the logical indices, -1 for masked tokens)"),
        ),
        space={
            "layout": ("warp", "thread"),
            "threads": (32, 64, 128, 256),
            "tokens_per_warp": (1, 2, 4),
            "reduce": ("shfl", "redux"),
        },
        default=default,
        constraint=constraint,
        arch_constraint=arch_constraint,
        check_shape=check_shape,
        pass_configs=pass_configs,
        build=build,
        inputs=(
            TensorArg("logits", "float32", ("num_tokens", "num_experts")),
            TensorArg("bias", "float32", ("num_experts",)),
            # A bool mask as int8 (the op passes mask.view(torch.int8)): the C target has no bool buffers.
            TensorArg("mask", "int8", ("num_tokens",), align=1, optional="has_mask"),
            TensorArg("to_physical_map", "int32", (lambda s: s["num_experts"] + s["num_shared_experts"],
                                                   "num_duplicates"), align=4, optional="has_map"),
            TensorArg("logical_count", "int32", (lambda s: s["num_experts"] + s["num_shared_experts"],),
                      align=4, optional="has_map"),
            # TileKernels' bool fix_routing_mask, as int8 like the mask.
            TensorArg("fix_routing_mask", "int8", ("num_tokens",), align=1, optional="has_fix"),
            # Read (fixed tokens) and written (every token) in place; any row stride (a view of a wider buffer).
            TensorArg("unmapped_topk_idx", "int64", ("num_tokens", "num_topk"), strided=True, align=8, inout=True,
                      optional="has_unmapped"),
        ),
        outputs=(
            TensorArg("topk_idx", "int64", ("num_tokens", lambda s: s["num_topk"] + s["num_shared_experts"])),
            TensorArg("topk_weights", "float32", ("num_tokens", lambda s: s["num_topk"] + s["num_shared_experts"])),
        ),
        scalars=(
            ScalarArg("routed_scaling_factor", float),
            ScalarArg("ep_rank", int),
            ScalarArg("per_gpu", int),
            ScalarArg("tp_rank", int),
            ScalarArg("num_tp_ranks", int),
        ),
        make_inputs=make_inputs,
        reference=reference,
        # Indices exact (integers always are); weights within a few ulps of this torch reference, whose CUDA
        # exp / softmax sum differ from the kernel's in the last bits on the GPU. The bit-exact oracle on the
        # GPU is TileKernels' own kernel (tests/gpu/test_gpu_top2_sum_gate.py::test_against_tile_kernels).
        tolerance=Tolerance(rtol=1e-6, max_abs=1e-5),
        bytes_moved=_bytes,
        examples=(
            {"num_tokens": 8192, "num_experts": 256, "num_topk": 8, "num_groups": 8, "num_topk_groups": 4},
            {"num_tokens": 65536, "num_experts": 256, "num_topk": 8, "num_groups": 8, "num_topk_groups": 4},
            {"num_tokens": 4096, "num_experts": 72, "num_topk": 6, "num_groups": 0, "num_topk_groups": 0,
             "scoring_func": "softmax"},
            {"num_tokens": 8192, "num_experts": 256, "num_topk": 8, "num_groups": 8, "num_topk_groups": 4,
             "num_shared_experts": 1, "has_map": True, "num_duplicates": 9},
            {"num_tokens": 8192, "num_experts": 256, "num_topk": 8, "num_groups": 8, "num_topk_groups": 4,
             "has_mask": True, "has_unmapped": True},
            {"num_tokens": 8192, "num_experts": 256, "num_topk": 8, "num_groups": 8, "num_topk_groups": 4,
             "num_shared_experts": 1, "has_map": True, "num_duplicates": 9, "has_mask": True, "has_fix": True,
             "has_unmapped": True},
        ),
    )
)
