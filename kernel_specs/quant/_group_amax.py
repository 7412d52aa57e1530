"""The amax of one scale group's staged values, shared by the per-token casts (e4m3 and e5m6).

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
