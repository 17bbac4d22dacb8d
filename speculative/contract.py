"""What hal's engines know of a model (``ModelSpec``) and need of it (``EngineModel``), and the
``Attend`` callable through which every attention layer of a model runs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import attrs
import torch

from hal.errors import SpecError
from hal.spec import LayerSpec, float_dtype, positive_field

# attend(layer, q [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv], sinks [Hq] | None) -> [T, Hq, Dv]
Attend = Callable[[LayerSpec, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _layer_tuple(layers: Iterable[LayerSpec]) -> tuple[LayerSpec, ...]:
    return tuple(layers)


def _layer_ids_in_order(instance: ModelSpec, attribute: attrs.Attribute, layers: tuple[LayerSpec, ...]) -> None:
    ids = [layer.layer_id if isinstance(layer, LayerSpec) else layer for layer in layers]
    if ids != list(range(len(layers))):
        raise SpecError(f"ModelSpec.{attribute.name} must be LayerSpecs with layer ids 0..{len(layers) - 1} in order, got {ids}")


@attrs.frozen
class ModelSpec:
    """What hal's engines know of a model: its vocabulary, hidden size and longest position, and
    every attention layer as a ``LayerSpec``: the target's (``target_layers[i]`` is layer ``i``,
    its ``sliding_window`` saying whether it is a sliding-window layer) and the draft (MTP) blocks'
    (``draft_layers[k]``: block ``k``, layer ``k`` of the draft pool). The engines build their KV
    pools from these (``KVPoolSpec.for_layers``) and assume nothing else about a layer's shape.

    ``dtype`` is the compute dtype: what the model's hidden states and logits are in. The engines
    type every static buffer they feed the model from it (the MTP blocks' hidden-state input among
    them) and prefer it for the KV cache where the backend's kernel takes it."""

    vocab_size: int = attrs.field(validator=positive_field)
    hidden_size: int = attrs.field(validator=positive_field)
    max_position: int = attrs.field(validator=positive_field)
    target_layers: tuple[LayerSpec, ...] = attrs.field(converter=_layer_tuple, validator=_layer_ids_in_order)
    draft_layers: tuple[LayerSpec, ...] = attrs.field(default=(), converter=_layer_tuple, validator=_layer_ids_in_order)
    dtype: torch.dtype = attrs.field(default=torch.float32, validator=float_dtype, kw_only=True)

    @property
    def num_draft_layers(self) -> int:
        return len(self.draft_layers)


class EngineModel(Protocol):
    """What hal's engines need of a model (``TinyMiMo`` and ``MiMoV2Flash`` provide it): its
    ``ModelSpec``, the target's last hidden states, MTP layer ``step``'s hidden states, and logits.
    Each layer calls ``attend`` with the ``LayerSpec`` its ``spec`` lists for it."""

    @property
    def spec(self) -> ModelSpec: ...

    def target_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor: ...

    def mtp_hidden(
        self, step: int, input_ids: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def to(self, device: torch.device) -> Any: ...
