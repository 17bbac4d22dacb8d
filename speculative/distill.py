"""Distil the MTP blocks on the target's own greedy continuations (CPU, seconds), with a weight cache.

A random MTP head drafts tokens the target almost never agrees with. This trains MTP block ``k``
to do what it does at inference: at position ``p``, from ``(target_hidden[p], token[p + k + 1])``,
predict ``token[p + k + 2]`` of the target's greedy continuation. The target is frozen; the data is
its own greedy output (generated through hal on the CPU backend), so a perfect MTP block would be
accepted every time.

Training runs attention by the oracle's definition (``DenseAttend``: ``hal.oracle.dense_attention``
batched over equal-length sequences, differentiable, in float32), so window, sink and masking
semantics are the ones every backend is held to at inference.
Trained weights are cached under ``<tmp>/hal-mtp-cache`` keyed by the model config (seed
included), a fingerprint of the target weights and the training settings.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import torch

from hal.protocols import Backend

from hal.errors import SpecError
from hal.spec import LayerSpec
from hal.speculative.model import TinyMiMo

CACHE_FORMAT = 2  # 2: training attends through the batched DenseAttend
Progress = Callable[[str, int, int, float | None], None]  # (phase, done, total, loss)


@attrs.frozen
class DistillConfig:
    """Training data and optimiser settings."""

    num_sequences: int = 256  # greedy continuations to train on
    min_prompt_len: int = 4
    max_prompt_len: int = 16
    seq_len: int = 64  # prompt + continuation, the same for every sequence
    steps: int = 200
    batch_size: int = 8  # sequences per optimiser step
    lr: float = 3e-3
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.min_prompt_len <= self.max_prompt_len < self.seq_len - 2:
            raise SpecError(
                f"DistillConfig: need 1 <= min_prompt_len <= max_prompt_len < seq_len - 2, got "
                f"{self.min_prompt_len}, {self.max_prompt_len}, {self.seq_len}"
            )
        for name in ("num_sequences", "batch_size"):
            if getattr(self, name) < 1:
                raise SpecError(f"DistillConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0:
            raise SpecError(f"DistillConfig.steps must be >= 0, got {self.steps}")


@attrs.frozen
class DistillReport:
    from_cache: bool
    cache_path: Path | None
    seconds: float
    final_loss: float | None
    # Teacher-forced top-1 accuracy of each MTP block on held-out continuations.
    heldout_accuracy: tuple[float, ...] = ()


class DenseAttend:
    """Causal attention over ``num_seqs`` packed sequences of ``seq_len`` tokens, differentiably, in
    float32 (float64 inputs: float64). It is ``hal.oracle.dense_attention``'s definition (window,
    sinks, GQA) for sequences of one length with nothing cached, batched over the sequences so
    training and the demo's judge run it as a few large products; the tests hold it to the oracle."""

    def __init__(self, num_seqs: int, seq_len: int, device: torch.device | str = "cpu") -> None:
        self.num_seqs, self.seq_len = num_seqs, seq_len
        self.positions = torch.arange(seq_len, device=device).repeat(num_seqs)
        offset = torch.arange(seq_len, device=device)[:, None] - torch.arange(seq_len, device=device)[None, :]
        self._offset = offset  # query position - key position: >= 0 is causal

    def __call__(
        self, layer: LayerSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        n, t = self.num_seqs, self.seq_len
        hq, hkv = q.shape[1], k.shape[1]
        group = hq // hkv
        dtype = torch.promote_types(q.dtype, torch.float32)
        # q head h reads kv head h // group: [n, t, hkv, group, d]
        qb = q.to(dtype).view(n, t, hkv, group, q.shape[-1])
        kb, vb = k.to(dtype).view(n, t, hkv, k.shape[-1]), v.to(dtype).view(n, t, hkv, v.shape[-1])
        scores = torch.einsum("ntgrd,nsgd->ngrts", qb, kb) * layer.scaling
        visible = self._offset >= 0
        if layer.sliding_window is not None:
            visible = visible & (self._offset <= layer.sliding_window)
        scores = scores.masked_fill(~visible, float("-inf"))  # every row sees at least itself
        if sinks is not None:  # a logit no value carries: one more column of the softmax, dropped after
            sink = sinks.to(dtype).view(1, hkv, group, 1, 1).expand(n, hkv, group, t, 1)
            weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :t]
        else:
            weights = torch.softmax(scores, -1)
        out = torch.einsum("ngrts,nsgd->ntgrd", weights, vb)
        return out.reshape(n * t, hq, v.shape[-1]).to(q.dtype)


def greedy_sequences(
    model: TinyMiMo,
    backend: Backend,
    config: DistillConfig,
    *,
    seed_offset: int = 0,
    num: int | None = None,
    progress: Progress | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, seq_len]`` random prompts followed by the target's greedy continuation (decoded through
    hal on ``backend``), and the prompt lengths."""
    from hal.speculative.engine import GreedyDecoder

    num = config.num_sequences if num is None else num
    rng = random.Random(config.seed * 1_000_003 + seed_offset)
    vocab = model.config.vocab_size
    prompt_lens = [rng.randint(config.min_prompt_len, config.max_prompt_len) for _ in range(num)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in prompt_lens]
    batch = min(num, 128)  # large decode batches amortise the per-step overhead
    decoder = GreedyDecoder(
        model, backend, max_batch_size=batch, max_seq_len=config.seq_len, page_size=16, graph_batch_sizes=[batch]
    )
    rows: list[list[int]] = []
    chunks = range(0, num, batch)
    for done, start in enumerate(chunks):
        if progress:
            progress("data", done, len(chunks), None)
        chunk = prompts[start : start + batch]
        out = decoder.generate(chunk, [config.seq_len - len(p) for p in chunk])
        rows += [p + list(o) for p, o in zip(chunk, out.tokens)]
    if progress:
        progress("data", len(chunks), len(chunks), None)
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(prompt_lens, dtype=torch.int64)


def _mtp_inputs(tokens: torch.Tensor, prompt_lens: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``step`` at position ``p``: input ``token[p + step + 1]``, label ``token[p + step + 2]``
    (-100 where it runs off the end or is a prompt token, which no model could predict)."""
    n, t = tokens.shape
    pad = torch.zeros((n, step + 2), dtype=tokens.dtype)
    padded = torch.cat([tokens, pad], dim=1)
    ids = padded[:, step + 1 : step + 1 + t]
    labels = padded[:, step + 2 : step + 2 + t].clone()
    label_pos = torch.arange(t)[None, :] + step + 2
    labels[(label_pos >= t) | (label_pos < prompt_lens[:, None])] = -100
    return ids, labels


def _target_hidden(model: TinyMiMo, tokens: torch.Tensor) -> torch.Tensor:
    n, t = tokens.shape
    attend = DenseAttend(n, t)
    with torch.no_grad():
        return model.target_hidden(tokens.reshape(-1), attend.positions, attend).view(n, t, -1)


def _mtp_logits(model: TinyMiMo, step: int, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    n, t = ids.shape
    attend = DenseAttend(n, t)
    h = model.mtp_hidden(step, ids.reshape(-1), hidden.reshape(n * t, -1), attend.positions, attend)
    return model.logits(h)


def mtp_accuracy(model: TinyMiMo, tokens: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[float, ...]:
    """Teacher-forced top-1 accuracy of every MTP block on the continuation positions."""
    hidden = _target_hidden(model, tokens)
    out = []
    with torch.no_grad():
        for k in range(model.config.num_mtp_layers):
            ids, labels = _mtp_inputs(tokens, prompt_lens, k)
            pred = _mtp_logits(model, k, ids, hidden).argmax(-1)
            mask = labels.reshape(-1) != -100
            out.append(float((pred[mask] == labels.reshape(-1)[mask]).float().mean()))
    return tuple(out)


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's float32 values as bytes, copied in one call (iterating a storage in Python costs
    about a second per 100k values; numpy is not a dependency)."""
    flat = tensor.to("cpu", torch.float32).contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def _fingerprint(model: TinyMiMo) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if not name.startswith("mtp."):
            h.update(name.encode())
            h.update(_raw_bytes(p.detach()))
    return h.hexdigest()[:16]


def cache_path_for(model: TinyMiMo, config: DistillConfig, cache_dir: Path | str | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "hal-mtp-cache"
    key = hashlib.sha256(
        f"v{CACHE_FORMAT}|{model.config!r}|{config!r}|{_fingerprint(model)}".encode()
    ).hexdigest()[:24]
    return root / f"mtp-{key}.pt"


def distill(
    model: TinyMiMo,
    backend: Backend,
    config: DistillConfig = DistillConfig(),
    *,
    cache_dir: Path | str | None = None,
    use_cache: bool = True,
    progress: Progress | None = None,
    evaluate: bool = False,
) -> DistillReport:
    """Train ``model``'s MTP blocks in place (or load them from the cache); the training data is
    the target's greedy output decoded on ``backend`` (the CPU's in ``hal demo``, whatever the model
    later runs on: the cache key does not name the backend)."""
    start = time.perf_counter()
    path = cache_path_for(model, config, cache_dir) if use_cache else None
    heldout: tuple[float, ...] = ()
    if path is not None and path.exists():
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.mtp.load_state_dict(state)
        from_cache, final_loss = True, None
    else:
        from_cache = False
        final_loss = _train(model, backend, config, progress)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{random.getrandbits(32):08x}")
            torch.save({k: v.to("cpu") for k, v in model.mtp.state_dict().items()}, tmp)
            tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    if evaluate:
        tokens, lens = greedy_sequences(model, backend, config, seed_offset=1, num=32)
        heldout = mtp_accuracy(model, tokens, lens)
    return DistillReport(from_cache, path, time.perf_counter() - start, final_loss, heldout)


@contextlib.contextmanager
def _only_mtp_trainable(model: TinyMiMo) -> Iterator[list[torch.nn.Parameter]]:
    """Freeze the target (embedding and lm_head included) while the MTP blocks train."""
    params = model.mtp_parameters()
    trainable = {id(p) for p in params}
    frozen = [p for p in model.parameters() if id(p) not in trainable and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    model.train()
    try:
        yield params
    finally:
        model.eval()
        for p in frozen:
            p.requires_grad_(True)


def _train(model: TinyMiMo, backend: Backend, config: DistillConfig, progress: Progress | None) -> float | None:
    tokens, prompt_lens = greedy_sequences(model, backend, config, progress=progress)
    hidden = _target_hidden(model, tokens)
    s = model.config.num_mtp_layers
    inputs = [_mtp_inputs(tokens, prompt_lens, k) for k in range(s)]
    gen = torch.Generator().manual_seed(config.seed)
    loss_value = None
    with _only_mtp_trainable(model) as params:
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=config.lr, total_steps=max(config.steps, 1), pct_start=0.1
        )
        if progress:
            progress("train", 0, config.steps, None)
        for step in range(config.steps):
            idx = torch.randint(0, tokens.shape[0], (config.batch_size,), generator=gen)
            loss = torch.zeros(())
            for k, (ids, labels) in enumerate(inputs):
                logits = _mtp_logits(model, k, ids[idx], hidden[idx])
                loss = loss + torch.nn.functional.cross_entropy(logits, labels[idx].reshape(-1), ignore_index=-100)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_value = float(loss.detach()) / s
            if progress:
                progress("train", step + 1, config.steps, loss_value)
    return loss_value
