import os

import pytest

import tkjit


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory, request):
    """One cache for the module (unless TKJIT_CACHE_DIR is set): variants compiled by compile_many
    in one test are served to the others, and parent and workers agree on where they live."""
    old = os.environ.get("TKJIT_CACHE_DIR")
    if old is None:
        name = request.module.__name__.rsplit(".", 1)[-1]
        os.environ["TKJIT_CACHE_DIR"] = str(tmp_path_factory.mktemp(f"{name}-cache"))
    tkjit.reset()
    yield
    if old is None:
        del os.environ["TKJIT_CACHE_DIR"]
    tkjit.reset()
