#!/usr/bin/env python3
"""One mHC sublayer's pre + post end to end, tkjit beside TileKernels and torch: `mhc_pre` (pre_norm_fn,
pre_split_mixes, Sinkhorn, pre_apply_mix), an identity sublayer, then `mhc_post`, through TileKernels' API
(tkjit's through `tkjit.compat.tile_kernels`), in three modes:

    train fwd      the forward with gradients on (the unfused ops, saving for backward)
    train fwd+bwd  the same, then the gradients of residual, fn, scale and base (torch.autograd.grad)
    infer fwd      under torch.no_grad (mhc_pre takes the fused mhc_pre_big_fuse)

    python tools/bench_mhc_layer.py                       # 8192 tokens x hidden 7168, mhc 4
    python tools/bench_mhc_layer.py --tokens 4096 --hidden 4096 --json layer.json [--no-compile]

Beside them, the layer written in torch (from the ops' documented semantics) in eager mode and under
torch.compile. Each mode is timed as the other benchmarks are (median of CUDA-event runs, L2 flushed before
each) on fixed random inputs; the outputs and gradients of each implementation are compared with tkjit's first.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tkjit.timing import median, rel_spread, time_cuda  # noqa: E402

MODES = ("train fwd", "train fwd+bwd", "infer fwd")


def torch_layer(residual, fn, scale, base, m: int, eps: float = 1e-6, post_mult: float = 1.0, repeat: int = 10):
    """The sublayer in torch: RMS-normed mixes of the flattened residual, split into pre / post / comb mixes,
    comb Sinkhorn-normalised, the layer input mixed down from the residual, and the post mix back into it."""
    x = residual.flatten(-2).float()
    mixes = (x @ fn.t()) * (x.square().mean(-1, keepdim=True) + eps).rsqrt()
    z = mixes * torch.cat([scale[0].expand(m), scale[1].expand(m), scale[2].expand(m * m)]) + base
    pre = z[..., :m].sigmoid() + eps
    post = z[..., m:2 * m].sigmoid() * post_mult
    comb = z[..., 2 * m:].unflatten(-1, (m, m)).softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    layer_input = (residual.float() * pre.unsqueeze(-1)).sum(-2).bfloat16()
    mixed = torch.einsum("...mn,...mc->...nc", comb, residual.float())
    return (layer_input.float().unsqueeze(-2) * post.unsqueeze(-1) + mixed).bfloat16()


def package_layer(mhc) -> Callable:
    """The sublayer through one package's `modeling.mhc` (the same API in both)."""

    def layer(residual, fn, scale, base, m: int):
        layer_input, (post_mix, comb_mix) = mhc.mhc_pre(residual, fn, scale, base, mhc_mult=m)
        return mhc.ops.mhc_post(layer_input, residual, post_mix, comb_mix)

    return layer


def inputs(tokens: int, m: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    residual = torch.randn(1, tokens, m, hidden, device="cuda", generator=g).bfloat16()
    fn = torch.randn(m * (m + 2), m * hidden, device="cuda", generator=g) / (m * hidden) ** 0.5
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    base = torch.randn(m * (m + 2), device="cuda", generator=g) * 0.1
    grad = torch.randn(1, tokens, m, hidden, device="cuda", generator=g).bfloat16()
    return residual, fn, scale, base, grad


def steps(layer: Callable, args: tuple, m: int) -> dict[str, Callable[[], object]]:
    *leaves, grad = [t.detach().clone() for t in args]
    for t in leaves:
        t.requires_grad_(True)
    state = {}

    def fwd():
        state["out"] = layer(*leaves, m)

    def fwd_bwd():
        out = layer(*leaves, m)
        state["out"] = out.detach()
        state["grads"] = torch.autograd.grad(out, leaves, grad)

    def infer():
        with torch.no_grad():
            state["infer"] = layer(*leaves, m)

    fwd_bwd()
    infer()
    return {"train fwd": fwd, "train fwd+bwd": fwd_bwd, "infer fwd": infer, "state": state}


def compare(name: str, ref: dict, got: dict) -> str:
    """The largest relative difference of the outputs and each gradient, against tkjit's."""
    def rel(a, b):
        a, b = a.float(), b.float()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    parts = [f"out {rel(got['out'], ref['out']):.1e}", f"infer {rel(got['infer'], ref['infer']):.1e}"]
    parts += [f"d{n} {rel(a, b):.1e}" for n, a, b in zip(("residual", "fn", "scale", "base"), got["grads"],
                                                           ref["grads"])]
    return f"{name} vs tkjit (max |diff| / max |tkjit|): " + ", ".join(parts)


def kernel_table(step: Callable[[], object], top: int, steps: int = 5) -> str:
    """The costliest CUDA kernels of `steps` runs of `step` (torch.profiler, device time summed): where a
    time goes rather than a guess."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=70)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--mhc", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also print each implementation's N costliest CUDA kernels over five train fwd+bwd steps")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mhc_layer: needs a CUDA GPU", file=sys.stderr)
        return 2
    import tkjit.compat.tile_kernels.modeling.mhc as tk_mhc

    layers = {"tkjit": package_layer(tk_mhc)}
    try:
        import tile_kernels.modeling.mhc as real_mhc

        layers["TileKernels"] = package_layer(real_mhc)
    except ImportError:
        print("bench_mhc_layer: tile_kernels is not installed; no TileKernels column")
    if not a.no_compile:
        layers["torch.compile"] = torch.compile(torch_layer, dynamic=False)
    layers["torch eager"] = torch_layer
    args = inputs(a.tokens, a.mhc, a.hidden)
    runs = {}
    for name, layer in layers.items():
        try:
            runs[name] = steps(layer, args, a.mhc)
        except Exception as e:  # one implementation that fails must not lose the table
            print(f"{name}: {type(e).__name__}: {e}")
    for name, r in runs.items():
        if name != "tkjit" and "tkjit" in runs:
            print(compare(name, runs["tkjit"]["state"], r["state"]))
    rows = []
    for mode in MODES:
        for name, r in runs.items():
            xs = time_cuda(r[mode], reps=a.reps)
            rows.append({"mode": mode, "impl": name, "us": median(xs), "spread": rel_spread(xs)})
    print(f"mHC sublayer pre + post: {a.tokens} tokens, mhc {a.mhc}, hidden {a.hidden} bf16 "
          f"({torch.cuda.get_device_name()}), µs (median of {a.reps})")
    names = list(runs)
    print(f"{'mode':<15} " + " ".join(f"{n:>14}" for n in names) + ("  TileKernels / tkjit" if
                                                                       "TileKernels" in names else ""))
    for mode in MODES:
        us = {r["impl"]: r["us"] for r in rows if r["mode"] == mode}
        line = f"{mode:<15} " + " ".join(f"{us[n]:>14.1f}" for n in names)
        if "TileKernels" in us and "tkjit" in us:
            line += f"  {us['TileKernels'] / us['tkjit']:>19.2f}x"
        print(line)
    for name, r in runs.items() if a.profile else ():
        print(f"\n{name}: CUDA kernels of five train fwd+bwd steps (summed)")
        print(kernel_table(r["train fwd+bwd"], a.profile))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "gpu": torch.cuda.get_device_name(), "rows": rows},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
