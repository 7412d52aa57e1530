"""topk_sum_and_topk_group_idx: the num_topk_groups best expert groups of every token.

scores (num_tokens, num_groups, num_experts_per_group) float32 -> group_idx (num_tokens,
num_topk_groups) int64. A group's score is the sum of its num_topk_sum (1 or 2) largest scores
(top1 + top2, one float32 addition); the groups come best first, equal sums to the smaller group
index: TileKernels' `topk_sum_and_topk_group_idx`, bit-identical to its torch reference
`stable_topk(scores.topk(num_topk_sum, -1).values.sum(-1), num_topk_groups)` (a stable descending
sort). -0.0 and +0.0 compare equal, as in torch; -inf scores are fine; NaN scores, and +inf with
-inf in one group's top two (a NaN sum), are not supported (then some output slots may stay
unwritten; nothing is ever written out of bounds: a slot is written only for a rank below
num_topk_groups).

num_groups <= 32 (TileKernels' limit: a group per lane of a warp), num_topk_sum <= num_experts_per_group,
num_topk_groups <= num_groups.

Layouts (`layout`):
  lanes   a token is owned by `lanes` = next power of two >= num_groups consecutive lanes of a
          warp (32 / lanes tokens per warp); lane g reads group g's scores (`vec` floats per load,
          vec dividing num_experts_per_group), keeps its top two in registers, and its rank is the
          number of groups with a larger sum, or an equal sum and a smaller index, counted over the
          group's sums broadcast by shuffles. The lane whose rank is below num_topk_groups writes its
          index at that rank. Lanes past num_groups idle (their rank is never written). Tail tokens
          compute a valid row (clamped) and store nothing, so every lane takes part in the shuffles.
  thread  one thread per token does all of it in registers (num_groups sums, then the num_groups^2
          rank comparisons): no shuffles, so TileLang's C target (CPU) lowers it too.
"""

import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, Static, TensorArg, Tolerance, plain_threads

MAX_GROUPS = 32
MAX_PER_GROUP = 256


def _lanes(g: int) -> int:
    return 1 << (g - 1).bit_length()


def default(shape: dict) -> dict:
    epg = shape["num_experts_per_group"]
    vec = 4 if epg % 4 == 0 else 2 if epg % 2 == 0 else 1
    return {"layout": "lanes", "threads": 128, "vec": vec}


def check_shape(shape: dict) -> str | None:
    if shape["num_topk_sum"] > shape["num_experts_per_group"]:
        return (f"num_topk_sum={shape['num_topk_sum']} must be <= "
                f"num_experts_per_group={shape['num_experts_per_group']}")
    if shape["num_topk_groups"] > shape["num_groups"]:
        return f"num_topk_groups={shape['num_topk_groups']} must be <= num_groups={shape['num_groups']}"
    return None


def constraint(shape: dict, c: dict) -> str | None:
    epg = shape["num_experts_per_group"]
    if epg % c["vec"]:
        return f"vec={c['vec']} loads need num_experts_per_group={epg} to be a multiple of {c['vec']}"
    if c["layout"] == "thread" and c["vec"] != 1:
        return "layout=thread loads element by element (vec=1 only)"
    return None


def arch_constraint(arch: str, c: dict, shape: dict) -> str | None:
    if arch == "cpu" and c["layout"] != "thread":
        return "layout=lanes needs warp shuffles: CUDA targets only (the C target takes layout=thread)"
    return None


pass_configs = plain_threads


def build(shape: dict, c: dict):
    from tilelang import language as T

    G, EPG = shape["num_groups"], shape["num_experts_per_group"]
    KS, KG = shape["num_topk_sum"], shape["num_topk_groups"]
    layout, threads, vec = c["layout"], c["threads"], c["vec"]
    num_tokens = T.dynamic("num_tokens")
    f32 = T.float32
    NEG_INF = -T.infinity(f32)

    @T.macro
    def push(x, top):
        # top[0] >= top[1]: the two largest so far. Strict compares: an equal value goes to top[1].
        top[1] = T.if_then_else(x > top[0], top[0], T.if_then_else(x > top[1], x, top[1]))
        top[0] = T.if_then_else(x > top[0], x, top[0])

    def group_sum(top):
        return top[0] if KS == 1 else top[0] + top[1]

    if layout == "thread":

        @T.prim_func
        def topk_sum_and_topk_group_idx(
            scores: T.Tensor[(num_tokens, G, EPG), f32],
            group_idx: T.Tensor[(num_tokens, KG), T.int64],
        ):
            with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as bx:
                top = T.alloc_local((2,), f32)
                sums = T.alloc_local((G,), f32)
                rank = T.alloc_local((1,), T.int32)
                for t in T.Parallel(threads):
                    tok = bx * threads + t
                    if tok < num_tokens:
                        for g in T.unroll(G):
                            top[0] = NEG_INF
                            top[1] = NEG_INF
                            for j in T.unroll(EPG):
                                push(scores[tok, g, j], top)
                            sums[g] = group_sum(top)
                        for g in T.unroll(G):
                            rank[0] = 0
                            for h in T.unroll(G):
                                # h before g: ties go to the smaller index
                                if h < g:
                                    rank[0] = rank[0] + T.if_then_else(sums[h] >= sums[g], 1, 0)
                                elif h > g:
                                    rank[0] = rank[0] + T.if_then_else(sums[h] > sums[g], 1, 0)
                            if rank[0] < KG:
                                group_idx[tok, rank[0]] = T.int64(g)

        return topk_sum_and_topk_group_idx

    L = _lanes(G)
    tokens_per_block = threads // L
    nvec = EPG // vec

    @T.prim_func
    def topk_sum_and_topk_group_idx(
        scores: T.Tensor[(num_tokens, G, EPG), f32],
        group_idx: T.Tensor[(num_tokens, KG), T.int64],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tokens_per_block), threads=threads) as bx:
            tx = T.get_thread_binding()
            xs = T.alloc_local((vec,), f32)
            top = T.alloc_local((2,), f32)
            rank = T.alloc_local((1,), T.int32)
            lane = tx % L
            tok = bx * tokens_per_block + tx // L
            tc = T.min(tok, num_tokens - 1)  # tail tokens read a valid row, store nothing
            gc = T.min(lane, G - 1)  # lanes past the groups read a valid group, never store
            top[0] = NEG_INF
            top[1] = NEG_INF
            for i in T.unroll(nvec):
                for v in T.vectorized(vec):
                    xs[v] = scores[tc, gc, i * vec + v]
                for v in T.unroll(vec):
                    push(xs[v], top)
            mine = group_sum(top)
            rank[0] = 0
            for h in T.unroll(G):
                other = T.shfl_sync(mine, h, L)
                rank[0] = rank[0] + T.if_then_else((other > mine) | ((other == mine) & (h < lane)), 1, 0)
            if (lane < G) & (tok < num_tokens) & (rank[0] < KG):
                group_idx[tok, rank[0]] = T.cast(lane, T.int64)

    return topk_sum_and_topk_group_idx


def make_inputs(shape: dict, device: str = "cpu", seed: int = 0) -> tuple:
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, gr, epg = shape["num_tokens"], shape["num_groups"], shape["num_experts_per_group"]
    x = torch.randn(n, gr, epg, generator=g, dtype=torch.float32)
    if seed % 2 == 1:
        # Odd seeds: coarse values (equal scores inside groups and equal group sums: ties), signed
        # zeros, some -inf scores, and a few rows where every group is identical (all sums tie).
        x = (x * 2).round() / 2
        zero = x == 0
        x[zero] = torch.where(torch.rand(int(zero.sum()), generator=g) < 0.5, -0.0, 0.0)
        x[torch.rand(n, gr, epg, generator=g) < 0.02] = float("-inf")
        rows = torch.rand(n, generator=g) < 0.05
        x[rows] = x[rows][:, :1].expand(-1, gr, -1).clone()
    return (x.to(device),)


def reference(shape: dict, scores: torch.Tensor) -> torch.Tensor:
    sums = scores.topk(shape["num_topk_sum"], dim=-1, sorted=False).values.sum(-1)
    order = torch.sort(sums, dim=-1, descending=True, stable=True).indices
    return order[:, : shape["num_topk_groups"]].contiguous()


SPEC = register(
    KernelSpec(
        name="topk_sum_and_topk_group_idx",
        family="moe",
        doc="indices of the num_topk_groups groups with the largest top-1/top-2 score sums (best first)",
        params=(
            Runtime("num_tokens", hi=1 << 24, doc="tokens; runtime size"),
            Static("num_groups", lo=1, hi=MAX_GROUPS, default=8, doc="expert groups (<= 32)"),
            Static("num_experts_per_group", lo=1, hi=MAX_PER_GROUP, default=32, doc="experts in each group"),
            Static("num_topk_sum", lo=1, hi=2, default=2, doc="largest scores summed per group (1 or 2)"),
            Static("num_topk_groups", lo=1, hi=MAX_GROUPS, default=4, doc="groups selected per token"),
        ),
        space={"layout": ("lanes", "thread"), "threads": (32, 64, 128, 256), "vec": (1, 2, 4)},
        default=default,
        constraint=constraint,
        arch_constraint=arch_constraint,
        check_shape=check_shape,
        pass_configs=pass_configs,
        build=build,
        inputs=(TensorArg("scores", "float32", ("num_tokens", "num_groups", "num_experts_per_group")),),
        outputs=(TensorArg("group_idx", "int64", ("num_tokens", "num_topk_groups")),),
        make_inputs=make_inputs,
        reference=reference,
        tolerance=Tolerance(exact=True),
        bytes_moved=lambda s: s["num_tokens"] * (s["num_groups"] * s["num_experts_per_group"] * 4
                                                 + s["num_topk_groups"] * 8),
        examples=(
            {"num_tokens": 8192, "num_groups": 8, "num_experts_per_group": 32, "num_topk_sum": 2, "num_topk_groups": 4},
            {"num_tokens": 4001, "num_groups": 8, "num_experts_per_group": 9, "num_topk_sum": 1, "num_topk_groups": 2},
            {"num_tokens": 65536, "num_groups": 16, "num_experts_per_group": 16, "num_topk_sum": 2,
             "num_topk_groups": 4},
        ),
    )
)
