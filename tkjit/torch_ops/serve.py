"""How an op's implementation finds its kernel: the config it is given as text, and the kernel object
`get` serves a call (remembered per call signature)."""

import ast
import functools
from collections.abc import Callable, Mapping

import torch

from tkjit.api import call_memo, get
from tkjit.arch import arch_of
from tkjit.errors import ConfigError


def encode_config(config: Mapping | str | None) -> str | None:
    """A config as the ops take it: the text of a dict (torch.compile traces this without a break)."""
    if config is None or isinstance(config, str):
        return config
    return repr(dict(config))


@functools.lru_cache(maxsize=256)
def decode_config(text: str | None) -> dict | None:
    """The dict a config text holds (`encode_config`'s inverse), or ConfigError; literals only, never code."""
    if text is None:
        return None
    try:
        value = ast.literal_eval(text)
        return dict(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ConfigError(f"config {text!r} is not the text of a dict (e.g. \"{{'threads': 128}}\")") from None


_served = call_memo(256)  # (op, x's shape, dtype and device, the scalars and their types, config) -> kernel object


def kernel_for(name: str, x, scalars: tuple, config: str | None, shape_of: Callable[[], dict]):
    """The kernel object `get` serves a call of op `name` on x (the tensor that sizes it) with these scalars,
    remembered per call signature: a repeat call skips building the shape and get's lookup (about 1.5 us of
    the 2.3 an op added over its kernel object on the CPU host). shape_of() checks x and builds the shape."""
    try:
        key = (name, x.shape, x.dtype, x.device, scalars, tuple(map(type, scalars)), config)
        hit = _served.get(key)
    except (AttributeError, TypeError):  # not a tensor, or an unhashable value: shape_of's checks name it
        key = hit = None
    if hit is not None:
        return hit
    kern = kernel_of(name, shape_of(), x, config)
    if key is not None:
        _served.remember(key, kern)
    return kern


def kernel_of(name: str, shape: dict, on: torch.Tensor, config: str | None):
    """The kernel object `get` serves op `name` at `shape` for the device `on` is on, with the config text `config`
    (None: the tuned or default config)."""
    return get(name, shape, arch=arch_of(on), config=decode_config(config))
