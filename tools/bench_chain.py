"""The MoE routing chain end to end, tkjit beside TileKernels: get_fused_mapping -> expand_to_fused ->
reduce_fused, both through TileKernels' API (tkjit's through `tkjit.compat.tile_kernels`).

    python tools/bench_chain.py                      # 8192 tokens, top-8 of 256 experts, hidden 7168, bf16
    python tools/bench_chain.py --tokens 4096 --hidden 4096 --json chain.json
    python tools/bench_chain.py --graph     # also each step replayed from a CUDA graph: GPU time without the host

Each step and the whole chain are timed as the other benchmarks are (median of CUDA-event runs, L2 flushed
before each), on fresh random routing (distinct experts per token) and activations. The maps are sized to
TileKernels' upper bound (num_tokens * k + num_experts * (alignment - 1) rows), so nothing syncs with the host.
The chain's outputs are compared between the two packages first (the combine is bit-exact in both).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tkjit.timing import median, rel_spread, time_cuda  # noqa: E402


def routing(num_tokens: int, num_experts: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_idx (int64, k distinct experts per token, uniform) and positive float32 weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand(num_tokens, num_experts, device="cuda", generator=g).topk(k, dim=1).indices
    w = torch.rand(num_tokens, k, device="cuda", generator=g) + 0.01
    return idx, w


def chain_steps(mod, x, idx, w, num_experts: int, alignment: int):
    """The three calls of the chain as closures over one package's `moe` module (same API for both)."""
    p = x.shape[0] * idx.shape[1] + num_experts * (alignment - 1)
    state = {}

    def mapping():
        state["m"] = mod.get_fused_mapping(idx, num_experts, p, alignment)

    def expand():
        m = state["m"]
        state["e"] = mod.expand_to_fused(x, m[3], m[0])

    def reduce():
        state["r"] = mod.reduce_fused(state["e"], w, state["m"][3])

    def whole():
        mapping()
        expand()
        reduce()

    whole()
    return {"get_fused_mapping": mapping, "expand_to_fused": expand, "reduce_fused": reduce, "chain": whole}, state


def graphed(fn):
    """fn captured once into a CUDA graph; the replay runs the same kernels without the host's per-call work,
    so timing it separates a step's GPU time from its launch path."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--alignment", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--graph", action="store_true", help="also time each step replayed from a CUDA graph")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    import tkjit.compat.tile_kernels as tkc

    impls = {"tkjit": tkc.moe}
    try:
        import tile_kernels

        impls["TileKernels"] = tile_kernels.moe
    except ImportError:
        print("bench_chain: tile_kernels is not installed; timing tkjit alone")
    idx, w = routing(a.tokens, a.experts, a.topk)
    x = torch.randn(a.tokens, a.hidden, device="cuda").to(torch.bfloat16)
    steps, states = {}, {}
    for name, mod in impls.items():
        steps[name], states[name] = chain_steps(mod, x, idx, w, a.experts, a.alignment)
    if "TileKernels" in states:
        same = torch.equal(states["tkjit"]["r"], states["TileKernels"]["r"])
        print(f"combine output, tkjit vs TileKernels: {'bit-exact' if same else 'DIFFERENT'}")
    rows = []
    modes = ("call", "graph") if a.graph else ("call",)
    for step in ("get_fused_mapping", "expand_to_fused", "reduce_fused", "chain"):
        for name in impls:
            for mode in modes:
                try:
                    fn = steps[name][step] if mode == "call" else graphed(steps[name][step])
                    xs = time_cuda(fn, reps=a.reps)
                except Exception as e:  # one impl that cannot be captured must not lose the table
                    print(f"{step} {name} {mode}: {type(e).__name__}: {e}")
                    continue
                rows.append({"step": step, "impl": name if mode == "call" else f"{name} (graph)", "us": median(xs),
                             "spread": rel_spread(xs)})
    impls = {r["impl"]: None for r in rows}  # the columns: each impl, and its graph replay
    print(f"routing chain: {a.tokens} tokens, top-{a.topk} of {a.experts} experts, alignment {a.alignment}, "
          f"hidden {a.hidden} bf16 ({torch.cuda.get_device_name()})")
    print(f"{'step':<20} " + " ".join(f"{n:>20}" for n in impls) + ("   speedup" if "TileKernels" in impls else ""))
    for step in ("get_fused_mapping", "expand_to_fused", "reduce_fused", "chain"):
        us = {r["impl"]: r["us"] for r in rows if r["step"] == step}
        line = f"{step:<20} " + " ".join(f"{us[n]:>17.1f} us" if n in us else f"{'-':>20}" for n in impls)
        if "TileKernels" in us and "tkjit" in us:
            line += f"   {us['TileKernels'] / us['tkjit']:.2f}x"
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
