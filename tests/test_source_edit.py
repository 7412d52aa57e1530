"""A spec edited on disk after its process imported it: TileLang parses the builder's source from disk,
so a build then may not match the key (which hashes the imported source). It is refused, never cached."""

import subprocess
import sys
import textwrap

SPEC_SRC = '''
import torch

from tkjit.registry import register
from tkjit.spec import KernelSpec, Runtime, TensorArg


def build(shape, c):
    from tilelang import language as T

    n = T.dynamic("n")

    @T.prim_func
    def scale(x: T.Tensor[(n,), T.float32], y: T.Tensor[(n,), T.float32]):
        with T.Kernel(1, threads=1) as _:
            for i in T.serial(n):
                y[i] = x[i] * 2.0


    return scale


SPEC = register(KernelSpec(
    name="edited_scale", family="test", doc="y = 2x", params=(Runtime("n", hi=1 << 20),),
    space={"unroll": (1,)}, default=lambda s: {"unroll": 1}, build=build,
    inputs=(TensorArg("x", "float32", ("n",)),), outputs=(TensorArg("y", "float32", ("n",)),),
    make_inputs=lambda s, device="cpu", seed=0: (torch.randn(s["n"]).to(device),),
    reference=lambda s, x: x * 2.0, bytes_moved=lambda s: 8 * s["n"], examples=({"n": 8},),
))
'''

SCRIPT = '''
import pathlib, sys
sys.path.insert(0, sys.argv[1])
import torch
import tkjit
from tkjit.errors import CompileError
import edited_scale_spec as m

path = pathlib.Path(m.__file__)
if sys.argv[2] == "edit":  # the same lines, another constant: a builder TileLang would parse as y = 3x
    path.write_text(path.read_text().replace("x[i] * 2.0", "x[i] * 3.0"))
try:
    k = tkjit.get("edited_scale", {"n": 8}, arch="cpu")
except CompileError as e:
    print("REFUSED", e)
else:
    x = torch.arange(8, dtype=torch.float32)
    print("SERVED", k(x).tolist())
print("ENTRIES", len([r for r in tkjit.build.cache().entries() if r.get("kernel") == "edited_scale"]))
'''


def _run(tmp_path, mode):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path / "specs"), mode],
                       capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "TKJIT_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_a_spec_edited_after_import_is_not_built_into_the_cache(tmp_path):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "edited_scale_spec.py").write_text(SPEC_SRC)
    out = _run(tmp_path, "edit")
    assert "REFUSED edited_scale: its source files were edited after this process imported them" in out, out
    assert "ENTRIES 0" in out
    # A fresh process imports the edited source: its key names it, and it builds and serves y = 3x.
    out = _run(tmp_path, "keep")
    assert "SERVED [0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 21.0]" in out and "ENTRIES 1" in out, out
