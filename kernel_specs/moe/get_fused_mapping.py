"""get_fused_mapping: the expert-major ("fused") layout of MoE routing, and the maps both ways.

topk_idx (num_tokens, num_topk) int64, -1 = no expert. Entry i = token * num_topk + slot (the flat
index) routed to expert e gets a position in a buffer of num_expanded_tokens rows: expert e owns the
segment [expert_start[e], expert_end[e]) of length align(count[e], alignment), segments in expert
order from 0; inside a segment the entries come in increasing flat index (stable), then padding.
Outputs (int32): pos_to_expert / pos_to_token (= i // num_topk) / pos_to_token_topk (= i), -1 at
padding positions and past the last segment; token_topk_to_pos (num_tokens, num_topk): the entry's
position or -1; expert_start, expert_end, num_tokens_per_expert (the ALIGNED count). TileKernels'
`moe.get_fused_mapping` semantics: the same layout and the same entries in each segment, but in flat
order whatever the config, where TileKernels' order inside a segment follows its warps' chunks of the
flat entries (reversed inside each chunk) and so depends on its SM count.

Out-of-range entries (outside [-1, num_experts)) are treated as -1: never a wild write. When
num_expanded_tokens is smaller than the layout (expert_end[-1]), the entries and padding whose
position falls at or past it are dropped (their token_topk_to_pos is -1); expert_start / expert_end /
num_tokens_per_expert still describe the whole layout. (TileKernels assumes the layout fits and
writes out of bounds otherwise.)

Design: ONE persistent kernel with a grid barrier, like TileKernels (TileLang lowers `T.sync_grid()`
to `cooperative_groups::this_grid().sync()` and tags the kernel `tirx.use_cooperative_launch`, so
TVM's CUDA module, which tkjit's tvm_ffi loader runs, launches it with cuLaunchCooperativeKernel).
The grid is min(blocks, ceil(num_tokens * num_topk / threads)) blocks of `threads` threads; all of
them must be co-resident (a cooperative launch that does not fit fails with a CUDA error, it never
hangs). The flat entries are cut into one contiguous range per warp (a multiple of 32 long),
global warp order = flat order:
  1. each warp counts its range per expert into its own shared row (count="match": the lowest lane of
     each equal-expert group adds the group's size, no atomics; "atomic": a shared atomic add per
     entry, as TileKernels counts), the block turns its rows into
     per-warp exclusive prefixes and writes its per-expert total to the `block_counts` workspace;
  2. grid barrier;
  3. per expert, the total over the blocks and the part of it in the blocks before this one (`reduce`:
     "loop": the thread of expert e reads the nb block rows in a loop; "unroll": the same loads all issued
     at once (a loop unrolled over the config's `blocks`, rows past the grid read but not added: a rolled
     loop waits an L2 round trip every few rows); "columns": the grid's warps scan one expert column each
     over the blocks into the workspace's second half (inclusive prefixes), then a second grid barrier,
     and each block reads two rows: every block re-reading every row is nb * nb * E loads of L2 traffic),
     then it aligns, and a block-wide scan (warp shuffles) gives expert_start; block 0 writes the
     per-expert outputs;
  4. each warp walks its range again: position = its base for the expert + the lane's rank among
     equal-expert lanes below it (match_any + popcount); the group's lowest lane advances the base;
  5. padding positions ([start + count, end) of each expert, block b taking experts b, b + grid, ...)
     and the tail [expert_end[-1], num_expanded_tokens) get -1. Every position is written once, by
     exactly one thread, so nothing is filled first (`pad`="after"). `pad`="before" (TileKernels' way)
     instead fills every position with -1 while step 1 counts (its stores overlap the loads' wait) and
     lets the scatter overwrite the entries' positions: the grid barrier orders the fill before every
     scatter store, and the kernel ends after the scatter, with no step 5.
`block_counts` (WS_ROWS, num_experts) int32 is an in-place workspace input (its content on entry is
ignored; rows below the grid size, and for "columns" rows MAX_BLOCKS + b, are overwritten): the op passes
torch.empty. ("columns" writes its prefixes to rows no block has read in this launch, so no SM can hold
a stale copy of them in its L1 after the barrier.)
Tunables: threads (>= num_experts: one thread per expert in steps 3-5), blocks (the grid cap), count
(how step 1 counts), reduce (how step 3 sums the blocks' counts), pad (when padding gets its -1).
CUDA only (warp match/shuffle and the grid barrier).
"""


import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance

MAX_EXPERTS = 1024
MAX_BLOCKS = 132  # the largest grid in the space (one block per H100/H200 SM)
WS_ROWS = 2 * MAX_BLOCKS  # the workspace: per block counts, then (reduce="columns") their inclusive prefixes
SMEM_LIMIT = 160 * 1024  # per-warp count rows; under the 227 KB an sm_90 block may take
MAX_TOPK = 64
MAX_ALIGNMENT = 1 << 16


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def upper_bound(num_tokens: int, num_topk: int, num_experts: int, alignment: int) -> int:
    """TileKernels' buffer size when the caller gives num_expanded_tokens=0: the largest layout possible."""
    return (num_tokens * num_topk + (alignment - 1) * num_experts) // alignment * alignment


def default(shape):
    e = shape["num_experts"]
    # 512 threads and the unrolled reduction: the fastest of the 36 configs swept at 8192 tokens (256 experts,
    # alignment 128) on an H100, 10.8 us against 12.4 for 256 threads and the rolled loop (the default before);
    # the studies at 4096-65536 tokens tuned to 512-1024 threads, three of four to "unroll".
    threads = max(512, _pow2_ceil(e))
    # One block per SM of an H100/H200 (132); 1024-thread blocks holding 128 KB of counts get half
    # that, so the cooperative launch also fits GPUs with fewer SMs (H100 PCIe: 114).
    blocks = 132 if threads <= 512 else 66
    return {"threads": threads, "blocks": blocks, "count": "match", "reduce": "unroll", "pad": "after"}


def constraint(shape, c):
    e, threads = shape["num_experts"], c["threads"]
    if threads < e:
        return f"threads={threads} < num_experts={e}: steps 3-5 run one thread per expert"
    smem = (threads // 32) * e * 4
    if smem > SMEM_LIMIT:
        return f"{smem} bytes of per-warp counts exceed {SMEM_LIMIT}"
    if c["blocks"] > MAX_BLOCKS:
        return f"blocks={c['blocks']} > {MAX_BLOCKS}, the largest grid the workspace has rows for"
    return None


SMEM_PER_SM = 228 * 1024  # an sm_90 SM's shared memory


def device_constraint(shape, c, device):
    """The grid (at most `blocks`) must be resident at once on the GPU at hand: per SM, as many blocks as
    1024 threads (64 registers a thread) and the shared memory hold, at least one. reduce="unroll" keeps its
    `blocks` loads in flight in registers (ptxas: 75-154 a thread at 256 and 512 threads, where "loop" and
    "columns" take 40-56): one block an SM is all that is sure to be resident, so on a GPU with fewer SMs than
    blocks it is refused here rather than failing at launch."""
    smem = (c["threads"] // 32) * shape["num_experts"] * 4
    by_regs = 1 if c["reduce"] == "unroll" else 1024 // c["threads"]
    per_sm = max(1, min(by_regs, SMEM_PER_SM // smem))
    if c["blocks"] > device["sms"] * per_sm:
        return (f"blocks={c['blocks']} > {device['sms']} SMs x {per_sm} resident blocks of {c['threads']} threads: "
                "a cooperative grid must be co-resident")
    return None


def arch_constraint(arch, c, shape):
    if arch == "cpu":
        return "needs warp match/shuffle and a grid barrier (cooperative launch): CUDA targets only"
    if int(arch[3:].rstrip("af")) < 70:
        return "__match_any_sync needs sm_70 or newer"
    return None


def pass_configs(c):
    # Barriers are placed by hand: the automatic ones would land inside the warps' loops, whose trip
    # counts differ between warps.
    return {"tl.disable_warp_specialized": True, "tl.disable_thread_storage_sync": True}


def build(shape, c):
    from tilelang import language as T

    E, K, A = shape["num_experts"], shape["num_topk"], shape["alignment"]
    threads, blocks, count, reduce, pad = c["threads"], c["blocks"], c["count"], c["reduce"], c["pad"]
    NC = -(-blocks // 32)  # "columns": chunks of 32 blocks a lane scans
    W = threads // 32
    num_tokens = T.dynamic("num_tokens")
    nexp = T.dynamic("num_expanded_tokens")
    # (No `from __future__ import annotations` in this file: TileLang evaluates these annotations.)
    i32, i64, u32 = T.int32, T.int64, T.uint32

    def aligned(n):
        return n if A == 1 else T.ceildiv(n, A) * A

    @T.macro
    def load_expert(topk_idx, i, end, ex, v):
        # The entry's expert, or -1 (past the range, -1, or out of [0, E): never used as an index).
        # The int64 is range-checked before the cast, so 2**32 + 5 is not expert 5.
        ex[0] = -1
        if i < end:
            v[0] = topk_idx[i // K, i % K]
            if (v[0] >= T.int64(0)) & (v[0] < T.int64(E)):
                ex[0] = T.cast(v[0], i32)

    @T.macro
    def unused(pos_to_expert, pos_to_token, pos_to_token_topk, p):  # position p holds no entry
        pos_to_expert[p] = -1
        pos_to_token[p] = -1
        pos_to_token_topk[p] = -1

    @T.prim_func
    def get_fused_mapping(
        topk_idx: T.Tensor[(num_tokens, K), i64],
        block_counts: T.Tensor[(WS_ROWS, E), i32],
        pos_to_expert: T.Tensor[(nexp,), i32],
        pos_to_token: T.Tensor[(nexp,), i32],
        pos_to_token_topk: T.Tensor[(nexp,), i32],
        token_topk_to_pos: T.Tensor[(num_tokens, K), i32],
        expert_start: T.Tensor[(E,), i32],
        expert_end: T.Tensor[(E,), i32],
        num_tokens_per_expert: T.Tensor[(E,), i32],
    ):
        with T.Kernel(T.min(blocks, T.ceildiv(num_tokens * K, threads)), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            nb = T.min(blocks, T.ceildiv(num_tokens * K, threads))  # the grid size
            cnt = T.alloc_shared((W, E), i32)  # per warp and expert: count, then base position
            base_s = T.alloc_shared((E,), i32)  # expert_start
            tot_s = T.alloc_shared((E,), i32)  # unaligned count
            warp_s = T.alloc_shared((32,), i32)  # the scan's warp sums
            ex = T.alloc_local((1,), i32)
            v = T.alloc_local((1,), i64)
            tot = T.alloc_local((1,), i32)
            before = T.alloc_local((1,), i32)
            mine = T.alloc_local((1,), i32)  # this block's count of expert tx
            carry = T.alloc_local((1,), i32)
            vals = T.alloc_local((NC,), i32)
            run = T.alloc_local((1,), i32)
            x = T.alloc_local((1,), i32)
            y = T.alloc_local((1,), i32)

            rng = T.alloc_local((3,), i32)  # (start, end, iterations): in registers, computed once

            # Warp g of the grid owns flat entries [g * per_warp, (g + 1) * per_warp) (cut at num_tokens * K).
            # (num_tokens * K written out, not named: with K = 1 it is num_tokens itself, and a name given to it
            # would rename that size in the launcher's C signature.)
            rng[0] = T.ceildiv(T.ceildiv(num_tokens * K, nb * W), 32) * 32
            rng[1] = T.min(rng[0] * (bx * W + w + 1), num_tokens * K)
            rng[0] = rng[0] * (bx * W + w)
            rng[2] = T.ceildiv(T.max(rng[1] - rng[0], 0), 32)
            start, end, iters = rng[0], rng[1], rng[2]
            below = (T.shift_left(T.uint32(1), T.cast(lane, u32))) - T.uint32(1)  # lanes under this one

            for j in T.serial(lane, E, 32):
                cnt[w, j] = 0
            T.sync_warp()
            if pad == "before":  # every position -1 now; the scatter, after the grid barrier, overwrites the entries'
                for j in T.serial(T.ceildiv(T.max(nexp - bx * threads - tx, 0), nb * threads)):
                    unused(pos_to_expert, pos_to_token, pos_to_token_topk, bx * threads + tx + j * (nb * threads))
            # 1. Count. "match": the lowest lane of each equal-expert group adds the group's size (rows are
            # per warp and groups are distinct experts, so plain adds do not race). "atomic": each lane adds 1
            # with a shared-memory atomic (no warp vote; lanes of one expert serialise on its word).
            if count == "match":
                for it in T.serial(iters):
                    load_expert(topk_idx, start + it * 32 + lane, end, ex, v)
                    mask = T.match_any_sync(ex[0])
                    if (ex[0] >= 0) & ((mask & below) == T.uint32(0)):
                        cnt[w, ex[0]] = cnt[w, ex[0]] + T.cast(T.popcount(mask), i32)
                    T.sync_warp()
            else:
                for it in T.serial(iters):
                    load_expert(topk_idx, start + it * 32 + lane, end, ex, v)
                    if ex[0] >= 0:
                        T.atomic_add(cnt[w, ex[0]], 1)
            T.sync_threads()
            if tx < E:
                run[0] = 0
                for ww in T.serial(W):
                    x[0] = cnt[ww, tx]
                    cnt[ww, tx] = run[0]  # exclusive prefix over the block's warps
                    run[0] = run[0] + x[0]
                block_counts[bx, tx] = run[0]
                mine[0] = run[0]
            T.sync_grid()

            # 3. Totals, this block's offset, and the aligned layout.
            tot[0] = 0
            before[0] = 0
            if reduce == "loop":
                if tx < E:
                    for b in T.serial(nb):
                        x[0] = block_counts[b, tx]
                        tot[0] = tot[0] + x[0]
                        before[0] = before[0] + T.if_then_else(b < bx, x[0], 0)
            elif reduce == "unroll":
                if tx < E:
                    for b in T.unroll(blocks):  # rows at or past nb hold garbage: read (in bounds), not added
                        x[0] = block_counts[b, tx]
                        tot[0] = tot[0] + T.if_then_else(b < nb, x[0], 0)
                        before[0] = before[0] + T.if_then_else(b < bx, x[0], 0)
            else:  # "columns": global warp g scans experts g, g + nb * W, ... over the blocks
                for j in T.serial(T.ceildiv(T.max(E - (bx * W + w), 0), nb * W)):
                    e = bx * W + w + j * (nb * W)
                    for ch in T.unroll(NC):  # every load first, then the scans
                        vals[ch] = T.if_then_else(ch * 32 + lane < nb,
                                                  block_counts[T.min(ch * 32 + lane, MAX_BLOCKS - 1), e], 0)
                    carry[0] = 0
                    for ch in T.unroll(NC):
                        run[0] = vals[ch]
                        for s in T.unroll(5):
                            x[0] = T.shfl_up(run[0], 1 << s)
                            if lane >= (1 << s):
                                run[0] = run[0] + x[0]
                        if ch * 32 + lane < nb:
                            block_counts[MAX_BLOCKS + ch * 32 + lane, e] = run[0] + carry[0]
                        carry[0] = carry[0] + T.shfl_sync(run[0], 31)
                T.sync_grid()
                if tx < E:
                    tot[0] = block_counts[MAX_BLOCKS + nb - 1, tx]
                    before[0] = block_counts[MAX_BLOCKS + bx, tx] - mine[0]
            seg = aligned(tot[0])
            run[0] = seg
            for s in T.unroll(5):  # inclusive scan inside the warp
                x[0] = T.shfl_up(run[0], 1 << s)
                if lane >= (1 << s):
                    run[0] = run[0] + x[0]
            if lane == 31:
                warp_s[w] = run[0]
            T.sync_threads()
            if w == 0:
                x[0] = T.if_then_else(lane < W, warp_s[T.min(lane, W - 1)], 0)
                for s in T.unroll(5):
                    y[0] = T.shfl_up(x[0], 1 << s)
                    if lane >= (1 << s):
                        x[0] = x[0] + y[0]
                if lane < W:
                    warp_s[lane] = x[0]  # inclusive over warps
            T.sync_threads()
            first = run[0] - seg + T.if_then_else(w > 0, warp_s[T.max(w - 1, 0)], 0)  # exclusive
            layout_end = warp_s[W - 1]
            if tx < E:
                base_s[tx] = first
                tot_s[tx] = tot[0]
                for ww in T.serial(W):
                    cnt[ww, tx] = cnt[ww, tx] + first + before[0]  # warp ww's first position
                if bx == 0:
                    expert_start[tx] = first
                    expert_end[tx] = first + seg
                    num_tokens_per_expert[tx] = seg
            T.sync_threads()

            # 4. Scatter.
            for it in T.serial(iters):
                i = start + it * 32 + lane
                load_expert(topk_idx, i, end, ex, v)
                mask = T.match_any_sync(ex[0])
                if i < end:
                    if ex[0] >= 0:
                        p = cnt[w, ex[0]] + T.cast(T.popcount(mask & below), i32)
                        if p < nexp:
                            pos_to_expert[p] = ex[0]
                            pos_to_token[p] = i // K
                            pos_to_token_topk[p] = i
                            token_topk_to_pos[i // K, i % K] = p
                        else:
                            token_topk_to_pos[i // K, i % K] = -1  # dropped: past the buffer
                    else:
                        token_topk_to_pos[i // K, i % K] = -1
                T.sync_warp()
                if (ex[0] >= 0) & ((mask & below) == T.uint32(0)):
                    cnt[w, ex[0]] = cnt[w, ex[0]] + T.cast(T.popcount(mask), i32)
                T.sync_warp()

            # 5. Padding of each expert (block b: experts b, b + nb, ...), then the tail.
            if A > 1 and pad == "after":
                for j in T.serial(T.ceildiv(T.max(E - bx, 0), nb)):
                    e = bx + j * nb
                    lo = base_s[e] + tot_s[e]
                    hi = T.min(base_s[e] + aligned(tot_s[e]), nexp)
                    for p in T.serial(lo + tx, hi, threads):
                        unused(pos_to_expert, pos_to_token, pos_to_token_topk, p)
            if pad == "after":
                for j in T.serial(T.ceildiv(T.max(nexp - layout_end - bx * threads - tx, 0), nb * threads)):
                    p = layout_end + bx * threads + tx + j * (nb * threads)
                    unused(pos_to_expert, pos_to_token, pos_to_token_topk, p)

    return get_fused_mapping


def make_inputs(shape, device="cpu", seed=0):
    """Routing as a gate makes it (distinct experts per token where k <= E), skewed towards a few hot
    experts, with -1 entries, whole -1 rows, and on odd seeds duplicates in a row and out-of-range values
    (-7, E, 2**40: treated as -1). The workspace holds garbage."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, k, e = shape["num_tokens"], shape["num_topk"], shape["num_experts"]
    if k <= e:
        # Distinct experts per token; a skewed preference (hot experts) so counts differ a lot.
        pref = torch.rand(n, e, generator=g) + torch.linspace(0, 2, e).roll(int(seed) % e) ** 2
        idx = pref.topk(k, dim=-1).indices
    else:
        idx = torch.randint(0, e, (n, k), generator=g)
    idx = idx[:, torch.randperm(k, generator=g)] if k > 1 else idx
    idx = torch.where(torch.rand(n, k, generator=g) < 0.1, -1, idx)
    if n > 2:
        idx[torch.randint(0, n, (max(1, n // 50),), generator=g)] = -1  # whole rows routed nowhere
    if seed % 2 == 1:
        flat = idx.view(-1)
        m = flat.numel()
        bad = torch.tensor([-7, e, 1 << 40, -(1 << 33)], dtype=torch.int64)
        flat[torch.randint(0, m, (max(1, m // 64),), generator=g)] = bad[torch.randint(0, 4, (max(1, m // 64),),
                                                                                         generator=g)]
        if k > 1:
            idx[: n // 4, 1] = idx[: n // 4, 0]  # the same expert twice in a token
    ws = torch.randint(-(1 << 30), 1 << 30, (WS_ROWS, e), generator=g, dtype=torch.int32)
    return idx.contiguous().to(device), ws.to(device)


def reference(shape, topk_idx, block_counts=None):
    """Plain torch: a stable sort of the flat entries by expert, then each expert's segment."""
    e_count, k, a, nexp = shape["num_experts"], shape["num_topk"], shape["alignment"], shape["num_expanded_tokens"]
    flat = topk_idx.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < e_count)
    key = torch.where(valid, flat, e_count)  # invalid entries sort last
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key[valid], minlength=e_count)
    seg = (counts + a - 1) // a * a
    start = torch.cumsum(seg, 0) - seg
    nvalid = int(valid.sum())
    idx = order[:nvalid]  # flat indices, by expert then flat index
    ex = key[idx]
    first = torch.cumsum(counts, 0) - counts  # each expert's first place in `order`
    dev = topk_idx.device
    pos = start[ex] + torch.arange(nvalid, device=dev) - first[ex]
    keep = pos < nexp
    idx, ex, pos = idx[keep], ex[keep], pos[keep]
    pos_to_expert = torch.full((nexp,), -1, dtype=torch.int64, device=dev)
    pos_to_token = pos_to_expert.clone()
    pos_to_token_topk = pos_to_expert.clone()
    pos_to_expert[pos] = ex
    pos_to_token[pos] = idx // k
    pos_to_token_topk[pos] = idx
    ttp = torch.full((flat.numel(),), -1, dtype=torch.int64, device=dev)
    ttp[idx] = pos
    i32 = torch.int32
    return (
        pos_to_expert.to(i32), pos_to_token.to(i32), pos_to_token_topk.to(i32),
        ttp.view(topk_idx.shape).to(i32), start.to(i32), (start + seg).to(i32), seg.to(i32),
    )


def _bytes(s):
    numel, e, nexp = s["num_tokens"] * s["num_topk"], s["num_experts"], s["num_expanded_tokens"]
    # topk_idx read twice (count, scatter), token_topk_to_pos and the three pos maps written once.
    return numel * (2 * 8 + 4) + nexp * 12 + e * 12


def _example(tokens, k, e, a):
    return {"num_tokens": tokens, "num_topk": k, "num_experts": e, "alignment": a,
            "num_expanded_tokens": upper_bound(tokens, k, e, a)}


SPEC = register(
    KernelSpec(
        name="get_fused_mapping",
        family="moe",
        doc="expert-major layout of MoE routing (aligned per-expert segments) and the maps both ways",
        params=(
            Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
            Runtime("num_expanded_tokens", hi=(1 << 31) - 1,
                    doc="rows of the expert-major buffer (caller-sized: positions at or past it are dropped)"),
            Static("num_topk", lo=1, hi=MAX_TOPK, default=8, doc="experts per token (topk_idx columns)"),
            Static("num_experts", lo=1, hi=MAX_EXPERTS, default=256, doc="experts"),
            Static("alignment", lo=1, hi=MAX_ALIGNMENT, default=128, doc="each expert's segment length multiple"),
        ),
        space={"threads": (128, 256, 512, 1024), "blocks": (8, 16, 33, 66, 132), "count": ("match", "atomic"),
               "reduce": ("loop", "unroll", "columns"), "pad": ("after", "before")},
        default=default,
        added={"count": "match", "reduce": "loop", "pad": "after"},  # configs tuned before these were tunables
        constraint=constraint,
        arch_constraint=arch_constraint,
        device_constraint=device_constraint,
        build=build,
        pass_configs=pass_configs,
        inputs=(
            TensorArg("topk_idx", "int64", ("num_tokens", "num_topk")),
            TensorArg("block_counts", "int32", (WS_ROWS, "num_experts"), inout=True),
        ),
        outputs=(
            TensorArg("pos_to_expert", "int32", ("num_expanded_tokens",)),
            TensorArg("pos_to_token", "int32", ("num_expanded_tokens",)),
            TensorArg("pos_to_token_topk", "int32", ("num_expanded_tokens",)),
            TensorArg("token_topk_to_pos", "int32", ("num_tokens", "num_topk")),
            TensorArg("expert_start", "int32", ("num_experts",)),
            TensorArg("expert_end", "int32", ("num_experts",)),
            TensorArg("num_tokens_per_expert", "int32", ("num_experts",)),
        ),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        bytes_moved=_bytes,
        examples=(
            _example(8192, 8, 256, 128),
            _example(8192, 8, 256, 64),
            _example(4096, 8, 256, 1),
            _example(16384, 6, 64, 128),
        ),
    )
)
