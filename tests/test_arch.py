"""tkjit.arch: arch names are checked exactly."""

import pytest

from tkjit.errors import TkjitError


def test_arch_with_trailing_newline():
    from tkjit.arch import check_arch

    with pytest.raises(TkjitError, match="invalid arch"):
        check_arch("cpu\n")


def test_arch_of_looks_a_device_up_once(monkeypatch):
    import torch

    from tkjit import arch

    arch._arch_by_device.clear()
    asked = []
    real = arch._device_arch
    monkeypatch.setattr(arch, "_device_arch", lambda kind, index: asked.append((kind, index)) or real(kind, index))
    assert [arch.arch_of(torch.empty(2)) for _ in range(3)] == ["cpu"] * 3
    assert asked == [("cpu", None)]
    from tkjit.errors import TensorError

    with pytest.raises(TensorError, match="meta devices are not supported"):
        arch.arch_of(torch.empty(2, device="meta"))
    with pytest.raises(TensorError, match="meta devices"):  # a refusal is not remembered as an arch
        arch.arch_of(torch.empty(2, device="meta"))
