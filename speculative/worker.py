"""Multi-layer EAGLE (MTP) speculative decoding and its plain greedy baseline, device-neutral.

Both engines get their backend from ``hal.get_backend(device, emulate=...)`` and from it every
KV pool, attention kernel and graph; nothing below knows which device it runs on.

Speculative iteration (SGLang spec v2, chain drafts, see reference/mtp_algorithm.md §1.3):
request ``b`` has ``L`` committed KV positions, its bonus token (the target's last prediction,
not yet in the cache) and drafts ``d1..dS`` from the previous iteration.

1. One ``TARGET_VERIFY`` target forward over ``[bonus, d1..dS]`` at positions ``L .. L + S``.
2. Greedy chain acceptance: accept length ``a`` in ``1 .. S + 1``; the iteration emits the target's
   tokens at rows ``0 .. a - 1`` and commits ``L += a``.
3. ``S`` ``DRAFT_EXTEND_V2`` passes, MTP block ``k`` over the same ``S + 1`` rows with the target's
   verify hidden states; the input ids start as the target's tokens and are rotated after every
   step, and block ``k``'s token at row ``a - 1`` is the next iteration's ``d_{k+1}``.

KV slots for ``L .. L + S`` are reserved ahead from the paged allocator; slots of rejected
positions are simply overwritten by the next iteration, and a request's pages are freed when it
finishes. The MTP blocks keep their KV in a pool of their own addressed by the target's slots.
As in SGLang's fixed-window draft extend, MTP block ``k``'s KV at the ``k`` positions before the
committed length was computed from draft tokens and is not rewritten if those drafts are later
rejected; that costs draft quality only, never correctness, since the target verifies.
"""

from __future__ import annotations

import math
import time
import functools
from collections.abc import Mapping, Sequence

import attrs
import torch

import hal
from hal.errors import SpecError
from hal.graph_runner import Forward
from hal.metadata import AttentionMetadata
from hal.protocols import AttentionKernel
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec
from speculative.chain import greedy_accept, rotate_input_ids
from speculative.model import TinyMiMo


class KernelAttend:
    """The model's ``Attend`` for one forward: casts q/k/v (and sinks) to the KV-cache dtype,
    calls the hal kernel, and casts the output back to the model's compute dtype."""

    def __init__(self, kernel: AttentionKernel, metadata: AttentionMetadata) -> None:
        self.kernel = kernel
        self.metadata = metadata
        self.dtype = kernel.pool.spec.dtype

    def __call__(
        self, layer: LayerSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        dt = self.dtype
        out = self.kernel.forward(
            q.to(dt), k.to(dt), v.to(dt), layer, self.metadata, sinks=None if sinks is None else sinks.to(dt)
        )
        return out.to(q.dtype)


@attrs.define
class _Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = attrs.Factory(list)
    committed: int = 0  # positions whose target KV is valid (L)
    drafts: list[int] = attrs.Factory(list)
    finished: bool = False

    def emit(self, tokens: Sequence[int], eos_token_id: int | None) -> None:
        for token in tokens:
            self.output.append(token)
            if token == eos_token_id or len(self.output) >= self.max_new_tokens:
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


class _TargetEngine:
    """Backend, hybrid target KV pool, allocator and prefill shared by both decoders.

    The model is moved to the backend's device in place. The KV pool holds ``max_batch_size``
    requests of up to ``max_seq_len`` positions; graphs are captured for ``graph_batch_sizes``
    (default 1, 2, 4, ... up to ``max_batch_size``). ``page_size`` and ``kv_dtype`` must suit the
    backend's kernel (e.g. FIA v2 with head dim 192 wants bf16/fp16 and pages of 128).
    """

    #: KV positions a request may need beyond its prompt and max_new_tokens (the unverified drafts).
    lookahead = 0

    def __init__(
        self,
        model: TinyMiMo,
        device: str = "cpu",
        *,
        emulate: bool = False,
        page_size: int = 16,
        kv_dtype: torch.dtype = torch.float32,
        max_batch_size: int = 8,
        max_seq_len: int = 256,
        graph_batch_sizes: Sequence[int] | None = None,
    ) -> None:
        cfg = model.config
        if max_seq_len > cfg.max_position:
            raise SpecError(f"max_seq_len={max_seq_len} exceeds the model's max_position={cfg.max_position}")
        self.backend = hal.get_backend(device, emulate=emulate)
        self.device = self.backend.device
        self.model = model.to(self.device).eval()
        self.config = cfg
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.pages_per_request = math.ceil(max_seq_len / page_size)
        size = max_batch_size * self.pages_per_request * page_size
        swa = None
        if cfg.swa_layer_ids:
            swa = SWAPoolSpec(cfg.swa_layer_ids, size, cfg.swa_kv_heads, cfg.qk_head_dim, cfg.v_head_dim)  # type: ignore[arg-type]
        target_spec = KVPoolSpec(
            cfg.num_layers, size, page_size, cfg.full_kv_heads, cfg.qk_head_dim, cfg.v_head_dim, kv_dtype, swa
        )
        self.target_pool = self.backend.create_kv_pool(target_spec)
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

    def _metadata(self, mode: ForwardMode, requests: Sequence[_Request], q_lens: Sequence[int]) -> AttentionMetadata:
        """Metadata for ``q_lens[b]`` new tokens of each request after its committed ones."""
        for r, q in zip(requests, q_lens):
            self.page_table.reserve(r.rid, r.committed + q)
        locs = [self.page_table.slots(r.rid, range(r.committed, r.committed + q)) for r, q in zip(requests, q_lens)]
        return hal.build_metadata(
            mode,
            kv_lens=[r.committed + q for r, q in zip(requests, q_lens)],
            q_lens=q_lens,
            page_table=self.page_table.table([r.rid for r in requests]),
            out_cache_loc=torch.cat(locs),
            pool=self.target_pool,
        )

    def _new_requests(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
    ) -> list[_Request]:
        if not prompts:
            raise SpecError("generate: no prompts given")
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != len(prompts):
            raise SpecError(f"generate: {len(limits)} max_new_tokens values for {len(prompts)} prompts")
        vocab = self.config.vocab_size
        requests = []
        for i, (prompt, limit) in enumerate(zip(prompts, limits)):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise SpecError(f"generate: prompt {i} is empty")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise SpecError(f"generate: prompt {i} has token ids {bad[:5]} outside [0, {vocab})")
            if not isinstance(limit, int) or limit < 1:
                raise SpecError(f"generate: max_new_tokens for prompt {i} must be an int >= 1, got {limit!r}")
            need = len(prompt) + limit + self.lookahead
            if need > self.max_seq_len:
                raise SpecError(
                    f"generate: prompt {i} needs {need} KV positions (prompt {len(prompt)} + {limit} new + "
                    f"{self.lookahead} draft), above max_seq_len={self.max_seq_len}"
                )
            requests.append(_Request(i, prompt, limit))
        return requests

    def _finish(self, request: _Request) -> None:
        if request.rid in self.page_table:
            self.page_table.release(request.rid)

    def _prefill_target(self, requests: Sequence[_Request]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor]:
        """EXTEND over every prompt (eager; ragged). Returns input ids, target hidden states, metadata,
        each request's last row and the target's next token there."""
        metadata = self._metadata(ForwardMode.EXTEND, requests, [len(r.prompt) for r in requests])
        ids = torch.tensor([t for r in requests for t in r.prompt], dtype=torch.int64, device=self.device)
        hidden = self.model.target_hidden(ids, metadata.positions, KernelAttend(self.target_attention, metadata))
        last_rows = metadata.cu_q_lens[1:].long() - 1
        next_tokens = self.model.logits(hidden[last_rows]).argmax(-1)
        return ids, hidden, metadata, last_rows, next_tokens

    def _run(self, requests: list[_Request], eos_token_id: int | None) -> tuple[int, list[int]]:
        raise NotImplementedError

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        eos_token_id: int | None = None,
    ) -> GenerationResult:
        """Greedy-generate for a batch of prompts; a request stops at ``max_new_tokens`` or after EOS.

        ``seconds`` in the result covers the whole call, prefill included.
        """
        requests = self._new_requests(prompts, max_new_tokens)
        if len(requests) > self.max_batch_size:
            raise SpecError(f"generate: batch of {len(requests)} exceeds max_batch_size={self.max_batch_size}")
        start = time.perf_counter()
        try:
            with torch.no_grad():
                forwards, accept_lengths = self._run(requests, eos_token_id)
            self.backend.synchronize()
        finally:
            for r in requests:
                self._finish(r)
        seconds = time.perf_counter() - start
        return GenerationResult(tuple(tuple(r.output) for r in requests), seconds, forwards, tuple(accept_lengths))


class GreedyDecoder(_TargetEngine):
    """Plain greedy decoding with the target alone (``DECODE`` graphs): the baseline and the lossless oracle."""

    def __init__(self, model: TinyMiMo, device: str = "cpu", **kwargs: object) -> None:
        super().__init__(model, device, **kwargs)  # type: ignore[arg-type]
        self.decode_runner = self._graph_runner(
            lambda inputs, md: self._target_tokens_and_hidden(inputs, md)[0],
            self.target_attention,
            ForwardMode.DECODE,
            1,
            {"input_ids": ((), torch.int64)},
        )

    def _run(self, requests: list[_Request], eos_token_id: int | None) -> tuple[int, list[int]]:
        _, _, _, _, next_tokens = self._prefill_target(requests)
        for r, token in zip(requests, next_tokens.tolist()):
            r.committed = len(r.prompt)
            r.emit([token], eos_token_id)
        forwards = 1
        active = [r for r in requests if not r.finished]
        while active:
            metadata = self._metadata(ForwardMode.DECODE, active, [1] * len(active))
            ids = torch.tensor([r.output[-1] for r in active], dtype=torch.int64, device=self.device)
            tokens = self.decode_runner.run({"input_ids": ids}, metadata).tolist()
            forwards += 1
            for r, token in zip(active, tokens):
                r.committed += 1
                r.emit([token], eos_token_id)
                if r.finished:
                    self._finish(r)
            active = [r for r in active if not r.finished]
        return forwards, []


class MultiLayerEagleWorker(_TargetEngine):
    """Multi-layer EAGLE with ``num_steps`` MTP blocks (one per draft step), chain drafts, greedy verify."""

    def __init__(self, model: TinyMiMo, device: str = "cpu", *, num_steps: int = 3, **kwargs: object) -> None:
        cfg = model.config
        if not isinstance(num_steps, int) or not 1 <= num_steps <= cfg.num_mtp_layers:
            raise SpecError(f"num_steps must be an int in 1..{cfg.num_mtp_layers} (the model's MTP blocks), got {num_steps!r}")
        self.num_steps = num_steps
        self.lookahead = num_steps
        super().__init__(model, device, **kwargs)  # type: ignore[arg-type]
        # The MTP blocks' own KV pool: one layer per block, the same page ids as the target's full pool.
        target = self.target_pool.spec
        mtp_spec = KVPoolSpec(
            num_steps, target.size, target.page_size, cfg.swa_kv_heads, cfg.qk_head_dim, cfg.v_head_dim, target.dtype
        )
        self.mtp_pool = self.backend.create_kv_pool(mtp_spec)
        self.mtp_attention = self.backend.create_attention(self.mtp_pool)
        rows = num_steps + 1
        self.verify_runner = self._graph_runner(
            self._target_tokens_and_hidden,
            self.target_attention,
            ForwardMode.TARGET_VERIFY,
            rows,
            {"input_ids": ((), torch.int64)},
        )
        self.draft_runners = [
            self._graph_runner(
                functools.partial(self._draft_step, k),
                self.mtp_attention,
                ForwardMode.DRAFT_EXTEND_V2,
                rows,
                {"input_ids": ((), torch.int64), "hidden": ((cfg.hidden_size,), torch.float32)},
            )
            for k in range(num_steps)
        ]

    def _draft_step(self, step: int, inputs: Mapping[str, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        return self._mtp_tokens(step, inputs["input_ids"], inputs["hidden"], metadata)

    def _mtp_tokens(
        self, step: int, input_ids: torch.Tensor, target_hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.model.mtp_hidden(
            step, input_ids, target_hidden, metadata.positions, KernelAttend(self.mtp_attention, metadata)
        )
        return self.model.logits(hidden).argmax(-1)

    @staticmethod
    def _for_mtp_pool(metadata: AttentionMetadata, mode: ForwardMode) -> AttentionMetadata:
        # The MTP pool has no SWA sub-pool: its layers read the full-pool block table.
        return attrs.evolve(metadata, mode=mode, swa_block_table=None)

    def _run(self, requests: list[_Request], eos_token_id: int | None) -> tuple[int, list[int]]:
        self._prefill(requests, eos_token_id)
        forwards, accept_lengths = 1, []
        active = [r for r in requests if not r.finished]
        while active:
            forwards += 1
            accept_lengths += self._step(active, eos_token_id)
            active = [r for r in active if not r.finished]
        return forwards, accept_lengths

    def _prefill(self, requests: list[_Request], eos_token_id: int | None) -> None:
        """Target EXTEND, then MTP block k over the prompts with the ids rotated k + 1 times: the first drafts."""
        ids, hidden, metadata, last_rows, next_tokens = self._prefill_target(requests)
        mtp_metadata = self._for_mtp_pool(metadata, ForwardMode.EXTEND)
        attend = KernelAttend(self.mtp_attention, mtp_metadata)
        ids = rotate_input_ids(ids, last_rows, next_tokens)
        drafts = []
        for k in range(self.num_steps):
            h = self.model.mtp_hidden(k, ids, hidden, mtp_metadata.positions, attend)
            drafts.append(self.model.logits(h[last_rows]).argmax(-1))
            ids = rotate_input_ids(ids, last_rows, drafts[-1])
        for r, token, d in zip(requests, next_tokens.tolist(), torch.stack(drafts, 1).tolist()):
            r.committed = len(r.prompt)
            r.drafts = d
            r.emit([token], eos_token_id)
            if r.finished:
                self._finish(r)

    def _step(self, active: list[_Request], eos_token_id: int | None) -> list[int]:
        """One iteration for every active request; returns their accept lengths."""
        accepted, targets, new_drafts = self._iteration(active)
        for r, a, row, d in zip(active, accepted, targets, new_drafts):
            r.committed += a
            r.drafts = d
            r.emit(row[:a], eos_token_id)
            if r.finished:
                self._finish(r)
        return accepted

    def _iteration(self, active: list[_Request]) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """One verify + draft-extend round; returns accept lengths, target tokens and next drafts (host)."""
        b, rows = len(active), self.num_steps + 1
        metadata = self._metadata(ForwardMode.TARGET_VERIFY, active, [rows] * b)
        verify_ids = torch.tensor(
            [[r.output[-1], *r.drafts] for r in active], dtype=torch.int64, device=self.device
        ).view(-1)
        drafts = verify_ids.view(b, rows)[:, 1:]
        target_tokens, target_hidden = self.verify_runner.run({"input_ids": verify_ids}, metadata)
        accept = greedy_accept(drafts, target_tokens.view(b, rows))
        select_rows = torch.arange(b, device=self.device) * rows + accept - 1
        draft_metadata = self._for_mtp_pool(metadata, ForwardMode.DRAFT_EXTEND_V2)
        ids = target_tokens
        new_drafts = []
        for runner in self.draft_runners:
            step_tokens = runner.run({"input_ids": ids, "hidden": target_hidden}, draft_metadata)
            new_drafts.append(step_tokens[select_rows])
            ids = rotate_input_ids(ids, select_rows, new_drafts[-1])
        return accept.tolist(), target_tokens.view(b, rows).tolist(), torch.stack(new_drafts, 1).tolist()
