import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


HAS_CUDA = _has_cuda()


def pytest_runtest_logreport(report):
    """TKJIT_INSTAFAIL=1: a failure's traceback is printed as it happens, not only in the summary at the end, so
    a run killed at its time limit (the H200 runs) keeps the messages of the failures before the kill."""
    if report.failed and os.environ.get("TKJIT_INSTAFAIL") == "1":
        import sys

        sys.__stderr__.write(f"\n!!! FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")
        sys.__stderr__.flush()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty cache for one test; the in-process memo is reset around it."""
    import tkjit

    d = tmp_path / "cache"
    monkeypatch.setenv("TKJIT_CACHE_DIR", str(d))
    tkjit.reset()
    yield d
    tkjit.reset()


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """One private cache for a test module: a kernel one test compiles (seconds on the C target) serves
    the others. Modules that want it: `pytestmark = pytest.mark.usefixtures("module_cache")`."""
    import tkjit

    with pytest.MonkeyPatch.context() as mp:
        d = tmp_path_factory.mktemp("module-cache") / "cache"
        mp.setenv("TKJIT_CACHE_DIR", str(d))
        tkjit.reset()
        yield d
    tkjit.reset()


@pytest.fixture(autouse=True)
def _no_user_cache(tmp_path_factory, monkeypatch):
    # Tests never touch the developer's real cache.
    if "TKJIT_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("TKJIT_CACHE_DIR", str(tmp_path_factory.mktemp("default-cache")))
