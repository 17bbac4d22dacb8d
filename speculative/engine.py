"""The engine half of hal's decoders: requests, the paged KV of the target, prefill, the generate
loop, and ``GreedyDecoder`` (plain greedy decoding, the speed baseline and the lossless oracle).

Engines are handed a backend (``hal.get_backend``) and get from it every KV pool,
attention kernel and graph; nothing here knows which device it runs on. ``hal.speculative.mtp``
builds the multi-layer EAGLE worker on ``TargetEngine``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Mapping, Sequence

import attrs
import torch

import hal
from hal.distributed import SINGLE, TPGroup
from hal.errors import SpecError
from hal.graph_runner import Forward
from hal.metadata import AttentionMetadata
from hal.plan import ForwardPlan
from hal.protocols import AttentionKernel, Backend
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, int_at_least, strict_ints
from hal.speculative.contract import EngineModel, ModelSpec


class KernelAttend:
    """The model's ``Attend`` for one forward: the kernel's plan for the forward's metadata, made
    once here and handed to every layer; each call casts q/k/v (and sinks) to the KV-cache dtype,
    calls the hal kernel, and casts the output back to the model's compute dtype."""

    def __init__(self, kernel: AttentionKernel, metadata: AttentionMetadata, plan: ForwardPlan | None = None) -> None:
        """``plan``: one made earlier, taken when it still serves ``metadata`` on this kernel's pool
        (made from that record, in the capture running now), else a new one is made."""
        self.kernel = kernel
        self.plan = plan if plan is not None and plan.serves(metadata, kernel.pool) else kernel.plan(metadata)
        self.dtype = kernel.pool.spec.dtype

    def __call__(
        self, layer: LayerSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        dt = self.dtype
        out = self.kernel.forward(
            q.to(dt), k.to(dt), v.to(dt), layer, self.plan, sinks=None if sinks is None else sinks.to(dt)
        )
        return out.to(q.dtype)


def require_backend(backend: object) -> Backend:
    """``backend`` when it is a ``hal.Backend``; engines take the object the edge resolved once
    (``hal.get_backend``), never a device string of their own to resolve."""
    if not isinstance(backend, Backend):
        hint = f": resolve it once at the edge, hal.get_backend({backend!r})" if isinstance(backend, str) else ""
        raise SpecError(f"backend must be a hal.Backend, got {type(backend).__name__} {backend!r}{hint}")
    return backend


def eos_ids(eos_token_id: int | Collection[int] | None) -> frozenset[int]:
    """The stop tokens ``generate`` was given, as a set; anything but ints is a ``SpecError``."""
    if eos_token_id is None:
        return frozenset()
    return frozenset(strict_ints([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id, "eos_token_id"))


@attrs.define
class Request:
    """One prompt's state in a generate call: its output, committed KV length and pending drafts."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = attrs.Factory(list)
    committed: int = 0  # positions whose target KV is valid (L)
    drafts: list[int] = attrs.Factory(list)
    finished: bool = False

    def emit(self, tokens: Sequence[int], eos_token_ids: frozenset[int]) -> None:
        for token in tokens:
            self.output.append(token)
            if token in eos_token_ids or len(self.output) >= self.max_new_tokens:
                self.finished = True
                return


@attrs.frozen
class GenerationResult:
    """Generated tokens per request (prompt excluded) and what it took."""

    tokens: tuple[tuple[int, ...], ...]
    seconds: float
    target_forwards: int  # prefill included
    accept_lengths: tuple[int, ...] = ()  # one per (request, verify), bonus included

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else float("nan")


class TargetEngine:
    """Backend, hybrid target KV pool, allocator and prefill shared by both decoders.

    ``backend``: the ``hal.Backend`` the caller resolved once (``hal.get_backend``). The model is
    moved to the backend's device in place. The KV pool holds ``max_batch_size`` requests of up to ``max_seq_len`` positions; graphs
    are captured for ``graph_batch_sizes`` (default 1, 2, 4, ... up to ``max_batch_size``).
    ``page_size`` defaults to the backend's ``default_page_size``, ``kv_dtype`` to the backend's
    ``kv_dtype_for`` the model's layers, preferring the model's compute dtype; every layer the engine
    runs is checked against the backend's kernel before anything is allocated, and one it cannot run
    is an ``UnsupportedConfigError`` naming it. ``tp`` (default: the model's ``tp``, else none) is the
    tensor-parallel group: graphs capture after a barrier on it, and every rank acts on rank 0's
    read-back of each step.
    """

    #: KV positions a request may need beyond its prompt and max_new_tokens (the unverified drafts).
    lookahead = 0
    #: The draft (MTP) layers this engine runs besides the target's (set before ``__init__``).
    draft_layers: tuple[LayerSpec, ...] = ()

    def __init__(
        self,
        model: EngineModel,
        backend: Backend,
        *,
        page_size: int | None = None,
        kv_dtype: torch.dtype | None = None,
        max_batch_size: int = 8,
        max_seq_len: int = 256,
        graph_batch_sizes: Sequence[int] | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        spec = model.spec
        if not isinstance(spec, ModelSpec):
            raise SpecError(f"the model's spec must be a hal.speculative.ModelSpec, got {type(spec).__name__}")
        # Ranks of a tensor-parallel model decide with rank 0's read-back, so they stay in lockstep.
        self.tp: TPGroup = getattr(model, "tp", SINGLE) if tp is None else tp
        if max_seq_len > spec.max_position:
            raise SpecError(f"max_seq_len={max_seq_len} exceeds the model's max_position={spec.max_position}")
        self.backend = require_backend(backend)
        self.device = self.backend.device
        page_size = self.backend.default_page_size if page_size is None else page_size
        layers = spec.target_layers + self.draft_layers
        bounds = {"max_q_len": max_seq_len, "batch_size": max_batch_size}
        if kv_dtype is None:  # the model's dtype where the kernel runs every layer in it, else the backend's choice
            kv_dtype = self.backend.kv_dtype_for(layers, page_size, prefer=spec.dtype, **bounds)
        else:
            self.backend.check_layers(layers, kv_dtype, page_size, **bounds)
        self.model = model.to(self.device).eval()
        self.spec = spec
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.pages_per_request = math.ceil(max_seq_len / page_size)
        size = max_batch_size * self.pages_per_request * page_size
        self.target_pool = self.backend.create_kv_pool(KVPoolSpec.for_layers(spec.target_layers, size, page_size, kv_dtype))
        self.target_attention = self.backend.create_attention(self.target_pool)
        self.allocator = hal.KVAllocator(self.target_pool)
        self.page_table = hal.RequestPageTable(self.allocator)
        sizes = graph_batch_sizes or [b for b in (1, 2, 4, 8, 16, 32) if b < max_batch_size] + [max_batch_size]
        self.graph_batch_sizes = sorted(set(sizes))

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def _graph_runner(
        self,
        forward: Forward,
        attention: AttentionKernel,
        mode: ForwardMode,
        tokens_per_request: int,
        inputs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    ) -> hal.GraphRunner:
        runner = hal.GraphRunner(
            self.backend,
            forward,
            attention=attention,
            mode=mode,
            tokens_per_request=tokens_per_request,
            batch_sizes=self.graph_batch_sizes,
            max_pages_per_request=self.pages_per_request,
            inputs=inputs,
            tp_group=self.tp.group,
        )
        with torch.no_grad():
            runner.capture()
        return runner

    def _target_tokens_and_hidden(
        self, inputs: Mapping[str, torch.Tensor], metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.target_hidden(
            inputs["input_ids"], metadata.positions, KernelAttend(self.target_attention, metadata)
        )
        return self.model.logits(hidden).argmax(-1), hidden

    def _metadata(self, mode: ForwardMode, requests: Sequence[Request], q_lens: Sequence[int]) -> AttentionMetadata:
        """Metadata for ``q_lens[b]`` new tokens of each request after its committed ones."""
        kv_lens = [r.committed + q for r, q in zip(requests, q_lens)]
        for r, kv in zip(requests, kv_lens):
            self.page_table.reserve(r.rid, kv)
        return hal.build_metadata(
            mode,
            kv_lens=kv_lens,
            q_lens=q_lens,
            page_table=self.page_table.table([r.rid for r in requests]),
            out_cache_loc=self.page_table.slot_list([(r.rid, r.committed, kv) for r, kv in zip(requests, kv_lens)]),
            pool=self.target_pool,
        )

    def _new_requests(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
    ) -> list[Request]:
        if not prompts:
            raise SpecError("generate: no prompts given")
        limits: list[object] = (
            list(max_new_tokens)
            if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes))
            else [max_new_tokens] * len(prompts)
        )
        if len(limits) != len(prompts):
            raise SpecError(f"generate: {len(limits)} max_new_tokens values for {len(prompts)} prompts")
        vocab = self.spec.vocab_size
        requests = []
        for i, (prompt, limit) in enumerate(zip(prompts, limits)):
            prompt = list(strict_ints(prompt, f"generate: prompt {i}"))
            if not prompt:
                raise SpecError(f"generate: prompt {i} is empty")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise SpecError(f"generate: prompt {i} has token ids {bad[:5]} outside [0, {vocab})")
            limit = int_at_least(limit, 1, f"generate: max_new_tokens for prompt {i}")
            need = len(prompt) + limit + self.lookahead
            if need > self.max_seq_len:
                raise SpecError(
                    f"generate: prompt {i} needs {need} KV positions (prompt {len(prompt)} + {limit} new + "
                    f"{self.lookahead} draft), above max_seq_len={self.max_seq_len}"
                )
            requests.append(Request(i, prompt, limit))
        return requests

    def keep_rows(self, rows: torch.Tensor, requests: Sequence[Request], kept: Sequence[Request]) -> torch.Tensor:
        """The first-dim rows of ``rows`` (one per request of ``requests``) that belong to ``kept``;
        the same tensor while no request left (no upload), an index upload when some did."""
        if len(kept) == len(requests):
            return rows
        position = {r.rid: i for i, r in enumerate(requests)}
        return rows[torch.tensor([position[r.rid] for r in kept], dtype=torch.int64, device=rows.device)]

    def _finish(self, request: Request) -> None:
        if request.rid in self.page_table:
            self.page_table.release(request.rid)

    def _prefill_target(self, requests: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor]:
        """EXTEND over every prompt (eager; ragged). Returns input ids, target hidden states, metadata,
        each request's last row and the target's next token there."""
        metadata = self._metadata(ForwardMode.EXTEND, requests, [len(r.prompt) for r in requests])
        ids = torch.tensor([t for r in requests for t in r.prompt], dtype=torch.int64, device=self.device)
        hidden = self.model.target_hidden(ids, metadata.positions, KernelAttend(self.target_attention, metadata))
        last_rows = metadata.cu_q_lens[1:].long() - 1
        next_tokens = self.model.logits(hidden[last_rows]).argmax(-1)
        return ids, hidden, metadata, last_rows, next_tokens

    def _run(self, requests: list[Request], eos_token_ids: frozenset[int]) -> tuple[int, list[int]]:
        raise NotImplementedError

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        eos_token_id: int | Collection[int] | None = None,
    ) -> GenerationResult:
        """Greedy-generate for a batch of prompts; a request stops at ``max_new_tokens`` or after an
        EOS token (``eos_token_id``: one id or several, as config.json may list them).

        ``seconds`` in the result covers the whole call, prefill included.
        """
        eos_token_ids = eos_ids(eos_token_id)
        requests = self._new_requests(prompts, max_new_tokens)
        if len(requests) > self.max_batch_size:
            raise SpecError(f"generate: batch of {len(requests)} exceeds max_batch_size={self.max_batch_size}")
        start = time.perf_counter()
        try:
            # Every page a request may need, taken at once: its pages are then consecutive in the
            # pool (the kernel reads them in place instead of gathering them).
            for r in requests:
                self.page_table.reserve(r.rid, len(r.prompt) + r.max_new_tokens + self.lookahead)
            with torch.no_grad():
                forwards, accept_lengths = self._run(requests, eos_token_ids)
            self.backend.synchronize()
        finally:
            for r in requests:
                self._finish(r)
        seconds = time.perf_counter() - start
        return GenerationResult(tuple(tuple(r.output) for r in requests), seconds, forwards, tuple(accept_lengths))


class GreedyDecoder(TargetEngine):
    """Plain greedy decoding with the target alone (``DECODE`` graphs): the baseline and the lossless oracle."""

    def __init__(self, model: EngineModel, backend: Backend, **kwargs: object) -> None:
        super().__init__(model, backend, **kwargs)  # type: ignore[arg-type]
        self.decode_runner = self._graph_runner(
            lambda inputs, md: self._target_tokens_and_hidden(inputs, md)[0],
            self.target_attention,
            ForwardMode.DECODE,
            1,
            {"input_ids": ((), torch.int64)},
        )

    def _run(self, requests: list[Request], eos_token_ids: frozenset[int]) -> tuple[int, list[int]]:
        _, _, _, _, next_tokens = self._prefill_target(requests)
        for r, token in zip(requests, self.tp.broadcast(next_tokens).tolist()):
            r.committed = len(r.prompt)
            r.emit([token], eos_token_ids)
        forwards = 1
        active = [r for r in requests if not r.finished]
        ids = self.keep_rows(next_tokens, requests, active)  # each request's last token, on the device
        while active:
            metadata = self._metadata(ForwardMode.DECODE, active, [1] * len(active))
            tokens = self.tp.broadcast(self.decode_runner.run({"input_ids": ids}, metadata).clone())
            forwards += 1
            for r, token in zip(active, tokens.tolist()):  # the step's one read-back
                r.committed += 1
                r.emit([token], eos_token_ids)
                if r.finished:
                    self._finish(r)
            still = [r for r in active if not r.finished]
            ids, active = self.keep_rows(tokens, active, still), still
        return forwards, []
