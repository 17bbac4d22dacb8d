"""ForwardBatch objects as SGLang's scheduler fills them, for the adapter tests (MHA and hybrid pools)."""

from __future__ import annotations

import types
from typing import Any

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def chain(n: int) -> types.SimpleNamespace:
    """The spec_info fields the backend reads from a topk=1 EAGLE batch."""
    return types.SimpleNamespace(topk=1, num_tokens_per_req=n, draft_token_num=n)


def make_batch(mode: ForwardMode, world: Any, reqs: list[int], prefix: list[int], q_lens: list[int]) -> ForwardBatch:
    """A ForwardBatch for ``mode`` over ``world.req_to_token`` (see the module docstring of
    ``hal.integrations.sglang.forward_batch`` for the lengths per mode)."""
    kv = [p + q for p, q in zip(prefix, q_lens)]
    loc = torch.cat([world.req_to_token[r, p:k].long() for r, p, k in zip(reqs, prefix, kv)])
    seq_lens = prefix if mode == ForwardMode.TARGET_VERIFY else kv
    fb = ForwardBatch(
        forward_mode=mode, batch_size=len(reqs), input_ids=torch.zeros(sum(q_lens), dtype=torch.long),
        req_pool_indices=torch.tensor(reqs, dtype=torch.long), seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        out_cache_loc=loc, seq_lens_sum=sum(seq_lens),
    )  # fmt: skip
    fb.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
    # DRAFT_EXTEND_V2: SGLang's eager path fills the extend fields too; its graph path leaves them out.
    if mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND_V2):
        fb.extend_seq_lens_cpu = list(q_lens)
        fb.extend_prefix_lens_cpu = list(prefix)
    if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        fb.spec_info = chain(q_lens[0])
    return fb


def hal_graphs(attn: Any) -> Any:
    """hal's graph backend as hal's platform hands it to an SGLang graph runner over ``attn``."""
    from hal.integrations.sglang.graph import HalGraphBackend
    from hal.integrations.sglang.plugin import bound_to

    runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(device=str(attn.device), attn_backend=attn))
    return bound_to(HalGraphBackend, attn.hal_backend)(runner)


def captured_by_hal_graphs(attn: Any, batch: ForwardBatch, forward: Any, key: str = "shape") -> Any:
    """``forward`` captured by hal's graph backend on ``batch``'s record, as SGLang's graph runner
    captures one shape (record first, then the capture): the graph backend."""
    graphs = hal_graphs(attn)
    attn.init_forward_metadata_out_graph(batch, in_capture=True)
    with graphs.capture_session(stream=None):
        graphs.capture_one(key, forward)
    return graphs


def replayed(graphs: Any, attn: Any, batch: ForwardBatch, key: str = "shape") -> Any:
    """A replay of ``key`` on ``batch``, as SGLang's graph runner replays: the static outputs."""
    attn.init_forward_metadata_out_graph(batch)
    return graphs.replay(key, static_forward_batch=batch)
