"""The low-precision guarantee the README states, as a check the tests share: wherever a bf16/fp16
run departs from another, the two tokens are within ``2 * delta`` of each other and of the best in
the float32 logits there, ``delta`` being the largest logit error transformers' own implementation
makes in that dtype on the same sequences (teacher-forced)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tiny_mimo_checkpoints import hf_load


def greedy_generate(model: Any, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def float_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


class Guarantee:
    """The float32 oracle and the dtype's rounding error (``delta``) per prompt, as transformers
    realises it on the sequences compared."""

    def __init__(self, checkpoint: Path, oracle: Any, dtype: torch.dtype, prompts: Sequence[list[int]], n: int) -> None:
        self.oracle, self.low = oracle, hf_load(checkpoint, dtype=dtype)
        self.prompts, self.n = prompts, n
        self.reference = [greedy_generate(oracle, p, n) for p in prompts]
        self.deltas: dict[int, float] = {}

    def delta(self, i: int, continuations: Sequence[Sequence[int]]) -> float:
        """The largest |logit error| of transformers in the low dtype over prompt ``i`` followed by
        the float32 reference and by each of ``continuations`` (every position, teacher-forced)."""
        worst = self.deltas.get(i, 0.0)
        for continuation in [self.reference[i], *continuations]:
            tokens = self.prompts[i] + list(continuation)
            worst = max(worst, float((float_logits(self.low, tokens) - float_logits(self.oracle, tokens)).abs().max()))
        self.deltas[i] = worst
        return worst

    def check_departure(self, i: int, a: Sequence[int], b: Sequence[int], label: str) -> int:
        """Where ``a`` and ``b`` (two continuations of prompt ``i``) first differ, both tokens must be
        within 2 delta of each other and of the float32 best; returns that index (len if equal)."""
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        if first == len(a):
            return first
        delta = self.delta(i, [a, b])
        logits = float_logits(self.oracle, self.prompts[i] + list(a[:first]))[-1]
        best = float(logits.max())
        x, y = float(logits[a[first]]), float(logits[b[first]])
        assert abs(x - y) <= 2 * delta and best - min(x, y) <= 2 * delta, (
            f"{label}, prompt {i}, token {first}: {a[first]} vs {b[first]} at float32 logits {x:.4f} / {y:.4f} "
            f"(best {best:.4f}), beyond 2 * delta = {2 * delta:.4f}"
        )
        return first
