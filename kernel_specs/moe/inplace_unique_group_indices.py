"""inplace_unique_group_indices: in each row, every repeat of a group id after its first occurrence -> -1.

group_indices (num_tokens, num_topk) int64, updated in place (TileKernels' `inplace_unique_group_indices`).
A row's entries in [0, num_groups) are deduplicated, the first (leftmost) occurrence kept. Entries
outside [0, num_groups) are left as they are and never collide with anything: -1 (already "no
group"), other negatives (as TileKernels' kernel leaves them) and ids >= num_groups (TileKernels'
kernel asserts on them; here no bitmask word is ever indexed by them, no memory is touched beyond
the row). For in-range rows this is TileKernels' torch reference exactly.

num_groups is compiled in (the bitmask's width). TileKernels takes num_groups <= 128; the `compare`
algorithm serves any count up to MAX_GROUPS, the bitmask up to 256 groups.

Two algorithms, `algo`:
  bitmask  a per-row bitmask of seen groups in ceil(num_groups / 64) uint64 registers; an entry tests
           and sets its bit (the word chosen by selects over the unrolled words, never a dynamic
           register index). O(num_topk * words).
  compare  each entry against the entries before it in the row, all in registers. O(num_topk^2 / 2)
           compares, independent of num_groups.
Layout: one thread per row; its num_topk entries are loaded as `vec` x int64 vectors (vec=2: 16 bytes,
num_topk even); only the entries that change are stored. `grid`: 0 gives one block per `block_rows`
rows; > 0 a persistent grid of that many blocks (2x the H200's 132 SMs) striding over the
rows. The same code lowers on TileLang's C target.
"""

from __future__ import annotations

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance

MAX_TOPK = 64
MAX_GROUPS = 1 << 16
MAX_BITMASK_GROUPS = 256  # 4 uint64 words per thread
MAX_COMPARE_TOPK = 32  # 496 unrolled compares


def default(shape):
    k, groups = shape["num_topk"], shape["num_groups"]
    algo = "compare" if k <= 16 or groups > MAX_BITMASK_GROUPS else "bitmask"
    if k > MAX_COMPARE_TOPK:
        algo = "bitmask"
    vec = 2 if k % 2 == 0 else 1
    # One row per thread at every size: at 65536 tokens two rows per thread (block_rows 256) took 27 us on the
    # H200 where one row per thread took 5.5 us at 8192 and TileKernels 7.1 us at 65536 (session 7, run 1;
    # 65536 at one row per thread not yet re-measured).
    return {"algo": algo, "block_rows": 128, "threads": 128, "vec": vec, "grid": 0}


def constraint(shape, c):
    k, groups, rows, threads = shape["num_topk"], shape["num_groups"], c["block_rows"], c["threads"]
    if c["algo"] == "bitmask" and groups > MAX_BITMASK_GROUPS:
        return f"bitmask takes num_groups <= {MAX_BITMASK_GROUPS} (one uint64 register per 64 groups)"
    if c["algo"] == "compare" and k > MAX_COMPARE_TOPK:
        return f"compare takes num_topk <= {MAX_COMPARE_TOPK} (num_topk^2 / 2 unrolled compares)"
    if k % c["vec"]:
        return f"vec={c['vec']} accesses need num_topk={k} to be a multiple of {c['vec']}"
    if rows < threads or rows % threads:
        return "block_rows must be a multiple of threads (each thread owns block_rows / threads rows)"
    if rows // threads > 8:
        return "more than 8 rows per thread"
    return None


def check_shape(shape):
    if shape["num_topk"] > MAX_COMPARE_TOPK and shape["num_groups"] > MAX_BITMASK_GROUPS:
        return (f"num_topk={shape['num_topk']} > {MAX_COMPARE_TOPK} needs num_groups <= {MAX_BITMASK_GROUPS}, "
                f"got num_groups={shape['num_groups']}")
    return None


def build(shape, c):
    from tilelang import language as T

    k, groups = shape["num_topk"], shape["num_groups"]
    algo, rows, threads, vec, grid = c["algo"], c["block_rows"], c["threads"], c["vec"], c["grid"]
    words = (groups + 63) // 64
    num_tokens = T.dynamic("num_tokens")
    i64, u64 = T.int64, T.uint64

    @T.macro
    def dedup_row(gi, row, x, seen, hit):
        for j in T.unroll(k // vec):
            for v in T.vectorized(vec):
                x[j * vec + v] = gi[row, j * vec + v]
        if algo == "bitmask":
            for w in T.unroll(words):
                seen[w] = T.uint64(0)
            for j in T.unroll(k):
                ok = (x[j] >= 0) & (x[j] < groups)
                # In range only: the shift amount is in [0, 64) and the word in [0, words).
                bit = T.if_then_else(ok, T.shift_left(T.uint64(1), T.cast(x[j] & 63, u64)), T.uint64(0))
                word = T.cast(T.shift_right(x[j] & (MAX_GROUPS - 1), 6), T.int32)
                hit[0] = T.uint64(0)
                for w in T.unroll(words):
                    mine = T.if_then_else(word == w, bit, T.uint64(0))
                    hit[0] = hit[0] | (seen[w] & mine)
                    seen[w] = seen[w] | mine
                if hit[0] != T.uint64(0):
                    gi[row, j] = T.int64(-1)
        elif k > 1:  # (one entry per row: nothing can repeat)
            for j in T.unroll(1, k):
                hit[0] = T.uint64(0)
                for i in T.unroll(k - 1):
                    if i < j:  # constant once unrolled
                        hit[0] = hit[0] | T.if_then_else(x[i] == x[j], T.uint64(1), T.uint64(0))
                if (hit[0] != T.uint64(0)) & (x[j] >= 0) & (x[j] < groups):
                    gi[row, j] = T.int64(-1)

    if grid == 0:
        @T.prim_func
        def inplace_unique_group_indices(group_indices: T.Tensor[(num_tokens, k), i64]):
            with T.Kernel(T.ceildiv(num_tokens, rows), threads=threads) as bx:
                x = T.alloc_local((k,), i64)
                seen = T.alloc_local((words,), u64)
                hit = T.alloc_local((1,), u64)
                for t in T.Parallel(rows):
                    row = bx * rows + t
                    if row < num_tokens:
                        dedup_row(group_indices, row, x, seen, hit)

        return inplace_unique_group_indices

    @T.prim_func
    def inplace_unique_group_indices_persistent(group_indices: T.Tensor[(num_tokens, k), i64]):
        with T.Kernel(grid, threads=threads) as bx:
            x = T.alloc_local((k,), i64)
            seen = T.alloc_local((words,), u64)
            hit = T.alloc_local((1,), u64)
            for it in T.serial(T.ceildiv(num_tokens, grid * rows)):
                for t in T.Parallel(rows):
                    row = (it * grid + bx) * rows + t
                    if row < num_tokens:
                        dedup_row(group_indices, row, x, seen, hit)

    return inplace_unique_group_indices_persistent


def make_inputs(shape, device="cpu", seed=0):
    """Group ids in [0, num_groups) with many repeats (ids drawn from a few per row), -1 entries; odd
    seeds add out-of-range ids (negative, >= num_groups) that must stay as they are."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, k, groups = shape["num_tokens"], shape["num_topk"], shape["num_groups"]
    x = torch.randint(0, groups, (n, k), generator=g, dtype=torch.int64)
    # Half the rows draw from only a few ids: long runs of repeats.
    few = torch.randint(0, groups, (n, 3), generator=g, dtype=torch.int64)
    pick = torch.randint(0, 3, (n, k), generator=g)
    x = torch.where((torch.arange(n) % 2 == 0)[:, None], few.gather(1, pick), x)
    x[torch.rand(n, k, generator=g) < 0.1] = -1
    if seed % 2 == 1:
        odd = torch.tensor([-2, -7, groups, groups + 1, 1 << 40, -(1 << 62)], dtype=torch.int64)
        where = torch.rand(n, k, generator=g) < 0.15
        x[where] = odd[torch.randint(0, len(odd), (int(where.sum()),), generator=g)]
    return (x.to(device),)


def reference(shape, group_indices):
    x = group_indices.clone()
    in_range = (x >= 0) & (x < shape["num_groups"])
    k = x.shape[1]
    # repeat[:, j]: some earlier entry of the row holds the same value
    same = x[:, :, None] == x[:, None, :]  # [row, j, i]
    earlier = torch.ones(k, k, dtype=torch.bool).tril(-1)  # i < j
    repeat = (same & earlier).any(-1)
    x[repeat & in_range] = -1
    return x


SPEC = register(
    KernelSpec(
        name="inplace_unique_group_indices",
        family="moe",
        doc="in place: repeats of a group id in a row after its first occurrence become -1 (int64)",
        params=(
            Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size, tuned per power-of-two bucket"),
            Static("num_topk", lo=1, hi=MAX_TOPK, default=8, doc="group ids per token"),
            Static("num_groups", lo=1, hi=MAX_GROUPS, default=8, doc="ids in [0, num_groups) are deduplicated"),
        ),
        space={
            "algo": ("bitmask", "compare"),
            "block_rows": (64, 128, 256, 512, 1024),
            "threads": (64, 128, 256),
            "vec": (1, 2),
            "grid": (0, 264),
        },
        default=default,
        constraint=constraint,
        check_shape=check_shape,
        build=build,
        pass_configs=lambda c: {"tl.disable_warp_specialized": True},
        inputs=(TensorArg("group_indices", "int64", ("num_tokens", "num_topk"), inout=True,
                          align=lambda s, c: 8 * c["vec"]),),
        outputs=(),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        # Every row is read; the model counts the whole tensor written back once (an upper bound).
        bytes_moved=lambda s: 2 * s["num_tokens"] * s["num_topk"] * 8,
        examples=(
            {"num_tokens": 8192, "num_topk": 8, "num_groups": 8},
            {"num_tokens": 65536, "num_topk": 8, "num_groups": 8},
            {"num_tokens": 4096, "num_topk": 6, "num_groups": 128},
        ),
    )
)
