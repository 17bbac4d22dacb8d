"""Fixtures choosing which of the CPU backend's two kernels a test holds to the oracle."""

from __future__ import annotations

import pytest

from hal.backends.cpu.attention import CpuAttention


@pytest.fixture
def torch_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch through the pure-torch kernel (the one that serves where the compiled one does not)."""
    monkeypatch.setattr(CpuAttention, "_native_serves", lambda self, plan, v_head_dim: False)

