"""SGLang's EAGLE multi-step draft decode through hal: one ``HalAttnBackend`` per draft step, each
given its step's DECODE metadata over every request's ``topk`` branches."""

from __future__ import annotations

from typing import Any

import torch

import hal
from hal.errors import SpecError, UnsupportedConfigError
from hal.metadata import build_metadata
from hal.spec import ForwardMode
from hal.integrations.sglang.attention import HalAttnBackend
from hal.integrations.sglang.forward_batch import host_ints, page_table_from_req_to_token



def draft_branch_rows(
    rows: torch.Tensor, seq_lens: list[int], topk: int, num_steps: int, page_size: int, step: int
) -> tuple[torch.Tensor, list[int]]:
    """The ``req_to_token`` rows of a multi-step draft decode's branches at ``step`` (0-based) and
    their KV lengths, request-major (row ``b * topk + j`` is request ``b``'s branch ``j``).

    ``rows`` are the requests' ``req_to_token`` rows (host ``[B, width]``). SGLang's EAGLE worker
    lays each branch's draft tokens after the committed prefix (``prepare_for_draft``): with
    one-token pages branch ``j``'s ``num_steps`` slots follow at ``seq_len + j * num_steps``; with
    larger pages (and ``topk > 1``) each branch owns ``ceil((seq_len % page_size + num_steps) /
    page_size)`` whole pages from the prefix's last full page on, whose first ``seq_len %
    page_size`` slots hold a copy of the prefix's tail. At ``step`` a branch sees the prefix and
    its own ``step + 1`` draft tokens, so its row is the prefix's full pages followed by its pages.
    """
    branches, lens = [], []
    for b, seq_len in enumerate(seq_lens):
        tail = seq_len % page_size if topk > 1 else 0
        base = seq_len - tail
        pages_per_branch = -(-(tail + num_steps) // page_size) if topk > 1 else 0
        for j in range(topk):
            start = base + j * pages_per_branch * page_size
            own = rows[b, start : start + tail + step + 1]
            branches.append(torch.cat([rows[b, :base], own]))
            lens.append(seq_len + step + 1)
    width = max(lens, default=0)
    out = rows.new_zeros((len(branches), width))
    for i, r in enumerate(branches):
        out[i, : r.numel()] = r
    return out, lens


class HalMultiStepDraftBackend:
    """SGLang's multi-step draft decode through hal (EAGLE's draft steps after the first, with
    ``topk`` branches per request): one ``HalAttnBackend`` per step, each given its step's DECODE
    metadata over ``batch * topk`` rows by ``init_forward_metadata`` (the worker runs step ``i``
    with ``attn_backends[i]``). SGLang builds it through hal's platform
    (``create_speculative_draft_decode_backend``, upstream patch ``draft_utils_platform_draft_backends``).
    """

    def __init__(self, model_runner: Any, backend: hal.Backend, topk: int, num_steps: int) -> None:
        self.topk = int(topk)
        self.speculative_num_steps = int(num_steps)
        if self.topk < 1 or self.speculative_num_steps < 2:
            raise SpecError(
                f"attention backend 'hal': multi-step draft decode needs topk >= 1 and at least 2 steps, "
                f"got topk={topk}, speculative_num_steps={num_steps}"
            )
        self.attn_backends = [HalAttnBackend(model_runner, backend) for _ in range(self.speculative_num_steps - 1)]
        first = self.attn_backends[0]
        if first._swa_pool is not None:
            raise UnsupportedConfigError(
                "attention backend 'hal': multi-step draft decode over a hybrid sliding-window draft pool is not served; "
                "a draft model with sliding-window layers drafts through SGLang's multi-layer EAGLE worker"
            )
        self.req_to_token = first.req_to_token
        self.pool = first.pool

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Each step's metadata, from the draft batch (``out_cache_loc``: ``[batch, topk, steps]`` slots)."""
        if forward_batch.forward_mode.is_idle():
            for child in self.attn_backends:
                child.run_on(None)
            return
        topk, steps, ps = self.topk, self.speculative_num_steps, self.pool.spec.page_size
        seq_lens = host_ints(
            forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens, "seq_lens"
        )
        requests = host_ints(forward_batch.req_pool_indices, "req_pool_indices")
        locs = forward_batch.out_cache_loc
        if locs is None or locs.numel() != len(seq_lens) * topk * steps:
            raise SpecError(
                f"attention backend 'hal': a draft decode batch of {len(seq_lens)} requests, topk {topk} and {steps} steps "
                f"writes {len(seq_lens) * topk * steps} slots, got out_cache_loc of {None if locs is None else locs.numel()}"
            )
        bad = [r for r in requests if not 0 <= r < self.req_to_token.shape[0]]
        if bad:
            raise SpecError(f"attention backend 'hal': req_pool_indices {bad} outside the request table's rows 0..{self.req_to_token.shape[0] - 1}")
        # The furthest req_to_token position a branch reads (draft_branch_rows' layout).
        width = max((s - s % ps + topk * -(-(s % ps + steps) // ps) * ps if topk > 1 else s + steps for s in seq_lens), default=0)
        if width > self.req_to_token.shape[1]:
            raise SpecError(f"attention backend 'hal': draft tokens up to position {width} exceed the request table's {self.req_to_token.shape[1]}")
        rows = self.req_to_token[torch.tensor(requests, dtype=torch.long, device=self.req_to_token.device), :width].cpu()
        per_step = locs.view(len(seq_lens), topk, steps)
        for step, child in enumerate(self.attn_backends):
            branch_rows, kv_lens = draft_branch_rows(rows, seq_lens, topk, steps, ps, step)
            child.run_on(build_metadata(
                ForwardMode.DECODE,
                kv_lens=kv_lens,
                q_lens=[1] * len(kv_lens),
                page_table=page_table_from_req_to_token(branch_rows, kv_lens, ps),
                out_cache_loc=per_step[:, :, step].reshape(-1),
                pool=self.pool,
            ))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise UnsupportedConfigError(
            "attention backend 'hal': SGLang's draft decode graphs are not captured through hal's multi-step draft "
            "backend; start the engine with disable_cuda_graph=True"
        )
