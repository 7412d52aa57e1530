"""ptxas -v on a generated kernel, compiled as TileLang compiles it (CPU host: nvcc cross-compiles for sm_90a)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest


def ptxas_usage(cu: Path) -> dict[str, int]:
    """Registers (the most of any kernel in the file) and spill-store bytes (summed); skips without nvcc."""
    import tilelang

    root = Path(tilelang.__file__).parent
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    r = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-o", "/dev/null", "-Xptxas", "-v", "-std=c++17", "-w",
                        f"-I{root / 'src'}", f"-I{root / '3rdparty' / 'cutlass' / 'include'}", str(cu)],
                       capture_output=True, text=True, check=True)
    regs = [int(v) for v in re.findall(r"Used (\d+) registers", r.stderr)]
    spill = [int(v) for v in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    return {"registers": max(regs), "spill": sum(spill)}
