"""TileKernels' `config`: the process-wide SM count its persistent kernels size their grids by.

As in TileKernels, `set_num_sms(n)` sets it for the whole process and `get_num_sms()` returns it (the
device's SM count until set). For tkjit it is advisory: none of the ops tkjit serves today is a
persistent kernel (their grids follow the data, and each kernel's launch config is tuned per GPU),
so the setting changes no result; persistent kernels tkjit adds read it as TileKernels' do.
"""

from __future__ import annotations

import functools

import torch

from tkjit.compat.tile_kernels._support import as_int
from tkjit.errors import ShapeError, TkjitError

__all__ = ["get_device_num_sms", "set_num_sms", "get_num_sms", "get_max_smem_per_sm"]
_num_sms = 0  # 0: not set, the device's count


def _device_properties():
    if not torch.cuda.is_available():
        raise TkjitError("tile_kernels.config: no CUDA GPU found (the SM count is a property of the current device)")
    return torch.cuda.get_device_properties(torch.cuda.current_device())


@functools.cache
def get_device_num_sms() -> int:
    """The current CUDA device's number of SMs."""
    return _device_properties().multi_processor_count


def set_num_sms(num_sms: int) -> None:
    """Set the SM count persistent kernels use, process-wide: 0 < num_sms <= the device's count (the
    upper bound is checked where a CUDA device is present)."""
    global _num_sms
    num_sms = as_int("config.set_num_sms", "num_sms", num_sms)
    if num_sms <= 0:
        raise ShapeError(f"tile_kernels.config.set_num_sms: num_sms must be positive, got {num_sms}")
    if torch.cuda.is_available() and num_sms > get_device_num_sms():
        raise ShapeError(
            f"tile_kernels.config.set_num_sms: num_sms={num_sms} exceeds the device's {get_device_num_sms()} SMs"
        )
    _num_sms = num_sms


def get_num_sms() -> int:
    """The SM count set by set_num_sms, or the device's when none was set."""
    if _num_sms == 0:
        return get_device_num_sms()
    return _num_sms


@functools.cache
def get_max_smem_per_sm() -> int:
    """The current CUDA device's shared memory per SM, in bytes."""
    return _device_properties().shared_memory_per_multiprocessor
