"""group_count and aux_fi: per-id counts of an int64 (num_tokens, num_topk) index tensor.

group_count: group_idx (num_tokens, num_topk) int64 -> counts (num_groups,) int32, the number of
entries equal to each id (TileKernels' `group_count`).
aux_fi: topk_idx (num_tokens, num_topk) int64 and the run-time scalar num_aux_topk ->
fi (num_experts,) float32, fi[e] = count[e] * num_experts / (num_tokens * num_aux_topk), the
auxiliary-loss frequency indicator (TileKernels' `aux_fi`), plus its int32 counts as a second output.

Out-of-range entries: an entry < 0 is padding and is skipped (TileKernels' contract); an entry
>= num_groups (which TileKernels asserts against) is skipped too, so no index value makes the
kernel touch memory outside its buffers.

aux_fi is bit-exact with TileKernels' torch reference evaluated on the CPU and with TileKernels'
kernel: the counts are summed as integers over the whole grid first, then each expert's value is
computed once, float(count) * float(num_experts) rounded to float32, divided (IEEE, no fast math)
by float(num_tokens * num_aux_topk) (the product in int64, rounded once to float32, as torch
converts the Python int). Exact while a count stays below 2**24 (float(count) exact; 16M
entries on one expert). torch's CUDA reference multiplies by the reciprocal of the divisor
instead, which can differ from the division by one ulp. num_aux_topk = 0 gives inf / nan, as
the torch reference does. 0 tokens: zeros (nothing is launched; both outputs are zeroed).

Layouts (`layout`):
  grid  `blocks` persistent blocks of `threads` threads stride over the flattened entries,
        `vec` consecutive int64 per thread per step (vec=2: 16-byte loads; a warp reads a
        contiguous span; vec=8: four 16-byte loads in flight, TileKernels' one row of 8 per
        thread), counting into shared-memory int32 counters; then one global atomic per non-zero
        counter per block. blocks=1 stores its counters directly (no atomics).
        blocks > 1 is a cooperative launch (`T.sync_grid()`): the grid zeroes the output its
        atomics add into (each block a slice, while the counting runs), and a grid barrier after
        the counting orders the zeroing before any atomic. No output needs a fill before the
        launch, so a call is ONE launch (TileKernels' is two: torch.zeros, then the kernel). All
        blocks must be co-resident: blocks * threads <= 132 * 1024 (an H200's SMs at 1024
        threads, 64 registers a thread; a launch that does not fit is a CUDA error, never a hang). On a
        GPU with fewer SMs the bound is its own (`device_constraint`): a config that does not fit is not
        served there.
        aux_fi with blocks > 1: the blocks add their counts into the int32 `counts` output; each
        block then takes a ticket (counts[num_experts], an acq_rel atomic after a fence), and the
        block that takes the last one computes every fi from the grid's totals and sets the ticket
        back to 0, so the outputs do not depend on the config.
  loop  one thread walks every entry: TileLang's C target (CPU) lowers this one only.
Both ops are launch-bound at TileKernels' sizes (65536 entries: 512 KB), so the tunables are the
grid size (1 block avoids the cross-block step; more blocks read faster) and the block width.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, ScalarArg, Static, TensorArg, Tolerance, plain_threads

MAX_IDS = 8192  # shared-memory counters: 32 KB of int32 at most
MAX_TOPK = 64

SPACE = {
    "layout": ("grid", "loop"),
    "blocks": (1, 4, 16, 33, 66, 132, 264),
    "threads": (128, 256, 512, 1024),
    "vec": (1, 2, 8),
}
H200_SMS = 132
COOP_THREADS_PER_SM = 1024  # resident threads of an SM at 64 registers a thread (ptxas: the kernels use 20-37)


def _params(ids: str, ids_doc: str) -> tuple:
    return (
        Runtime("num_tokens", hi=1 << 24, doc="tokens (rows of the index tensor); runtime size"),
        Static("num_topk", lo=1, hi=MAX_TOPK, default=8, doc="indices per token"),
        Static(ids, lo=1, hi=MAX_IDS, default=256, doc=ids_doc),
    )


def default(shape: dict) -> dict:
    entries = shape.get("num_tokens", 8192) * shape["num_topk"]
    blocks, threads = 264, 128
    # One block while its loads cover the entries in a step or two (no cross-block atomics, no ticket);
    # beyond, a wide persistent grid (two blocks of 128 per H200 SM, TileKernels' launch shape): on the
    # H200 a grid of one block per 8K entries ran 13-16 us at 4096-65536 tokens, top-8, 256 groups,
    # where TileKernels' wide grid took 7.6-11 us; the counting is latency-bound, so spread it.
    # Where the grid would take 4 or more dependent steps of 16-byte loads (65536 tokens at top-8), vec=8:
    # four loads in flight a step, TileKernels' one row of 8 entries per thread (a latency-bound loop).
    if entries <= 2048:
        return {"layout": "grid", "blocks": 1, "threads": 512, "vec": 2}
    vec = 8 if entries >= blocks * threads * 8 else 2
    return {"layout": "grid", "blocks": blocks, "threads": threads, "vec": vec}


def constraint(shape: dict, c: dict) -> str | None:
    if c["layout"] == "loop" and (c["blocks"], c["threads"], c["vec"]) != (1, 128, 1):
        return "layout=loop is one thread: blocks=1, threads=128, vec=1 only (other values duplicate it)"
    return _coop_fit(c, H200_SMS)


def device_constraint(shape: dict, c: dict, device: dict) -> str | None:
    return _coop_fit(c, device["sms"])


def _coop_fit(c: dict, sms: int) -> str | None:
    """A cooperative grid (blocks > 1) must be resident at once: blocks * threads <= sms * 1024."""
    if c["blocks"] > 1 and c["blocks"] * c["threads"] > sms * COOP_THREADS_PER_SM:
        return (f"blocks * threads = {c['blocks'] * c['threads']} > {sms * COOP_THREADS_PER_SM}: a cooperative grid "
                f"(blocks > 1) must be co-resident ({sms} SMs at {COOP_THREADS_PER_SM} threads)")
    return None


def arch_constraint(arch: str, c: dict, shape: dict) -> str | None:
    if arch == "cpu":
        if c["layout"] != "loop":
            return "layout=grid needs shared memory and atomics: CUDA targets only (the C target takes layout=loop)"
        return None
    if c["layout"] == "loop":
        return "layout=loop runs one thread: for the C target only"
    return None


pass_configs = plain_threads


def build_counts(shape: dict, c: dict, ids: str, with_fi: bool):
    """The PrimFunc of group_count (with_fi=False) or aux_fi (with_fi=True)."""
    from tilelang import language as T

    K, G = shape["num_topk"], shape[ids]
    layout, blocks, threads, vec = c["layout"], c["blocks"], c["threads"], c["vec"]
    num_tokens = T.dynamic("num_tokens")
    i32, i64, f32 = T.int32, T.int64, T.float32
    padded = -(-G // threads) * threads  # counters for every thread of the clear / flush loops
    step = blocks * threads * vec  # entries the grid covers per step

    def valid(e):
        return (e >= T.int64(0)) & (e < T.int64(G))

    def fi_of(count, denom):
        # torch: counts.float() * num_experts (rounded to float32), then / float(num_tokens * k)
        return (T.cast(count, f32) * T.float32(G)) / denom

    def denom_of(num_aux_topk):
        return T.cast(T.cast(num_tokens, i64) * T.cast(num_aux_topk, i64), f32)

    @T.macro
    def loop_count(idx, counts):
        for g in T.serial(G):  # (the output is not zero-filled before the launch)
            counts[g] = 0
        for t in T.serial(num_tokens):
            for j in T.serial(K):
                e = idx[t, j]
                if valid(e):
                    counts[T.cast(e, i32)] = counts[T.cast(e, i32)] + 1

    @T.macro
    def zero_grid(buf, n, bx, tx):
        # blocks > 1: the grid zeroes what its atomics add into, each block a slice (ordered before the
        # atomics by the grid barrier that follows the counting).
        for j in T.serial(-(-n // (blocks * threads))):
            i = (j * blocks + bx) * threads + tx
            if i < n:
                buf[i] = 0

    @T.macro
    def grid_count(flat, smem, bx, tx):
        # (num_tokens * K written out, not named: with K = 1 it is num_tokens itself, and a name given to it
        # would rename the runtime size the launcher passes)
        for j in T.serial(padded // threads):
            smem[j * threads + tx] = 0
        T.sync_threads()
        ids_local = T.alloc_local((vec,), i64)
        for it in T.serial(T.ceildiv(num_tokens * K, step)):
            base = ((it * blocks + bx) * threads + tx) * vec
            if base + vec <= num_tokens * K:
                if vec <= 2:
                    for v in T.vectorized(vec):
                        ids_local[v] = flat[base + v]
                else:  # 16-byte loads, all issued before the counting
                    for u in T.unroll(vec // 2):
                        for v in T.vectorized(2):
                            ids_local[u * 2 + v] = flat[base + u * 2 + v]
            else:  # the grid's last partial step: element by element, nothing past the end
                for v in T.unroll(vec):
                    ids_local[v] = T.if_then_else(
                        base + v < num_tokens * K, flat[T.min(base + v, num_tokens * K - 1)], T.int64(-1)
                    )
            for v in T.unroll(vec):
                if valid(ids_local[v]):
                    T.atomic_add(smem[T.cast(ids_local[v], i32)], 1)
        T.sync_threads()

    if not with_fi:

        @T.prim_func
        def group_count(
            group_idx: T.Tensor[(num_tokens, K), i64],
            out: T.Tensor[(G,), i32],
        ):
            if layout == "loop":
                with T.Kernel(1, threads=1) as _:
                    loop_count(group_idx, out)
            else:
                with T.Kernel(blocks, threads=threads) as bx:
                    tx = T.get_thread_binding()
                    flat = T.reshape(group_idx, (num_tokens * K,))
                    smem = T.alloc_shared((padded,), i32)
                    if blocks > 1:
                        zero_grid(out, G, bx, tx)
                    grid_count(flat, smem, bx, tx)
                    if blocks > 1:
                        T.sync_grid()
                    for j in T.serial(padded // threads):
                        g = j * threads + tx
                        if g < G:
                            if blocks == 1:
                                out[g] = smem[g]
                            elif smem[g] > 0:
                                T.atomic_add(out[g], smem[g])

        return group_count

    @T.prim_func
    def aux_fi(
        topk_idx: T.Tensor[(num_tokens, K), i64],
        fi: T.Tensor[(G,), f32],
        counts: T.Tensor[(G + 1,), i32],
        num_aux_topk: T.int32,
    ):
        if layout == "loop":
            with T.Kernel(1, threads=1) as _:
                loop_count(topk_idx, counts)
                counts[G] = 0
                denom = denom_of(num_aux_topk)
                for g in T.serial(G):
                    fi[g] = fi_of(counts[g], denom)
        else:
            with T.Kernel(blocks, threads=threads) as bx:
                tx = T.get_thread_binding()
                flat = T.reshape(topk_idx, (num_tokens * K,))
                smem = T.alloc_shared((padded,), i32)
                last = T.alloc_shared((1,), i32)
                if blocks > 1:
                    zero_grid(counts, G + 1, bx, tx)  # (the ticket too)
                grid_count(flat, smem, bx, tx)
                denom = denom_of(num_aux_topk)
                if blocks == 1:
                    for j in T.serial(padded // threads):
                        g = j * threads + tx
                        if g < G:
                            counts[g] = smem[g]
                            fi[g] = fi_of(smem[g], denom)
                    if tx == 0:
                        counts[G] = 0
                else:
                    T.sync_grid()
                    for j in T.serial(padded // threads):
                        g = j * threads + tx
                        if g < G:
                            if smem[g] > 0:
                                T.atomic_add(counts[g], smem[g])
                    # Every thread's adds are visible device-wide before its block takes a ticket.
                    T.call_extern("handle", "__threadfence")
                    T.sync_threads()
                    if tx == 0:
                        ticket = T.atomic_add(counts[G], 1, memory_order="acq_rel", return_prev=True)
                        last[0] = T.if_then_else(ticket == blocks - 1, 1, 0)
                    T.sync_threads()
                    if last[0] == 1:
                        # The last block: every other block's counts are in; read them at L2 (atomics).
                        T.call_extern("handle", "__threadfence")
                        for j in T.serial(padded // threads):
                            g = j * threads + tx
                            if g < G:
                                total = T.atomic_add(counts[g], 0, memory_order="relaxed", return_prev=True)
                                fi[g] = fi_of(total, denom)
                        if tx == 0:
                            counts[G] = 0  # the ticket back to 0: outputs independent of the grid

    return aux_fi


def _random_idx(shape: dict, ids: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, k, e = shape["num_tokens"], shape["num_topk"], shape[ids]
    x = torch.randint(0, e, (n, k), generator=g, dtype=torch.int64)
    # Padding (-1) in ~1/8 of the entries, duplicates inside rows (randint draws with replacement),
    # and a popular id (contended counters).
    x[torch.rand(n, k, generator=g) < 0.125] = -1
    x[torch.rand(n, k, generator=g) < 0.05] = e // 2
    if seed % 2 == 1:
        # Odd seeds: out-of-range entries, which are skipped (never a wild write).
        bad = torch.tensor([e, e + 1, 1 << 40, -2, -(1 << 40), (1 << 63) - 1, -(1 << 63)], dtype=torch.int64)
        pos = torch.rand(n, k, generator=g) < 0.02
        x[pos] = bad[torch.randint(0, bad.numel(), (int(pos.sum()),), generator=g)]
    return x


def count_reference(idx: torch.Tensor, num_ids: int) -> torch.Tensor:
    """int64 counts of the ids in [0, num_ids) among idx's entries (the rest skipped)."""
    flat = idx.reshape(-1)
    keep = flat[(flat >= 0) & (flat < num_ids)]
    return torch.bincount(keep, minlength=num_ids)[:num_ids]


def fi_reference(counts: torch.Tensor, num_experts: int, num_tokens: int, num_aux_topk: int) -> torch.Tensor:
    """TileKernels' f_i as torch evaluates it on the CPU: (float(count) * E in float32) / float32(N * k),
    a correctly rounded float32 division (computed in float64 of float32 operands, then rounded:
    exact, and the same on any device)."""
    num = (counts.float() * num_experts).double()
    den = float(torch.tensor(num_tokens * num_aux_topk, dtype=torch.int64).float())
    return (num / den).float()  # den 0 (num_aux_topk=0): inf / nan, as torch gives


def group_count_reference(shape: dict, group_idx: torch.Tensor) -> torch.Tensor:
    return count_reference(group_idx, shape["num_groups"]).to(torch.int32)


def aux_fi_reference(shape: dict, topk_idx: torch.Tensor, num_aux_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    e = shape["num_experts"]
    counts = count_reference(topk_idx, e)
    fi = fi_reference(counts, e, topk_idx.shape[0], num_aux_topk)
    return fi, torch.cat([counts.to(torch.int32), counts.new_zeros(1, dtype=torch.int32)])


def group_count_inputs(shape: dict, device: str = "cpu", seed: int = 0) -> tuple:
    return (_random_idx(shape, "num_groups", seed).to(device),)


def aux_fi_inputs(shape: dict, device: str = "cpu", seed: int = 0) -> tuple:
    # num_aux_topk: the top-k of the loss, not always the routing's (seed varies it)
    k_aux = max(1, shape["num_topk"] - seed % 3)
    return (_random_idx(shape, "num_experts", seed).to(device), k_aux)


EXAMPLES_SIZES = ((8192, 8, 256), (4001, 8, 256), (65536, 8, 256), (4096, 6, 72))

group_count_build = lambda shape, c: build_counts(shape, c, "num_groups", False)  # noqa: E731
aux_fi_build = lambda shape, c: build_counts(shape, c, "num_experts", True)  # noqa: E731

COMMON = dict(
    family="moe",
    space=SPACE,
    default=default,
    constraint=constraint,
    arch_constraint=arch_constraint,
    device_constraint=device_constraint,
    pass_configs=pass_configs,
    tolerance=Tolerance(exact=True),
)

SPEC = register(
    KernelSpec(
        name="group_count",
        doc="int32 counts of each id in [0, num_groups) of an int64 (num_tokens, num_topk) index tensor",
        params=_params("num_groups", "groups (ids 0..num_groups-1; others skipped)"),
        build=group_count_build,
        inputs=(TensorArg("group_idx", "int64", ("num_tokens", "num_topk")),),
        # Not zeroed: the kernel writes all of it (blocks > 1 zero it in the kernel, see Layouts).
        outputs=(TensorArg("out", "int32", ("num_groups",)),),
        make_inputs=group_count_inputs,
        reference=group_count_reference,
        bytes_moved=lambda s: s["num_tokens"] * s["num_topk"] * 8 + s["num_groups"] * 4,
        examples=tuple({"num_tokens": n, "num_topk": k, "num_groups": e} for n, k, e in EXAMPLES_SIZES),
        **COMMON,
    )
)

AUX_FI_SPEC = register(
    KernelSpec(
        name="aux_fi",
        doc="aux-loss f_i = count * num_experts / (num_tokens * num_aux_topk) per expert, and the int32 counts",
        params=_params("num_experts", "experts (ids 0..num_experts-1; others skipped)"),
        build=aux_fi_build,
        inputs=(TensorArg("topk_idx", "int64", ("num_tokens", "num_topk")),),
        outputs=(
            # Not zeroed: every launch writes all of fi (one fill launch less per call, which is most of
            # the time of a launch-bound call; an empty batch, not launched, gets zeros all the same).
            TensorArg("fi", "float32", ("num_experts",)),
            # counts[:num_experts]: the per-expert counts; counts[num_experts]: the grid's block ticket,
            # left at 0. Not zeroed either: the grid zeroes it before its atomics (see Layouts).
            TensorArg("counts", "int32", (lambda s: s["num_experts"] + 1,)),
        ),
        scalars=(ScalarArg("num_aux_topk", int),),
        make_inputs=aux_fi_inputs,
        reference=aux_fi_reference,
        bytes_moved=lambda s: s["num_tokens"] * s["num_topk"] * 8 + s["num_experts"] * 8,
        examples=tuple({"num_tokens": n, "num_topk": k, "num_experts": e} for n, k, e in EXAMPLES_SIZES),
        **COMMON,
    )
)
