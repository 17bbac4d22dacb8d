"""Multi-layer EAGLE (MTP) speculative decoding on hal, device-neutral (see ``hal.speculative.engine``).

Speculative iteration (SGLang's EAGLE worker v2 with chain drafts):
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

Prefill runs the target over every prompt position, then each MTP block over the prompt's tail
that a draft can see (its window + 1 positions; see ``_prefill_tail``), so its cost does not grow
with the prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import attrs
import torch

from hal.metadata import AttentionMetadata, build_metadata
from hal.plan import ForwardPlan
from hal.protocols import Backend
from hal.spec import ForwardMode, KVPoolSpec, int_at_least
from hal.speculative.chain import greedy_accept, rotate_input_ids
from hal.speculative.engine import KernelAttend, Request, TargetEngine
from hal.speculative.contract import EngineModel


class MultiLayerEagleWorker(TargetEngine):
    """Multi-layer EAGLE with ``num_steps`` MTP blocks (one per draft step), chain drafts, greedy verify."""

    def __init__(self, model: EngineModel, backend: Backend, *, num_steps: int = 3, **kwargs: object) -> None:
        available = model.spec.num_draft_layers
        int_at_least(num_steps, 1, "num_steps (one per MTP block of the model)", maximum=available)
        self.num_steps = num_steps
        self.lookahead = num_steps
        self.draft_layers = model.spec.draft_layers[:num_steps]
        super().__init__(model, backend, **kwargs)  # type: ignore[arg-type]
        # The MTP blocks' own KV pool: one layer per block, addressed by the target's slots.
        target = self.target_pool.spec
        self.mtp_pool = self.backend.create_kv_pool(KVPoolSpec.for_layers(self.draft_layers, target.size, target.page_size, target.dtype))
        self.mtp_attention = self.backend.create_attention(self.mtp_pool)
        self._draft_plan: ForwardPlan | None = None  # the latest draft step's plan (``_mtp_tokens``)
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
                {"input_ids": ((), torch.int64), "hidden": ((self.spec.hidden_size,), self.spec.dtype)},
            )
            for k in range(num_steps)
        ]

    def _draft_step(self, step: int, inputs: Mapping[str, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        return self._mtp_tokens(step, inputs["input_ids"], inputs["hidden"], metadata)

    def _mtp_tokens(
        self, step: int, input_ids: torch.Tensor, target_hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        # A cycle's draft steps share one metadata record, so they share its plan (made once, by the first).
        attend = KernelAttend(self.mtp_attention, metadata, self._draft_plan)
        self._draft_plan = attend.plan
        hidden = self.model.mtp_hidden(step, input_ids, target_hidden, metadata.positions, attend)
        return self.model.logits(hidden).argmax(-1)

    @staticmethod
    def _for_mtp_pool(metadata: AttentionMetadata, mode: ForwardMode) -> AttentionMetadata:
        # The MTP pool has no SWA sub-pool: its layers read the full-pool block table.
        return attrs.evolve(metadata, mode=mode, swa_block_table=None)

    def _run(self, requests: list[Request], eos_token_ids: frozenset[int]) -> tuple[int, list[int]]:
        verify_ids = self._prefill(requests, eos_token_ids)
        forwards, accept_lengths = 1, []
        active = [r for r in requests if not r.finished]
        verify_ids = self.keep_rows(verify_ids, requests, active)
        while active:
            forwards += 1
            next_ids, accepted = self._step(active, verify_ids.view(-1), eos_token_ids)
            accept_lengths += accepted
            still = [r for r in active if not r.finished]
            verify_ids, active = self.keep_rows(next_ids, active, still), still
        return forwards, accept_lengths

    def _prefill(self, requests: list[Request], eos_token_ids: frozenset[int]) -> torch.Tensor:
        """Target EXTEND, then MTP block k over the prompts' tails with the ids rotated k + 1 times:
        the first drafts. Returns each request's first verify ids ``[bonus, d1..dS]``, on the device."""
        ids, hidden, metadata, last_rows, next_tokens = self._prefill_target(requests)
        tails: dict[int | None, tuple[AttentionMetadata, torch.Tensor]] = {}
        ids = rotate_input_ids(ids, last_rows, next_tokens)
        drafts = []
        for k in range(self.num_steps):
            window = self.draft_layers[k].sliding_window
            if window not in tails:
                tails[window] = self._prefill_tail(requests, metadata, window)
            tail_metadata, rows = tails[window]
            h = self.model.mtp_hidden(k, ids[rows], hidden[rows], tail_metadata.positions,
                                      KernelAttend(self.mtp_attention, tail_metadata))
            drafts.append(self.model.logits(h[tail_metadata.cu_q_lens[1:].long() - 1]).argmax(-1))
            ids = rotate_input_ids(ids, last_rows, drafts[-1])
        verify_ids = self.tp.broadcast(torch.stack([next_tokens, *drafts], 1))
        for r, (token, *d) in zip(requests, verify_ids.tolist()):  # the prefill's one read-back
            r.committed = len(r.prompt)
            r.drafts = d
            r.emit([token], eos_token_ids)
            if r.finished:
                self._finish(r)
        return verify_ids

    def _prefill_tail(
        self, requests: Sequence[Request], metadata: AttentionMetadata, window: int | None
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """EXTEND metadata on the MTP pool for the last ``window + 1`` prompt positions of each
        request (every position without a window), and those positions' rows in the prompt batch.

        An MTP block is one layer reading the target's hidden states, so its K/V at a position needs
        nothing of the block's own earlier positions. Every later read of it (the last prompt row, then
        the draft rows at ``L ..``) sees positions ``>= L - 1 - window``: the tail is all of the prompt
        a draft can see, whatever the prompt's length. The tail's earlier rows see keys before it that
        were never written; their outputs are discarded (only each request's last row is read), and
        nothing crosses rows in a layer."""
        lengths = [len(r.prompt) for r in requests]
        tail = [n if window is None else min(n, window + 1) for n in lengths]
        rows = torch.tensor([i for end, t in zip(metadata.cu_q_lens_cpu, tail) for i in range(end - t, end)],
                            dtype=torch.int64)
        tail_metadata = build_metadata(
            ForwardMode.EXTEND,
            kv_lens=lengths,
            q_lens=tail,
            page_table=self.page_table.table([r.rid for r in requests]),
            out_cache_loc=self.page_table.slot_list([(r.rid, n - t, n) for r, n, t in zip(requests, lengths, tail)]),
            pool=self.target_pool,
        )
        return self._for_mtp_pool(tail_metadata, ForwardMode.EXTEND), rows.to(self.device)

    def _step(self, active: list[Request], verify_ids: torch.Tensor, eos_token_ids: frozenset[int]) -> tuple[torch.Tensor, list[int]]:
        """One verify + accept + draft round for every active request, whose ``[bonus, d1..dS]`` rows
        are ``verify_ids`` (on the device). Returns the next round's verify ids ``[B, S + 1]`` (on the
        device) and the accept lengths; reads the device back once."""
        b, rows = len(active), self.num_steps + 1

        # 1. Verify: the target reads [bonus, d1..dS] of each request at positions L .. L + S.
        metadata = self._metadata(ForwardMode.TARGET_VERIFY, active, [rows] * b)
        target_tokens, target_hidden = self.verify_runner.run({"input_ids": verify_ids}, metadata)

        # 2. Accept: drafts while they equal the target's own greedy tokens, plus the target's next
        #    token. What is emitted is always the target's output, so decoding stays lossless.
        targets = target_tokens.view(b, rows)
        accept = greedy_accept(verify_ids.view(b, rows)[:, 1:], targets)
        last_accepted_row = torch.arange(b, device=self.device) * rows + accept - 1

        # 3. Draft: MTP block k over the same rows with the target's hidden states; its token at
        #    the last accepted row is the next iteration's draft d_{k+1}.
        draft_metadata = self._for_mtp_pool(metadata, ForwardMode.DRAFT_EXTEND_V2)
        ids = target_tokens
        new_drafts = []
        for runner in self.draft_runners:
            step_tokens = runner.run({"input_ids": ids, "hidden": target_hidden}, draft_metadata)
            new_drafts.append(step_tokens[last_accepted_row])
            ids = rotate_input_ids(ids, last_accepted_row, new_drafts[-1])
        bonus = target_tokens[last_accepted_row]  # the target's token after the accepted ones

        # 4. Commit on the host, from the iteration's one read-back: L += a, emit, keep the drafts
        #    (every rank of a TP group acts on rank 0's decisions).
        packed = self.tp.broadcast(torch.cat([accept[:, None], targets, bonus[:, None], *(d[:, None] for d in new_drafts)], 1))
        next_ids = packed[:, 1 + rows :].contiguous()
        accepted = []
        for r, (a, *rest) in zip(active, packed.tolist()):
            accepted.append(a)
            r.committed += a
            r.drafts = rest[rows + 1 :]
            r.emit(rest[:a], eos_token_ids)
            if r.finished:
                self._finish(r)
        return next_ids, accepted
