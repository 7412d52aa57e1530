"""Import a script of tools/ (or of benchmarks/h200/scripts/) as a module, without putting its
folder on sys.path.

On sys.path, tools/ would also shadow any standard module a script is named like, for the rest of
the test session.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent.parent
TOOLS = ROOT / "tools"
SCRIPTS = ROOT / "benchmarks" / "h200" / "scripts"  # experiment drivers of the H200 results


def load_tool(name: str, folder: Path = TOOLS) -> ModuleType:
    """<folder>/<name>.py (tools/ by default) as the module `name` (loaded once per process)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    # Registered before it runs, as a normal import does (dataclasses look their module up).
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
