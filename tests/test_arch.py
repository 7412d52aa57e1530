"""tkjit.arch: arch names are checked exactly."""

import pytest

from tkjit.errors import TkjitError


def test_arch_with_trailing_newline():
    from tkjit.arch import check_arch

    with pytest.raises(TkjitError, match="invalid arch"):
        check_arch("cpu\n")
