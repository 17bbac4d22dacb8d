"""SGLang's entry points into hal (``pyproject.toml``: groups ``sglang.srt.plugins`` and
``sglang.srt.platforms``). SGLang calls them in each of its processes."""

from __future__ import annotations

import os
from typing import Any

#: The name SGLang knows hal by: ``--attention-backend hal`` and ``SGLANG_PLATFORM=hal``.
NAME = "hal"
#: Speculative algorithms whose verify batches are chains (with ``speculative_eagle_topk=1``).
CHAIN_ALGORITHMS = frozenset({"EAGLE", "NEXTN", "STANDALONE"})


def register() -> None:
    """General plugin: add the attention backend ``hal`` to SGLang's registry and choices.

    Registering changes nothing for a server that does not ask for ``--attention-backend hal``.
    SGLang's registry is imported here, not at module import: it imports the plugin loader.
    """
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    register_attention_backend(NAME)(create_attention_backend)


def create_attention_backend(model_runner: Any) -> Any:
    """SGLang's factory signature: the backend for one model runner. Speculative decoding through
    hal needs hal's platform (it supplies the draft backend and runner): asked for it without
    ``SGLANG_PLATFORM=hal``, the first runner refuses at start-up, naming the variable."""
    from hal.errors import UnsupportedConfigError
    from hal.integrations.sglang.attention import HalAttnBackend

    algorithm = getattr(model_runner, "spec_algorithm", None)
    if algorithm is not None and not algorithm.is_none():
        check_chain_configuration(algorithm.name, getattr(getattr(model_runner, "server_args", None), "speculative_eagle_topk", None))
    if algorithm is not None and not algorithm.is_none() and os.environ.get("SGLANG_PLATFORM") != NAME:
        raise UnsupportedConfigError(
            f"attention backend {NAME!r} serves speculative decoding ({algorithm.name}) through hal's platform: "
            f"set SGLANG_PLATFORM={NAME} in the environment that starts SGLang"
        )
    return HalAttnBackend(model_runner, edge_backend(model_runner.device))


def check_chain_configuration(algorithm: str, topk: Any) -> None:
    """Refuse at start-up a speculative configuration whose verify batches are trees (an algorithm
    outside ``CHAIN_ALGORITHMS``, such as NGRAM, or ``speculative_eagle_topk`` above 1): hal
    verifies chains, and each such batch would be refused (``check_chain_verify``) after the
    server had started."""
    from hal.errors import UnsupportedConfigError

    if str(algorithm).upper() not in CHAIN_ALGORITHMS:
        raise UnsupportedConfigError(
            f"attention backend {NAME!r}: speculative algorithm {algorithm} verifies trees; hal verifies chains "
            f"({', '.join(sorted(CHAIN_ALGORITHMS))} with speculative_eagle_topk=1)"
        )
    if topk is not None and topk != 1:
        raise UnsupportedConfigError(
            f"attention backend {NAME!r}: speculative_eagle_topk={topk} makes tree verify batches; hal verifies "
            "chains (speculative_eagle_topk=1)"
        )


def edge_backend(device: Any) -> Any:
    """The ``hal.Backend`` SGLang's runners are served with, resolved here once per runner and
    handed inward: hal's platform's (resolved when SGLang activated it) under ``SGLANG_PLATFORM=hal``,
    else hal's backend for the runner's device string (hal parses it: torch may not know "npu")."""
    import hal

    if os.environ.get("SGLANG_PLATFORM") == NAME:
        from sglang.srt.platforms import current_platform

        backend = getattr(current_platform, "hal_backend", None)
        if not isinstance(backend, hal.Backend):
            raise hal.UnsupportedConfigError(
                f"SGLANG_PLATFORM={NAME} but SGLang's platform is {type(current_platform).__name__}, which holds no hal backend"
            )
        return backend

    return hal.get_backend(str(device))


def activate_platform() -> str | None:
    """Platform plugin: hal's platform class when ``SGLANG_PLATFORM=hal``, else None.

    With ``SGLANG_PLATFORM`` unset SGLang activates every installed platform plugin and uses the
    one that answers; answering only when asked by name keeps an installed hal from taking over.
    """
    if os.environ.get("SGLANG_PLATFORM") != NAME:
        return None
    return "hal.integrations.sglang.platform.HalPlatform"


_bound: dict[tuple[type, int], type] = {}


def bound_to(cls: type, backend: Any) -> type:
    """``cls`` with ``hal_backend = backend``: what a hook returns where SGLang constructs the class
    itself with its own arguments (a KV pool, a graph backend), so the backend reaches it."""
    key = (cls, id(backend))
    if key not in _bound:
        _bound[key] = type(cls.__name__, (cls,), {"hal_backend": backend, "__module__": cls.__module__,
                                                  "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return _bound[key]
