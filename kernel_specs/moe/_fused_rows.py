"""The row layout expand_to_fused and reduce_fused share: rows of `hidden` elements moved in vectors.

A block of `threads` threads works on `rows` rows at once, threads // rows lanes per row. A row is
hidden * elem / vec_bytes vectors of vec_bytes bytes; a block covers a chunk of lanes * unroll of
them (lane l holds vectors u * lanes + l, u < unroll: a warp's accesses are consecutive), and the
grid's second axis runs over the ceil(row_vectors / chunk) chunks of a row. When the chunk does not
divide the row, the vectors past its end are guarded (neither loaded nor stored).
"""

from __future__ import annotations

ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
SPACE = {
    "threads": (64, 128, 256),
    "rows": (1, 2, 4, 8),
    "vec_bytes": (1, 2, 4, 8, 16),
    "unroll": (1, 2, 3, 4, 6, 7, 8),
}
MIN_LANES = 8  # fewer lanes per row would make a warp's accesses span 4+ rows: uncoalesced


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def geometry(hidden: int, elem: int, c: dict) -> tuple[int, int, int, int, int]:
    """(elements per vector, vectors per row, lanes per row, vectors per chunk, chunks per row)."""
    vec = c["vec_bytes"] // elem
    hv = hidden // vec
    lanes = c["threads"] // c["rows"]
    chunk = lanes * c["unroll"]
    return vec, hv, lanes, chunk, ceil_div(hv, chunk)


def widest_vec(hidden: int, elem: int) -> int:
    """The widest access (bytes, <= 16) that a row of hidden elements divides into."""
    return next(v for v in (16, 8, 4, 2, 1) if v >= elem and hidden * elem % v == 0)


def constraint(hidden: int, elem: int, c: dict) -> str | None:
    vb = c["vec_bytes"]
    if vb < elem:
        return f"vec_bytes={vb} is narrower than one {elem}-byte element"
    if hidden * elem % vb:
        return f"a row of hidden={hidden} ({hidden * elem} bytes) is not a whole number of {vb}-byte vectors"
    if vb * 2 < widest_vec(hidden, elem):
        return f"vec_bytes={vb}: the same bytes in 4x the instructions of {widest_vec(hidden, elem)}-byte vectors"
    if c["threads"] % c["rows"] or c["threads"] // c["rows"] < MIN_LANES:
        return f"rows={c['rows']} leaves fewer than {MIN_LANES} lanes per row out of threads={c['threads']}"
    vec, hv, lanes, chunk, _ = geometry(hidden, elem, c)
    if lanes > hv and c["rows"] < max(SPACE["rows"]):
        return f"{lanes} lanes per row but only {hv} vectors in a row: some lanes idle (use more rows)"
    if c["unroll"] > ceil_div(hv, lanes):
        return f"unroll={c['unroll']} exceeds the {ceil_div(hv, lanes)} vectors a lane has in a row"
    return None


def default(hidden: int, elem: int, threads: int = 128) -> dict:
    """The widest vectors; rows and unroll that leave the fewest idle vector slots, then the fewest
    chunks per row (a whole row per block, as TileKernels), then the fewest rows per block."""
    vb = widest_vec(hidden, elem)
    best = None
    for rows in SPACE["rows"]:
        for unroll in SPACE["unroll"]:
            c = {"threads": threads, "rows": rows, "vec_bytes": vb, "unroll": unroll}
            if constraint(hidden, elem, c):
                continue
            _, hv, _, chunk, chunks = geometry(hidden, elem, c)
            score = (chunks * chunk - hv, chunks, rows)
            if best is None or score < best[0]:
                best = (score, c)
    if best is None:  # a row narrower than every layout's lanes: the most rows per block
        return {"threads": 64, "rows": max(SPACE["rows"]), "vec_bytes": vb, "unroll": 1}
    return best[1]


def random_mapping(g, num_tokens: int, num_topk: int, num_expanded: int, seed: int):
    """(token_topk_to_pos int32, pos_to_expert int32): each used slot gets its own position (no two
    slots share one), about 1 in 8 slots unused (-1), unused positions are padding (-1). Odd seeds
    add out-of-range entries (>= num_expanded or < -1), which the kernels treat as -1."""
    import torch

    slots = num_tokens * num_topk
    used = torch.rand(slots, generator=g) >= 0.125
    idx = used.nonzero().flatten()
    idx = idx[torch.randperm(idx.numel(), generator=g)[: num_expanded]]
    pos = torch.full((slots,), -1, dtype=torch.int32)
    place = torch.randperm(num_expanded, generator=g)[: idx.numel()]
    pos[idx] = place.to(torch.int32)
    pos_to_expert = torch.full((num_expanded,), -1, dtype=torch.int32)
    pos_to_expert[place] = torch.randint(0, 256, (place.numel(),), generator=g, dtype=torch.int32)
    if seed % 2 == 1 and slots:
        free = (pos < 0).nonzero().flatten()
        bad = free[torch.randperm(free.numel(), generator=g)[: max(1, free.numel() // 4)]]
        junk = torch.tensor([num_expanded, num_expanded + 7, 2**31 - 1, -2, -(2**31)], dtype=torch.int32)
        pos[bad] = junk[torch.randint(0, junk.numel(), (bad.numel(),), generator=g)]
    return pos.view(num_tokens, num_topk), pos_to_expert
