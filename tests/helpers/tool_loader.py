"""Import a script of tools/ as a module, without putting tools/ on sys.path.

On sys.path, tools/ would also shadow any standard module a script is named like, for the rest of
the test session.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parent.parent.parent / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as the module `name` (loaded once per process)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
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
