"""Whole-model decoding benchmarks of ``hal bench``: hal's MTP worker against hal's greedy decoder
(``--speculative``), hal's greedy and MTP decoding against the decoder a user would write without hal
(``--plain``: a contiguous KV cache per layer and torch's SDPA, ``hal.tools.plain_decoder``), and
against transformers' own ``generate`` on the same checkpoint (``--transformers``).

Every comparison alternates the two sides run by run on the same prompts and reports the median
of the per-run ratios, with their range in the label.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import hal
from hal.errors import ResultMismatchError
from hal.protocols import Backend
from hal.speculative import GenerationResult
from hal.tools.measurement import Measurement, judged


def _distilled_demo_model() -> Any:
    from hal.speculative.distill import DistillConfig, distill
    from hal.speculative.model import TinyConfig, TinyMiMo

    model = TinyMiMo(TinyConfig(seed=0, num_mtp_layers=3))
    distill(model, hal.get_backend("cpu"), DistillConfig())  # cached after the first run
    return model


class _RunTimes:
    """The time and count of every call of a method (a graph runner's ``run``, an engine's prefill),
    the device synchronized around each: where decoding's time goes (a pass apart from the
    throughput runs)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextlib.contextmanager
    def timing(self, backend: Backend, runners: dict[str, list[Any]], method: str = "run") -> Iterator[None]:
        def timed(name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                backend.synchronize()
                start = time.perf_counter()
                out = inner(*args, **kwargs)
                backend.synchronize()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
                return out

            return run

        for name, group in runners.items():
            for runner in group:
                setattr(runner, method, timed(name, getattr(runner, method)))
        try:
            yield
        finally:
            for group in runners.values():
                for runner in group:
                    delattr(runner, method)  # the class's own method again

    def mean(self, name: str) -> float:
        return self.seconds[name] / self.calls[name]


def mtp_cycle_bound(greedy: Any, mtp: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """What bounds MTP over greedy decoding with these engines, from one timed run of each past the
    prefill: the verify forward and one draft step in decode forwards, the accept length, the bound
    and what was achieved. A cycle costs one verify and ``num_steps`` draft steps and yields
    ``accept`` tokens where a decode forward yields one, so past the prefill MTP/greedy is at most
    ``accept / (verify + num_steps * draft)``, whatever the rest of a step costs; ``achieved`` is
    MTP/greedy tok/s past the prefill (each prefill also emits a request's first token)."""
    times = _RunTimes()
    with times.timing(greedy.backend, {"decode": [greedy.decode_runner]}):
        with times.timing(greedy.backend, {"greedy prefill": [greedy]}, "_prefill_target"):
            plain = greedy.generate(prompts, new_tokens)
    with times.timing(mtp.backend, {"verify": [mtp.verify_runner], "draft": list(mtp.draft_runners)}):
        with times.timing(mtp.backend, {"mtp prefill": [mtp]}, "_prefill"):
            spec = mtp.generate(prompts, new_tokens)
    decode = times.mean("decode")
    verify, draft, accept = times.mean("verify") / decode, times.mean("draft") / decode, spec.mean_accept_length
    rate = [(r.num_generated - len(prompts)) / (r.seconds - times.seconds[name]) for r, name in ((spec, "mtp prefill"), (plain, "greedy prefill"))]
    return {"verify": verify, "draft": draft, "accept": accept, "bound": accept / (verify + mtp.num_steps * draft),
            "achieved": rate[0] / rate[1]}


def bench_speculative(backend: Backend, quick: bool) -> list[Measurement]:
    """Plain greedy vs the MTP worker (``speculative``), alternating runs, medians."""
    from hal.tools import demo

    model = _distilled_demo_model()
    batch, new_tokens, repeats = (2, 16, 1) if quick else (4, 64, 3)
    plain, spec = demo.build_engines(model, backend, 3, None, page_size=128, max_batch_size=batch,
                                     max_seq_len=16 + 3 * batch + new_tokens + 4)
    prompts = demo.make_prompts(batch, model.config.vocab_size, 0)
    plain.generate(prompts[:1], 2)
    spec.generate(prompts[:1], 2)
    base, fast = [], []
    for _ in range(repeats):
        base.append(plain.generate(prompts, new_tokens))
        fast.append(spec.generate(prompts, new_tokens))
    if any(r.tokens != base[0].tokens for r in base + fast):
        raise ResultMismatchError("speculative output differs from plain greedy output")
    b = statistics.median(r.tokens_per_second for r in base)
    f = statistics.median(r.tokens_per_second for r in fast)
    return [judged(f"MTP S=3 decode, tiny MiMo, batch {batch} (accept {fast[0].mean_accept_length:.2f})", f, b,
                   "tok/s", [x.tokens_per_second / y.tokens_per_second for x, y in zip(fast, base)], "MTP/greedy tok/s")]


def bench_vs_plain(
    backend: Backend, quick: bool, log: Callable[[str], None] = print
) -> list[Measurement]:
    """hal greedy and hal MTP (S=3) vs ``PlainDecoder`` on the demo's distilled model, and MTP vs greedy:
    batch 1, 4 and 8, prompts of 64 and 1024 tokens, 32 new tokens, whole calls (prefill included)
    timed alternately.
    Every run's tokens must equal the plain decoder's, or the row is a ``ResultMismatchError``."""
    from hal.speculative import GreedyDecoder, MultiLayerEagleWorker
    from hal.tools.plain_decoder import PlainDecoder

    model = _distilled_demo_model()
    shapes = [(1, 64), (4, 64)] if quick else [(b, p) for p in (64, 1024) for b in (1, 4, 8)]
    new_tokens, repeats = (8, 2) if quick else (32, 5)
    gen = torch.Generator().manual_seed(0)
    plain = PlainDecoder(model, backend.device, model.spec.dtype)  # beside hal, on its device
    out = []
    for batch, prompt_len in shapes:
        prompts = torch.randint(1, model.config.vocab_size, (batch, prompt_len), generator=gen).tolist()
        engine_args: dict[str, Any] = {"max_batch_size": batch, "max_seq_len": prompt_len + new_tokens + 4,
                                       "graph_batch_sizes": [batch]}
        decoders: dict[str, GreedyDecoder | MultiLayerEagleWorker] = {
                    "greedy": GreedyDecoder(model, backend, **engine_args),
                    "mtp": MultiLayerEagleWorker(model, backend, num_steps=3, **engine_args)}
        plain.generate(prompts, 2)  # warm-up: first calls and captures stay out of the figures
        for engine in decoders.values():
            engine.generate(prompts, 2)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in decoders}  # (hal, plain) tok/s
        accept: list[float] = []
        for _ in range(repeats):
            for name, engine in decoders.items():
                reference = plain.generate(prompts, new_tokens)
                result: GenerationResult = engine.generate(prompts, new_tokens)
                if result.tokens != reference.tokens:
                    raise ResultMismatchError(f"hal {name} tokens differ from the plain decoder's (batch {batch}, prompt {prompt_len})")
                samples[name].append((result.tokens_per_second, reference.tokens_per_second))
                if name == "mtp":
                    accept.append(result.mean_accept_length)
        mtp_name = f"MTP S=3 (accept {statistics.mean(accept):.2f})"
        for name, pairs in samples.items():
            what = "greedy" if name == "greedy" else mtp_name
            out.append(judged(f"hal {what} vs plain decoder (KV cache + SDPA), batch {batch}, prompt {prompt_len}",
                              statistics.median(h for h, _ in pairs), statistics.median(p for _, p in pairs), "tok/s",
                              [h / p for h, p in pairs], "hal/plain tok/s", ">= 1" if name == "greedy" else ">= 2"))
        # Speculative decoding must never cost time: MTP against hal's own greedy, paired by repeat.
        greedy, mtp = samples["greedy"], samples["mtp"]
        mtp_over_greedy = [m / g for (m, _), (g, _) in zip(mtp, greedy)]
        out.append(judged(f"hal {mtp_name} vs hal greedy, batch {batch}, prompt {prompt_len}",
                          statistics.median(m for m, _ in mtp), statistics.median(g for g, _ in greedy), "tok/s",
                          mtp_over_greedy, "MTP/greedy tok/s", ">= 1"))
        cycle = mtp_cycle_bound(decoders["greedy"], decoders["mtp"], prompts, new_tokens)
        out.append(Measurement(
            f"hal MTP/greedy past the prefill vs its bound accept / (verify + 3 drafts), batch {batch}, prompt {prompt_len}: "
            f"verify = {cycle['verify']:.2f} decode forwards, a draft step {cycle['draft']:.2f}, accept {cycle['accept']:.2f}",
            cycle["achieved"], cycle["bound"], "MTP/greedy tok/s", cycle["achieved"] / cycle["bound"] * 100, "% of the bound"))
        log(f"plain decoder comparison: batch {batch}, prompt {prompt_len} done")
    return out


def bench_vs_transformers(
    backend: Backend, quick: bool, log: Callable[[str], None] = print
) -> list[Measurement]:
    """hal greedy and hal MTP (S=3) vs ``MiMoV2FlashForCausalLM.generate`` (greedy, its default cache
    and attention) on the demo's distilled model saved as a MiMo-V2-Flash checkpoint; batch 1 and 4,
    prompts of 64 and 1024 tokens. Tokens must agree, or the row is a ``ResultMismatchError``."""
    import transformers

    from hal.speculative import GreedyDecoder, MultiLayerEagleWorker
    from hal.speculative.mimo import MiMoV2Flash

    tiny = _distilled_demo_model()
    with tempfile.TemporaryDirectory() as directory:
        tiny.save_pretrained(directory)
        model = MiMoV2Flash.from_pretrained(directory)
        hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(directory, use_kernels=False).eval()
    shapes = [(1, 64)] if quick else [(1, 64), (4, 64), (1, 1024), (4, 1024)]
    new_tokens, repeats = (8, 1) if quick else (32, 3)
    gen = torch.Generator().manual_seed(0)
    out = []
    for batch, prompt_len in shapes:
        prompts = torch.randint(1, model.config.vocab_size, (batch, prompt_len), generator=gen)
        engine_args: dict[str, Any] = {"max_batch_size": batch, "max_seq_len": prompt_len + new_tokens + 4,
                                       "graph_batch_sizes": [batch]}
        plain = GreedyDecoder(model, backend, **engine_args)
        mtp = MultiLayerEagleWorker(model, backend, num_steps=3, **engine_args)
        rows = prompts.tolist()
        plain.generate(rows[:1], 2)  # warm-up: graph capture and first calls stay out of the figures
        mtp.generate(rows[:1], 2)
        with torch.no_grad():
            hf.generate(prompts[:1], max_new_tokens=2, do_sample=False)
        samples: dict[str, list[tuple[float, float]]] = {"greedy": [], "mtp": []}  # (hal, transformers) tok/s
        accept: list[float] = []
        for _ in range(repeats):
            for name, engine in (("greedy", plain), ("mtp", mtp)):
                result: GenerationResult = engine.generate(rows, new_tokens)
                reference, hf_tps = _hf_generate(hf, prompts, new_tokens)
                if [list(t) for t in result.tokens] != reference:
                    raise ResultMismatchError(f"hal {name} tokens differ from transformers' (batch {batch}, prompt {prompt_len})")
                samples[name].append((result.tokens_per_second, hf_tps))
                if name == "mtp":
                    accept.append(result.mean_accept_length)
        for name, pairs in samples.items():
            what = "greedy" if name == "greedy" else f"MTP S=3 (accept {statistics.mean(accept):.2f})"
            label = f"hal {what} vs transformers generate, batch {batch}, prompt {prompt_len}, {new_tokens} new tokens"
            out.append(judged(label, statistics.median(h for h, _ in pairs), statistics.median(t for _, t in pairs),
                              "tok/s", [h / t for h, t in pairs], "hal/transformers tok/s"))
        log(f"transformers comparison: batch {batch}, prompt {prompt_len} done")
    return out


def _hf_generate(hf: Any, prompts: torch.Tensor, new_tokens: int) -> tuple[list[list[int]], float]:
    """transformers' greedy continuation of ``prompts`` (equal lengths: no padding) and its tokens/s."""
    import time

    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return out[:, prompts.shape[1] :].tolist(), prompts.shape[0] * new_tokens / seconds
