"""hal's edge for engines (``hal.integrations.edge``): one backend per engine process, resolved on
first use from the engine's setting, never at import."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

import hal
from hal.integrations import edge


@pytest.fixture(autouse=True)
def fresh_edge(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for engine in edge.ENGINES:
        for suffix in ("DEVICE", "EMULATE"):
            monkeypatch.delenv(f"HAL_{engine.upper()}_{suffix}", raising=False)
    edge.reset_for_tests()
    yield
    edge.reset_for_tests()


def test_the_engines_device_serves_when_the_setting_names_none_and_once_resolved_it_stays() -> None:
    backend = edge.edge_backend("sglang", engine_device="cpu")
    assert backend is hal.get_backend("cpu")
    assert edge.edge_backend("sglang", engine_device="npu") is backend  # resolved once per process


def test_the_setting_overrides_the_engine_device_and_emulation_is_the_backends_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_VLLM_DEVICE", "npu")
    monkeypatch.setenv("HAL_VLLM_EMULATE", "1")
    backend = edge.edge_backend("vllm", engine_device="cpu")
    assert backend.device_type == "npu" and backend.emulated and backend.device == torch.device("cpu")
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")
    # the emulated backend's tensors live on the host: the engine runs its CPU platform
    assert edge.IN_TREE_PLATFORMS["vllm"][backend.device.type] == "vllm.platforms.cpu.CpuPlatform"


def test_bad_settings_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_SGLANG_EMULATE", "yes")
    with pytest.raises(hal.UnsupportedConfigError, match="HAL_SGLANG_EMULATE='yes': expected 1"):
        edge.edge_backend("sglang")
    with pytest.raises(hal.UnsupportedConfigError, match="unknown engine 'trt'"):
        edge.edge_backend("trt")
    monkeypatch.setenv("HAL_SGLANG_EMULATE", "0")
    monkeypatch.setenv("HAL_SGLANG_DEVICE", "tpu")
    with pytest.raises(hal.UnknownDeviceError, match="unknown device 'tpu'"):
        edge.edge_backend("sglang")


def test_a_device_without_an_engine_platform_is_refused_by_name() -> None:
    class Elsewhere:
        device = torch.device("meta")

    with pytest.raises(hal.UnsupportedConfigError, match="runs on 'meta', which has no sglang platform"):
        edge.in_tree_platform_class("sglang", Elsewhere())  # type: ignore[arg-type]
