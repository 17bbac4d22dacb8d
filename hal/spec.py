"""Data contracts: forward modes, layer and KV pool specs.

Sliding-window convention (the one place it is defined): a layer with
``sliding_window=W`` lets the query at absolute position ``i`` see keys ``j``
with ``i - W <= j <= i``, i.e. itself and the ``W`` previous tokens (``W + 1``
keys). This is FlashAttention's ``window_size=(W, 0)`` and FIA's
``pre_tokens=W, next_tokens=0``. A model whose config says "window of 128
tokens including itself" passes ``W = 127``.
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from hal.errors import HalError, KVLayoutError, SpecError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ForwardMode(enum.IntEnum):
    """What a forward pass computes; every attention kernel handles all of them."""

    EXTEND = enum.auto()  # prefill, possibly on top of a cached prefix
    DECODE = enum.auto()  # one new token per request
    TARGET_VERIFY = enum.auto()  # target model over the S + 1 verify tokens per request
    DRAFT_EXTEND_V2 = enum.auto()  # draft layer over the same S + 1 rows, fixed shape
    IDLE = enum.auto()  # no requests on this rank

    def is_extend(self, include_draft_extend_v2: bool = False) -> bool:
        """Multi-token causal forwards; TARGET_VERIFY counts, DRAFT_EXTEND_V2 only if asked."""
        if self is ForwardMode.DRAFT_EXTEND_V2:
            return include_draft_extend_v2
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        """One new token per request."""
        return self is ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        """The target model over the ``S + 1`` verify tokens per request."""
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend_v2(self) -> bool:
        """A draft layer over the same ``S + 1`` rows per request as the verify, fixed shape."""
        return self is ForwardMode.DRAFT_EXTEND_V2

    def is_idle(self) -> bool:
        """No requests on this rank this step."""
        return self is ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        """DECODE or IDLE."""
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def has_uniform_query_len(self) -> bool:
        """Modes whose requests all carry the same number of query tokens (graph-capturable shapes)."""
        return self in (
            ForwardMode.DECODE,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.DRAFT_EXTEND_V2,
            ForwardMode.IDLE,
        )


def positive_field(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: the field is an int >= 1 (``int_at_least``)."""
    int_at_least(value, 1, f"{type(instance).__name__}.{attribute.name}")


def strict_int(value: Any, what: str) -> int:
    """``value`` as an int: Python and numpy integers and one-element integer tensors pass;
    floats (even integral ones), bools, strings and None raise ``SpecError`` naming ``what``."""
    if type(value) is int:  # the common case, first: checked on every layer call
        return value
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise SpecError(f"{what} must be an int, got the bool {value!r}")
    if isinstance(value, torch.Tensor) and (value.dtype.is_floating_point or value.dtype.is_complex):
        raise SpecError(f"{what} must be an int, got a {value.dtype} tensor {value.tolist()!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise SpecError(f"{what} must be an int, got {value!r} ({type(value).__name__})") from None


def int_at_least(
    value: Any, minimum: int, what: str, error: type[HalError] = SpecError, *, maximum: int | None = None
) -> int:
    """``value`` as an int (``strict_int``'s rules: no bool, no float) that is at least ``minimum``
    (and at most ``maximum`` when given); else ``error`` naming ``what``, the bounds and the value."""
    if type(value) is int and value >= minimum and (maximum is None or value <= maximum):
        return value  # the common case, without the exception frame below
    try:
        number = strict_int(value, what)
    except SpecError:
        number = None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise error(f"{what} must be an int {bounds}, got {value!r}")
    return number


# The common integer dtypes, named so the check of an engine's index tensor is one lookup.
_INTEGER_DTYPES = frozenset({torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8})


def check_readable(tensor: torch.Tensor, what: str) -> None:
    """Refuse by name a tensor that holds no values to read (on the meta device), before an op
    that reads them fails inside."""
    if tensor.is_meta:
        raise SpecError(f"{what} is a tensor on the meta device (shape {tuple(tensor.shape)}): it holds no values to read")


def check_integer_tensor(tensor: torch.Tensor, what: str) -> None:
    """Refuse by name a tensor whose dtype holds no integers (bool, floating, complex)."""
    if tensor.dtype not in _INTEGER_DTYPES and (tensor.dtype == torch.bool or tensor.dtype.is_floating_point
                                                or tensor.dtype.is_complex):
        raise SpecError(f"{what} must hold integers, got a {tensor.dtype} tensor")


#: Up to this many elements, a host integer tensor's values are read into a Python list at once and
#: checked there (``int_bounds``, ``build_metadata``'s slots and page ids): a step's few entries cost
#: one read, where torch ops cost several microseconds each (and many more inside an engine, whose
#: own work leaves them out of cache).
READ_AS_LIST_LIMIT = 256


def int_bounds(tensor: torch.Tensor) -> tuple[int, int]:
    """The least and greatest value of a non-empty host integer tensor."""
    if tensor.dim() == 0:
        return int(tensor), int(tensor)
    if tensor.numel() <= READ_AS_LIST_LIMIT:
        values = tensor.tolist()
        for _ in range(tensor.dim() - 1):  # nested rows, flattened (a reshape would copy a strided view)
            values = list(itertools.chain.from_iterable(values))
        return min(values), max(values)
    lo, hi = torch.aminmax(tensor)
    return int(lo), int(hi)


def host_copy(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """A host copy of ``tensor``, whose values are read (``check_readable`` first)."""
    check_readable(tensor, what)
    return tensor.detach().to("cpu", copy=True)


def strict_ints(values: Any, what: str) -> tuple[int, ...]:
    """``values`` (a sequence, or an integer tensor) as a tuple of ints; see ``strict_int``."""
    if isinstance(values, torch.Tensor):
        check_integer_tensor(values, what)
        return tuple(int(v) for v in host_copy(values, what).reshape(-1).tolist())
    if isinstance(values, (list, tuple)) and all(type(v) is int for v in values):
        return tuple(values)  # the common case, checked at a glance (bools are not of type int)
    if isinstance(values, range):
        return tuple(values)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise SpecError(f"{what} must be a sequence of ints, got {values!r} ({type(values).__name__})")
    return tuple(strict_int(v, f"{what}[{i}]") for i, v in enumerate(values))


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return strict_ints(value, "SWAPoolSpec.layer_ids")


def float_dtype(instance: Any, attribute: attrs.Attribute, value: torch.dtype) -> None:
    """attrs validator: ``value`` is one of ``FLOAT_DTYPES``."""
    if value not in FLOAT_DTYPES:
        raise SpecError(
            f"{type(instance).__name__}.{attribute.name} must be one of "
            f"{[str(d) for d in FLOAT_DTYPES]}, got {value!r}"
        )


@attrs.frozen(cache_hash=True)  # a key of each forward's per-layer caches (ForwardPlan)
class LayerSpec:
    """One attention layer as the kernel sees it."""

    layer_id: int = attrs.field()
    num_q_heads: int = attrs.field(validator=positive_field)
    num_kv_heads: int = attrs.field(validator=positive_field)
    head_dim: int = attrs.field(validator=positive_field)  # q/k head dim
    v_head_dim: int = attrs.field(validator=positive_field)
    scaling: float = attrs.field()  # softmax scale applied to q.k
    sliding_window: int | None = attrs.field(default=None)  # W: see the module docstring
    has_sinks: bool = attrs.field(default=False)  # per-head learnable sink logit

    @layer_id.validator
    def _check_layer_id(self, attribute: attrs.Attribute, value: int) -> None:
        int_at_least(value, 0, "LayerSpec.layer_id")

    @num_kv_heads.validator
    def _check_gqa(self, attribute: attrs.Attribute, value: int) -> None:
        if self.num_q_heads % value:
            raise SpecError(
                f"LayerSpec.num_q_heads={self.num_q_heads} must be a multiple of "
                f"num_kv_heads={value} (GQA)"
            )

    @scaling.validator
    def _check_scaling(self, attribute: attrs.Attribute, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
            raise SpecError(f"LayerSpec.scaling must be a positive, finite float, got {value!r}")

    @sliding_window.validator
    def _check_window(self, attribute: attrs.Attribute, value: int | None) -> None:
        if value is not None:
            int_at_least(value, 0, "LayerSpec.sliding_window (None: no window)")

    @property
    def is_swa(self) -> bool:
        """Whether the layer attends over a sliding window."""
        return self.sliding_window is not None

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.num_q_heads // self.num_kv_heads


@attrs.frozen
class SWAPoolSpec:
    """The sliding-window part of a hybrid pool: its own (smaller) size and head config."""

    layer_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    size: int = attrs.field(validator=positive_field)  # tokens
    kv_heads: int = attrs.field(validator=positive_field)
    head_dim: int = attrs.field(validator=positive_field)
    v_head_dim: int = attrs.field(validator=positive_field)

    @layer_ids.validator
    def _check_ids(self, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
        if not value:
            raise SpecError("SWAPoolSpec.layer_ids must name at least one layer")
        if len(set(value)) != len(value) or any(not isinstance(i, int) or i < 0 for i in value):
            raise SpecError(f"SWAPoolSpec.layer_ids must be distinct ints >= 0, got {value!r}")


@attrs.frozen
class KVPoolSpec:
    """A paged, split-K/V pool. ``size`` counts tokens (excluding the padding page)."""

    num_layers: int = attrs.field(validator=positive_field)
    size: int = attrs.field(validator=positive_field)
    page_size: int = attrs.field(validator=positive_field)
    kv_heads: int = attrs.field(validator=positive_field)
    head_dim: int = attrs.field(validator=positive_field)
    v_head_dim: int = attrs.field(validator=positive_field)
    dtype: torch.dtype = attrs.field(default=torch.float32, validator=float_dtype)
    swa: SWAPoolSpec | None = attrs.field(default=None)

    @size.validator
    def _check_size(self, attribute: attrs.Attribute, value: int) -> None:
        positive_field(self, attrs.fields(KVPoolSpec).page_size, self.page_size)  # validated after size otherwise
        if value % self.page_size:
            raise SpecError(
                f"KVPoolSpec.size={value} must be a multiple of page_size={self.page_size}"
            )

    @swa.validator
    def _check_swa(self, attribute: attrs.Attribute, value: SWAPoolSpec | None) -> None:
        if value is None:
            return
        bad = [i for i in value.layer_ids if i >= self.num_layers]
        if bad:
            raise SpecError(
                f"KVPoolSpec.swa.layer_ids {bad} out of range for num_layers={self.num_layers}"
            )
        if value.size % self.page_size:
            raise SpecError(
                f"KVPoolSpec.swa.size={value.size} must be a multiple of page_size={self.page_size}"
            )

    @classmethod
    def for_layers(
        cls,
        layers: Sequence[LayerSpec],
        size: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        *,
        swa_size: int | None = None,
    ) -> KVPoolSpec:
        """The pool that stores ``layers`` (layer ids ``0 .. n-1``, each once): with both full and
        sliding-window layers, a hybrid pool whose SWA sub-pool (``swa_size`` tokens, default
        ``size``) holds the sliding-window ones; with one kind only, one pool. Layers stored
        together must agree on kv heads and head dims, or the ``SpecError`` names them."""
        ids = sorted(layer.layer_id for layer in layers)
        if ids != list(range(len(layers))):
            raise SpecError(f"KVPoolSpec.for_layers: layer ids must be 0..{len(layers) - 1}, each once, got {ids}")
        full = [layer for layer in layers if not layer.is_swa]
        swa = [layer for layer in layers if layer.is_swa]
        if not full or not swa:
            heads, dk, dv = _shared_geometry(layers, "full-attention layers" if full else "sliding-window layers")
            return cls(len(layers), size, page_size, heads, dk, dv, dtype)
        heads, dk, dv = _shared_geometry(full, "full-attention layers")
        swa_heads, swa_dk, swa_dv = _shared_geometry(swa, "sliding-window layers")
        swa_spec = SWAPoolSpec(tuple(layer.layer_id for layer in swa), size if swa_size is None else swa_size, swa_heads, swa_dk, swa_dv)
        return cls(len(layers), size, page_size, heads, dk, dv, dtype, swa_spec)

    @property
    def num_pages(self) -> int:
        """Full-pool pages, page 0 (padding) not counted."""
        return self.size // self.page_size

    @property
    def swa_num_pages(self) -> int:
        """SWA sub-pool pages (0 without one), page 0 not counted."""
        return 0 if self.swa is None else self.swa.size // self.page_size

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether the layer is stored in the SWA sub-pool."""
        return self.swa is not None and layer_id in self.swa.layer_ids

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """Layers stored in the full pool, ascending."""
        return tuple(i for i in range(self.num_layers) if not self.is_swa_layer(i))

    def layer_dims(self, layer_id: int) -> tuple[int, int, int]:
        """(kv_heads, head_dim, v_head_dim) of one layer."""
        int_at_least(layer_id, 0, "layer", KVLayoutError, maximum=self.num_layers - 1)
        if self.is_swa_layer(layer_id):
            assert self.swa is not None
            return self.swa.kv_heads, self.swa.head_dim, self.swa.v_head_dim
        return self.kv_heads, self.head_dim, self.v_head_dim

    def buffer_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """The (K, V) buffer shape of each sub-pool (``"full"``, ``"swa"``): ``[layers, pages + 1,
        page_size, kv_heads, dim]``, page 0 the padding page."""
        shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        full = self.full_layer_ids
        if full:
            rows = (len(full), self.num_pages + 1, self.page_size, self.kv_heads)
            shapes["full"] = ((*rows, self.head_dim), (*rows, self.v_head_dim))
        if self.swa is not None:
            s = self.swa
            rows = (len(s.layer_ids), self.swa_num_pages + 1, self.page_size, s.kv_heads)
            shapes["swa"] = ((*rows, s.head_dim), (*rows, s.v_head_dim))
        return shapes

    def pool_bytes(self) -> int:
        """Bytes the pool's buffers take, padding pages included."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(shape) * elem for pair in self.buffer_shapes().values() for shape in pair)

    def bytes_per_token(self) -> int:
        """K + V bytes one token occupies, summed over every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for layer_id in range(self.num_layers):
            heads, dk, dv = self.layer_dims(layer_id)
            total += heads * (dk + dv) * elem
        return total


def _shared_geometry(layers: Sequence[LayerSpec], what: str) -> tuple[int, int, int]:
    """The ``(kv_heads, head_dim, v_head_dim)`` every layer of ``layers`` shares (one sub-pool's)."""
    shapes = {(layer.num_kv_heads, layer.head_dim, layer.v_head_dim): layer.layer_id for layer in layers}
    if len(shapes) > 1:
        named = ", ".join(f"layer {i}: {shape}" for shape, i in shapes.items())
        raise SpecError(f"KVPoolSpec.for_layers: {what} share one sub-pool and must agree on (kv_heads, head_dim, v_head_dim); {named}")
    return next(iter(shapes))
