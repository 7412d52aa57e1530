"""Which GPU arch to build for: explicit, TKJIT_ARCH, or the current GPU.

A named arch lets a CPU-only host cross-compile (TileLang + nvcc emit sm_XX code, nothing runs).
"cpu" selects TileLang's C target: the whole path runs on a CPU (CI).
"""

from __future__ import annotations

import functools
import re

from tkjit import envs
from tkjit.errors import TensorError, TkjitError

_ARCH_RE = re.compile(r"^(sm_[1-9][0-9]{1,2}[af]?|cpu)$")


def arch_for_capability(major: int, minor: int) -> str:
    # The 'a' targets unlock wgmma/setmaxnreg (9.0) and tcgen05 (10.0); they run only on that exact chip.
    if (major, minor) in ((9, 0), (10, 0), (10, 3)):
        return f"sm_{major}{minor}a"
    return f"sm_{major}{minor}"


def current_arch(device: int | None = None) -> str | None:
    """The arch of the current (or given) CUDA device; None without a usable GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device() if device is None else device
    return arch_for_capability(*torch.cuda.get_device_capability(idx))


@functools.lru_cache(maxsize=64)
def _device_arch(kind: str, index: int | None) -> str:
    if kind == "cuda":
        import torch

        return arch_for_capability(*torch.cuda.get_device_capability(index))
    if kind == "cpu":
        return "cpu"
    raise TensorError(f"tensors on {kind} devices are not supported: tkjit kernels take CUDA (or CPU) tensors")


_arch_by_device: dict = {}  # torch.device -> arch (a tensor's device always has its index)


def arch_of(tensor) -> str:
    """The arch a tensor's device runs: 'cpu' (the C target) or its GPU's (looked up once per device)."""
    device = tensor.device
    found = _arch_by_device.get(device)
    if found is None:
        index = device.index
        if device.type == "cuda" and index is None:
            import torch

            index = torch.cuda.current_device()
        found = _device_arch(device.type, index)  # raises for a device type no kernel runs on
        _arch_by_device[device] = found
    return found


def check_arch(arch: str) -> str:
    if not isinstance(arch, str) or not _ARCH_RE.fullmatch(arch):
        raise TkjitError(f"invalid arch {arch!r}: expected e.g. 'sm_90a', 'sm_100a', 'sm_89' or 'cpu'")
    return arch


def resolve_arch(arch: str | None = None) -> str:
    if arch is not None:
        return check_arch(arch)
    env = envs.ARCH.get()
    if env:
        return check_arch(env)
    found = current_arch()
    if found is None:
        raise TkjitError("no CUDA GPU found: pass arch='sm_90a' (or set TKJIT_ARCH) to cross-compile")
    return found


def tilelang_target(arch: str) -> str | dict:
    return "c" if arch == "cpu" else {"kind": "cuda", "arch": arch}


def gpu_name() -> str | None:
    name = envs.GPU_NAME.get()
    if name:
        return name
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def device_limits(arch: str) -> dict[str, int] | None:
    """The GPU that kernels for `arch` run on, as far as a grid whose blocks must all be resident needs
    it: {"sms": its SM count}. TKJIT_NUM_SMS names the count (a build host cross-compiling for a fleet);
    otherwise the current GPU's, when its arch is `arch`. None where unknown (no GPU, another arch, the
    C target): the specs' own bounds (an H200's) then apply."""
    if arch == "cpu":
        return None
    sms = envs.count(envs.NUM_SMS, "the GPU's SM count, e.g. 132")
    if sms is not None:
        return {"sms": sms}
    if current_arch() != arch:
        return None
    import torch

    return {"sms": _sm_count(torch.cuda.current_device())}


@functools.lru_cache(maxsize=64)
def _sm_count(index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index).multi_processor_count)
