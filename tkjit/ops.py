"""Convenience forms that infer the shape from tensors: `tkjit.ops.sinkhorn_fwd(x)`."""

from __future__ import annotations

import torch

from tkjit.api import get
from tkjit.arch import arch_for_capability
from tkjit.errors import TensorError


def _arch_of(t: torch.Tensor) -> str:
    if t.device.type == "cuda":
        return arch_for_capability(*torch.cuda.get_device_capability(t.device))
    if t.device.type == "cpu":
        return "cpu"
    raise TensorError(f"tensors on {t.device} are not supported")


def sinkhorn_fwd(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6, *, config=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != x.shape[2]:
        raise TensorError(f"sinkhorn_fwd: x must be a (num_tokens, n, n) tensor, got {getattr(x, 'shape', x)}")
    shape = {"num_tokens": max(1, x.shape[0]), "n": x.shape[1], "repeat": repeat, "eps": eps}
    return get("sinkhorn_fwd", shape, arch=_arch_of(x), config=config)(x)
