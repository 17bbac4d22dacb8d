"""The plan step: what one forward derives from its metadata, built once by the caller.

``AttentionKernel.plan(metadata)`` checks the metadata against the kernel's pool and returns a
``ForwardPlan``; the caller hands that plan to every layer's ``forward`` and drops it after the
forward. The metadata stays a plain record; what kernels and pools derive from it for a kind of
layer (index plans, translated slots) lives in the plan, derived the first time a layer of that
kind asks. A captured forward builds its plan inside the capture, so the capture records the ops
that derive it and each replay re-derives from the refreshed metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

from hal.errors import GraphError, SpecError
from hal.graph import capture_id
from hal.metadata import AddressedPool, AttentionMetadata, check_metadata_against

T = TypeVar("T")

# What a call signature keeps as it is (hashable, and the same object checks the same way).
_PLAIN_ARGUMENTS = (bool, int, str)

#: The most (signature, facts) pairs a kernel or pool remembers as passed (``ForwardPlan.check_once``);
#: past it the memory starts afresh (an engine's steps come in a few shapes; a stream of new ones
#: must not grow it without bound).
PASSED_CHECKS_LIMIT = 4096


class ForwardPlan:
    """One forward's metadata, checked against one pool, and what its layers derive from it."""

    __slots__ = ("metadata", "pool", "_capture", "_per_kind", "_checked", "_facts")

    def __init__(self, metadata: AttentionMetadata, pool: AddressedPool) -> None:
        if not isinstance(metadata, AttentionMetadata):
            raise SpecError(f"ForwardPlan: metadata must be a hal.AttentionMetadata, got {type(metadata).__name__}")
        check_metadata_against(metadata, pool)
        self.metadata = metadata
        self.pool = pool
        self._capture = capture_id()
        self._per_kind: dict[Hashable, Any] = {}
        self._checked: set[Hashable] = set()
        self._facts: tuple[Any, ...] | None = None

    def per_layer_kind(self, kind: Hashable, derive: Callable[..., T], *arguments: Any) -> T:
        """``derive(*arguments)`` the first time a layer of ``kind`` asks in this forward; later layers
        of that kind get the same value (layers of one kind share index plans and slots). The
        arguments are passed rather than closed over: a call that finds the value makes no closure."""
        try:
            return self._per_kind[kind]  # type: ignore[no-any-return]
        except KeyError:
            value = self._per_kind[kind] = derive(*arguments)
            return value

    def call_facts(self) -> tuple[Any, ...]:
        """What a call's checks read of this plan's metadata: its rows, requests and longest query,
        whether it carries an SWA block table and a tree, and its slots' dtype (the record's own
        checks tie the rest to these: one slot and one position per row)."""
        facts = self._facts
        if facts is None:
            md = self.metadata
            facts = self._facts = (md.num_tokens, md.batch_size, max(md.q_lens_cpu, default=0), md.swa_block_table is None,
                                   md.tree_mask is None, md.out_cache_loc.dtype)
        return facts

    def check_once(self, signature: Hashable | None, check: Callable[..., None], *arguments: Any,
                   passed: set[Hashable] | None = None) -> None:
        """Run ``check(*arguments)`` (which raises or passes by its arguments' types, shapes, dtypes
        and devices, see ``call_signature``, and this plan's ``call_facts``) the first time a call of
        ``signature`` comes in this forward; later calls of that signature would pass the same way.
        ``passed``: the caller's memory (a kernel's, a pool's) of the signatures that passed in earlier
        forwards with the facts they had; a call whose signature passed with these facts passes
        without running the check. A ``signature`` of None is checked every time."""
        if signature is None:
            check(*arguments)
            return
        if signature in self._checked:
            return
        if passed is None:
            check(*arguments)
        else:
            remembered = (signature, self.call_facts())
            if remembered not in passed:
                check(*arguments)
                if len(passed) >= PASSED_CHECKS_LIMIT:
                    passed.clear()
                passed.add(remembered)
        self._checked.add(signature)

    def serves(self, metadata: AttentionMetadata, pool: AddressedPool) -> bool:
        """Whether this is the plan for ``metadata`` on ``pool`` now: made from that record for that
        pool, in the graph capture running now (or outside any, as now)."""
        return metadata is self.metadata and pool is self.pool and self._capture == capture_id()

    def usable_by(self, pool: AddressedPool) -> bool:
        """Whether this plan was made for ``pool`` in the capture running now (or outside any)."""
        return pool is self.pool and self._capture == capture_id()

    def check_usable(self, pool: AddressedPool, where: str) -> None:
        """Raise unless this plan was made for ``pool`` in the capture running now (or outside any):
        a plan derived before a capture would be kept by the graph as constants, stale on replay."""
        if pool is not self.pool:
            raise SpecError(f"{where}: the plan was made for another KV pool; plan with this kernel (kernel.plan(metadata))")
        if self._capture != capture_id():
            raise GraphError(
                f"{where}: the plan was made outside the graph capture running now; build the plan inside the "
                "captured forward, so the capture records what it derives"
            )


def call_signature(*arguments: Any) -> tuple[Any, ...] | None:
    """What a call's checks read of its arguments: each tensor's shape, dtype and device, and any
    other argument as it is (a bool, an int, a str, None); None when a
    tensor-like argument is not exactly a ``torch.Tensor`` (a subclass or another type is checked
    at every call)."""
    signature: list[Any] = []
    for argument in arguments:
        if type(argument) is torch.Tensor:
            signature.append((argument.shape, argument.dtype, argument.device))
        elif argument is None or type(argument) in _PLAIN_ARGUMENTS:
            signature.append(argument)
        else:
            return None
    return tuple(signature)
