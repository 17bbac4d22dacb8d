"""The vLLM adapter's pieces without an engine: the internals it names exist, the platform is
opt-in, the K/V planes over a layer cache, and what the backend refuses, by name."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from hal.errors import KVLayoutError, UnsupportedConfigError  # noqa: E402
from hal.integrations.vllm import VLLM_INTERNALS  # noqa: E402
from hal.integrations.vllm.attention import HalAttentionImpl, layer_planes  # noqa: E402
from hal.integrations.vllm.plugin import PLATFORM_ENV, activate_platform  # noqa: E402
from hal.spec import KVPoolSpec  # noqa: E402


@pytest.mark.parametrize("module", sorted(VLLM_INTERNALS))
def test_every_named_vllm_internal_exists(module: str) -> None:
    loaded = importlib.import_module(module)
    for name in VLLM_INTERNALS[module]:
        target = loaded
        for part in name.split("."):
            assert hasattr(target, part), f"{module}.{name} is gone"
            target = getattr(target, part)


def test_the_platform_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLATFORM_ENV, raising=False)
    assert activate_platform() is None
    monkeypatch.setenv(PLATFORM_ENV, "1")
    assert activate_platform() == "hal.integrations.vllm.platform.HalPlatform"


def test_layer_planes_are_k_then_v_over_the_layers_memory() -> None:
    spec = KVPoolSpec(num_layers=1, size=8, page_size=4, kv_heads=2, head_dim=3, v_head_dim=2, dtype=torch.float32)
    cache = torch.arange(3 * 2 * 4 * 5, dtype=torch.float32).view(3, 2, 4, 5)  # vLLM's [B, H, N, D + Dv]
    k, v = layer_planes(cache, spec, "layer")
    assert k.shape == (3, 4, 2, 3) and v.shape == (3, 4, 2, 2)
    assert k.data_ptr() == cache.data_ptr() and v.data_ptr() == cache.data_ptr() + 3 * 4 * 2 * 3 * 4
    assert torch.equal(k.reshape(-1), torch.arange(72, dtype=torch.float32))
    with pytest.raises(KVLayoutError, match="dense elements"):
        layer_planes(torch.zeros(3, 2, 8, 5)[:, :, ::2], spec, "layer")


@pytest.mark.parametrize(
    ("option", "value"),
    [("alibi_slopes", [0.5, 0.25]), ("logits_soft_cap", 30.0), ("kv_sharing_target_layer_name", "model.layers.0.attn"),
     ("kv_cache_dtype", "fp8"), ("attn_type", "encoder_only")],
)
def test_what_hal_does_not_compute_is_refused_at_construction(option: str, value: object) -> None:
    options: dict[str, object] = dict(num_heads=2, head_size=32, scale=0.1, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
                                      kv_cache_dtype="auto")
    options[option] = value
    with pytest.raises(UnsupportedConfigError, match=option):
        HalAttentionImpl(**options)  # type: ignore[arg-type]


def test_importing_the_platform_module_resolves_nothing() -> None:
    """hal's backend is resolved when vllm reads ``HalPlatform`` (activating the platform), not
    when the module is imported."""
    code = textwrap.dedent(
        """
        import hal.integrations.vllm.platform as platform
        from hal.integrations import edge
        assert edge._resolved == {}, edge._resolved
        cls = platform.HalPlatform
        assert edge._resolved["vllm"] is cls.hal_backend and platform.HalPlatform is cls
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_under_hals_platform_every_attention_layer_is_hals_or_refused_as_it_is_built() -> None:
    """With ``HAL_VLLM_PLATFORM=1`` the diff-KV backends a model names itself (MiMo-V2-Flash) resolve
    to hal's, and a layer built with any other backend class fails as vLLM builds it, naming the layer."""
    code = textwrap.dedent(
        f"""
        import os
        os.environ[{PLATFORM_ENV!r}] = "1"
        from hal.errors import UnsupportedConfigError
        from hal.integrations.vllm.attention import HalAttentionBackend
        from hal.integrations.vllm.plugin import register
        register()
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        assert AttentionBackendEnum.FLASH_ATTN_DIFFKV.get_class() is HalAttentionBackend
        assert AttentionBackendEnum.TRITON_ATTN_DIFFKV.get_class() is HalAttentionBackend

        class AnotherBackend(HalAttentionBackend):
            pass

        with set_current_vllm_config(VllmConfig()):
            Attention(2, 32, 0.1, num_kv_heads=1, prefix="model.layers.0.attn", attn_backend=HalAttentionBackend)
            try:
                Attention(2, 32, 0.1, num_kv_heads=1, prefix="model.layers.1.attn", attn_backend=AnotherBackend)
            except UnsupportedConfigError as exc:
                assert "model.layers.1.attn" in str(exc), exc
            else:
                raise AssertionError("a layer on another backend was built under hal's platform")
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_layers_sharing_a_kv_tensor_agree_when_their_blocks_hold_as_many_k_and_v_elements() -> None:
    """MiMo-V2-Flash under vLLM: a full layer with 1 KV head and blocks of 32 tokens shares a tensor
    with a sliding-window layer with 2 KV heads and blocks of 16; hal's planes put each block of both
    at the same place (checked on the memory), and other head dims would not."""
    from hal.integrations.vllm.attention import block_geometry

    blocks, dk, dv = 5, 6, 4
    memory = torch.arange(blocks * 32 * (dk + dv), dtype=torch.float32)
    full = KVPoolSpec(num_layers=1, size=(blocks - 1) * 32, page_size=32, kv_heads=1, head_dim=dk, v_head_dim=dv, dtype=torch.float32)
    window = KVPoolSpec(num_layers=1, size=(blocks - 1) * 16, page_size=16, kv_heads=2, head_dim=dk, v_head_dim=dv, dtype=torch.float32)
    assert block_geometry(blocks, 1, 32, dk, dv) == block_geometry(blocks, 2, 16, dk, dv)
    full_k, full_v = layer_planes(memory.view(blocks, 1, 32, dk + dv), full, "full")
    window_k, window_v = layer_planes(memory.view(blocks, 2, 16, dk + dv), window, "window")
    for b in range(blocks):
        assert torch.equal(full_k[b].reshape(-1), window_k[b].reshape(-1))
        assert torch.equal(full_v[b].reshape(-1), window_v[b].reshape(-1))
    assert block_geometry(blocks, 1, 32, dk, dv) != block_geometry(blocks, 2, 16, dk + 2, dv - 2)
