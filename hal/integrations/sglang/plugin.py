"""SGLang's entry points into hal (``pyproject.toml``: groups ``sglang.srt.plugins`` and
``sglang.srt.platforms``). SGLang calls them in each of its processes."""

from __future__ import annotations

import os
from typing import Any

#: The name SGLang knows hal by: ``--attention-backend hal`` and ``SGLANG_PLATFORM=hal``.
NAME = "hal"
#: Speculative algorithms hal serves: the EAGLE family (chains with ``speculative_eagle_topk=1``,
#: trees above it) and NGRAM (trees from its n-gram store).
SPECULATIVE_ALGORITHMS = frozenset({"EAGLE", "NEXTN", "STANDALONE", "NGRAM"})
#: Those whose verify batches are trees whatever ``speculative_eagle_topk`` says.
TREE_ALGORITHMS = frozenset({"NGRAM"})


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
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RESOLVED_SERVER_ARGS, check_resolved_server_args, HookType.AFTER)


#: Where SGLang resolves its server arguments, in the process that builds the engine, before any
#: scheduler starts: hal refuses there what it cannot serve, so the refusal is an exception from
#: ``sglang.Engine(...)`` instead of a scheduler that dies and takes the caller down later.
RESOLVED_SERVER_ARGS = "sglang.srt.server_args.ServerArgs.resolve_once"


def check_resolved_server_args(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """After SGLang resolved ``server_args``: a speculative configuration that asks for hal's attention
    backend is checked as the first model runner would check it (``create_attention_backend``)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    resolved = resolving_view(server_args)
    backends = {getattr(resolved, name, None) for name in ("attention_backend", "speculative_draft_attention_backend")}
    algorithm = getattr(resolved, "speculative_algorithm", None)
    if NAME not in backends or not algorithm or str(algorithm).upper() == "NONE":
        return None
    require_platform(algorithm)
    from hal.integrations.edge import edge_backend as resolve

    # The edge's backend: what hal's platform serves with in every SGLang process (this one may have
    # resolved SGLang's platform before SGLANG_PLATFORM was set; the schedulers it starts will not).
    backend = resolve("sglang", engine_device=getattr(resolved, "device", None))
    check_speculative_configuration(algorithm, getattr(resolved, "speculative_eagle_topk", None), backend,
                                    multi_layer=bool(getattr(resolved, "enable_multi_layer_eagle", False)))
    return None


def create_attention_backend(model_runner: Any) -> Any:
    """SGLang's factory signature: the backend for one model runner. Speculative decoding through
    hal needs hal's platform (it supplies the draft backend and runner): asked for it without
    ``SGLANG_PLATFORM=hal``, the first runner refuses at start-up, naming the variable."""
    from hal.integrations.sglang.attention import HalAttnBackend

    algorithm = getattr(model_runner, "spec_algorithm", None)
    speculative = algorithm is not None and not algorithm.is_none()
    if algorithm is not None and speculative:
        require_platform(algorithm.name)
    backend = edge_backend(model_runner.device)
    if algorithm is not None and speculative:
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()  # the resolved configuration (a model's overrides, MiMo's multi-layer EAGLE, included)
        check_speculative_configuration(algorithm.name, spec.speculative_eagle_topk, backend,
                                        multi_layer=bool(spec.enable_multi_layer_eagle))
    return HalAttnBackend(model_runner, backend)


def require_platform(algorithm: Any) -> None:
    """Speculative decoding through hal needs hal's platform (it supplies the draft backend and
    runner): ``UnsupportedConfigError`` naming the variable without ``SGLANG_PLATFORM=hal``."""
    from hal.errors import UnsupportedConfigError

    if os.environ.get("SGLANG_PLATFORM") != NAME:
        raise UnsupportedConfigError(
            f"attention backend {NAME!r} serves speculative decoding ({algorithm}) through hal's platform: "
            f"set SGLANG_PLATFORM={NAME} in the environment that starts SGLang"
        )


def check_speculative_configuration(algorithm: str, topk: Any, backend: Any, *, multi_layer: bool = False) -> None:
    """Refuse at start-up a speculative configuration hal cannot serve on ``backend``: an algorithm
    outside ``SPECULATIVE_ALGORITHMS``; tree verify batches (NGRAM, ``speculative_eagle_topk``
    above 1) where the backend's kernel verifies chains only (``serves_trees``), which would
    otherwise be refused batch by batch after the server had started; and ``topk`` above 1 on
    SGLang's multi-layer EAGLE worker (``multi_layer``, MiMo-V2-Flash's MTP), which verifies
    chains only: it keeps the accepted rows' KV where the chain would have put them instead of
    compacting the accepted tree path, so its tokens differ from plain decoding whatever the
    attention backend computes."""
    from hal.errors import UnsupportedConfigError

    name = str(algorithm).upper()
    if name not in SPECULATIVE_ALGORITHMS:
        raise UnsupportedConfigError(
            f"attention backend {NAME!r}: speculative algorithm {algorithm} is not served; hal serves "
            f"{', '.join(sorted(SPECULATIVE_ALGORITHMS))}"
        )
    trees = name in TREE_ALGORITHMS or (topk is not None and topk != 1)
    if multi_layer and topk is not None and topk != 1:
        raise UnsupportedConfigError(
            f"attention backend {NAME!r}: speculative_eagle_topk={topk} on SGLang's multi-layer EAGLE worker, which "
            "verifies chains only (it does not compact an accepted tree path, and its tokens would differ from plain "
            "decoding); use speculative_eagle_topk=1"
        )
    if trees and not getattr(getattr(backend, "attention_class", None), "serves_trees", False):
        why = f"speculative algorithm {algorithm}" if name in TREE_ALGORITHMS else f"speculative_eagle_topk={topk}"
        raise UnsupportedConfigError(
            f"attention backend {NAME!r}: {why} makes tree verify batches, and the {getattr(backend, 'name', backend)} "
            "backend's kernel verifies chains only (speculative_eagle_topk=1)"
        )


def edge_backend(device: Any) -> Any:
    """The ``hal.Backend`` SGLang's runners are served with: hal's platform's under
    ``SGLANG_PLATFORM=hal``, else the edge's for SGLang (``hal.integrations.edge``; the runner's
    device string when ``HAL_SGLANG_DEVICE`` names none). Both are resolved once per process."""
    import hal
    from hal.integrations.edge import edge_backend as resolve

    if os.environ.get("SGLANG_PLATFORM") == NAME:
        from sglang.srt.platforms import current_platform

        backend = getattr(current_platform, "hal_backend", None)
        if not isinstance(backend, hal.Backend):
            raise hal.UnsupportedConfigError(
                f"SGLANG_PLATFORM={NAME} but SGLang's platform is {type(current_platform).__name__}, which holds no hal backend"
            )
        return backend
    return resolve("sglang", engine_device=str(device))


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
