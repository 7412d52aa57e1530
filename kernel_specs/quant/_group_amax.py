"""What the per-token casts share: staging one scale group's values (e4m3 and e2m1) and their amax (e4m3,
e2m1 and e5m6).

A group is `tpg` consecutive threads, each holding `per_thread` of its values in registers. The max of |x|
is a register max, then a shuffle butterfly over the group's lanes inside a warp, then, for groups wider
than a warp, one shared-memory step over its `wpg` warps. Every thread of the group ends with the amax.
"""


def group_amax_macro(T, *, per_thread: int, tpg: int):
    """A T.macro group_amax(xs, amax, red, tx): amax[0] = max |xs| over the group of thread tx. red: the
    block's (threads // 32,) float32 shared scratch, used (and needed) only when tpg > 32."""
    warp_tpg = min(tpg, 32)
    log_w = warp_tpg.bit_length() - 1
    wpg = max(1, tpg // 32)  # warps per group

    @T.macro
    def group_amax(xs, amax, red, tx):
        amax[0] = T.float32(0)
        for e in T.unroll(per_thread):
            amax[0] = T.max(amax[0], T.abs(T.cast(xs[e], T.float32)))
        for step in T.unroll(log_w):
            amax[0] = T.max(amax[0], T.shfl_xor(amax[0], (warp_tpg // 2) >> step))
        if wpg > 1:
            if tx % 32 == 0:
                red[tx // 32] = amax[0]
            T.sync_threads()
            first = (tx // tpg) * wpg
            for w in T.unroll(wpg):
                amax[0] = T.max(amax[0], red[first + w])
            T.sync_threads()

    return group_amax


def group_slots(hidden: int, group: int, vec: int, tpg: int) -> tuple[int, int, int]:
    """(cpt, tail, whole): chunk slots per thread, the channels of a partial last group (0: every group is
    whole; a multiple of 16), and the slots inside every group, the last one included (they load and store
    unguarded). The partial group has tail // vec chunks; slot i holds chunks [i * tpg, (i + 1) * tpg)."""
    cpt = group // (vec * tpg)
    tail = hidden % group
    whole = cpt if not tail else (tail // vec) // tpg
    return cpt, tail, whole


def group_load_macro(T, *, hidden: int, group: int, vec: int, tpg: int, in_dtype):
    """A T.macro group_load(xs, x, row, col, t): thread t of a group stages its chunks of the group at (row,
    col) of x into xs. A row's partial last group loads only its real channels (never a strided view's
    neighbours, never past the end of x); the missing ones count as 0, which leaves the amax of |x| unchanged."""
    cpt, tail, whole = group_slots(hidden, group, vec, tpg)

    @T.macro
    def group_load(xs, x, row, col, t):
        for i in T.unroll(whole):
            for v in T.vectorized(vec):
                xs[i * vec + v] = x[row, col + (i * tpg + t) * vec + v]
        if tail:
            for i in T.unroll(whole, cpt):
                if col + (i * tpg + t) * vec < hidden:
                    for v in T.vectorized(vec):
                        xs[i * vec + v] = x[row, col + (i * tpg + t) * vec + v]
                else:
                    for v in T.vectorized(vec):
                        xs[i * vec + v] = T.cast(0, in_dtype)

    return group_load
