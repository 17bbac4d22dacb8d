"""vLLM's entry points into hal (``pyproject.toml``: groups ``vllm.general_plugins`` and
``vllm.platform_plugins``). vLLM calls them in each of its processes."""

from __future__ import annotations

import os
from typing import Any

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
    refuse_a_substitute_for_hal()
    if os.environ.get(PLATFORM_ENV) == "1":
        serve_every_attention_layer()


def is_hals_backend(backend_class: type) -> bool:
    """Whether vLLM resolved an attention backend to hal's class (``BACKEND_PATH``), by its import path."""
    return f"{backend_class.__module__}.{backend_class.__qualname__}" == BACKEND_PATH


#: vLLM's backends that a model may pick for itself, bypassing the platform (MiMo-V2-Flash does for
#: its qk != v layers): under hal's platform hal's backend stands behind their names.
MODEL_CHOSEN_BACKENDS = ("FLASH_ATTN_DIFFKV", "TRITON_ATTN_DIFFKV")


def serve_every_attention_layer() -> None:
    """Under hal's platform every attention layer is hal's: the backends a model names itself
    (``MODEL_CHOSEN_BACKENDS``) resolve to hal's, and a layer built with any other backend is an
    ``UnsupportedConfigError`` naming the layer and that backend, while vLLM builds the model."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name in MODEL_CHOSEN_BACKENDS:
        register_backend(AttentionBackendEnum[name], BACKEND_PATH)
    init = Attention.__init__
    if getattr(init, "serves_only_hal", False):
        return

    def hal_only(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        backend = self.attn_backend
        if not is_hals_backend(backend):
            from hal.errors import UnsupportedConfigError

            raise UnsupportedConfigError(
                f"{PLATFORM_ENV}=1: attention layer {getattr(self, 'layer_name', '?')} was built with vLLM's "
                f"{backend.get_name()} backend; under hal's platform hal serves every attention layer or the model is refused"
            )

    hal_only.serves_only_hal = True  # type: ignore[attr-defined]
    Attention.__init__ = hal_only


def refuse_a_substitute_for_hal() -> None:
    """Asked for ``attention_backend="HAL"``, vLLM's CPU platform silently picks its own backend
    unless hal's platform is active: wrap vLLM's backend selection so that such a substitution is an
    ``UnsupportedConfigError`` naming ``HAL_VLLM_PLATFORM=1`` (a platform that honours the choice, and
    every other choice, pass through unchanged)."""
    from vllm.v1.attention import selector

    chosen = selector._cached_get_attn_backend
    if getattr(chosen, "refuses_hal_substitutes", False):
        return

    def select(backend: Any, *args: Any, **kwargs: Any) -> Any:
        result = chosen(backend, *args, **kwargs)
        asked = getattr(backend, "name", backend)
        if asked == NAME and not is_hals_backend(result):
            from hal.errors import UnsupportedConfigError

            raise UnsupportedConfigError(
                f"attention_backend={NAME!r} was asked for, and vLLM's platform chose {result.__qualname__} instead: "
                f"set {PLATFORM_ENV}=1 (hal's platform) in the environment that starts vLLM"
            )
        return result

    select.refuses_hal_substitutes = True  # type: ignore[attr-defined]
    selector._cached_get_attn_backend = select


def activate_platform() -> str | None:
    """Platform plugin: hal's platform when ``HAL_VLLM_PLATFORM=1``, else None (vLLM's own)."""
    if os.environ.get(PLATFORM_ENV) != "1":
        return None
    return "hal.integrations.vllm.platform.HalPlatform"
