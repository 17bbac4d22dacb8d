"""vLLM's entry points into hal (``pyproject.toml``: groups ``vllm.general_plugins`` and
``vllm.platform_plugins``). vLLM calls them in each of its processes."""

from __future__ import annotations

import os

#: The name vLLM knows hal's attention backend by.
NAME = "HAL"
#: Where vLLM imports the backend from.
BACKEND_PATH = "hal.integrations.vllm.attention.HalAttentionBackend"
#: The environment variable that opts into hal's platform.
PLATFORM_ENV = "HAL_VLLM_PLATFORM"


def register() -> None:
    """General plugin: add ``HAL`` to vLLM's attention backends. Registering changes nothing for an
    engine that does not select it (through hal's platform, or ``attention_backend="HAL"`` on a
    platform that honours the selection)."""
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(NAME, BACKEND_PATH)


def activate_platform() -> str | None:
    """Platform plugin: hal's platform when ``HAL_VLLM_PLATFORM=1``, else None (vLLM's own)."""
    if os.environ.get(PLATFORM_ENV) != "1":
        return None
    return "hal.integrations.vllm.platform.HalPlatform"
