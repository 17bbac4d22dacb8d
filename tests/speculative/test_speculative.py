"""The multi-layer EAGLE worker: lossless against plain greedy, chain bookkeeping, no KV leaks, the demo."""

from __future__ import annotations

import io
import tempfile

import pytest
import torch

import hal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hal.errors import SpecError
from hal.tools import demo
from hal.speculative.chain import greedy_accept, rotate_input_ids
from hal.speculative.distill import DistillConfig, distill
from hal.speculative.model import TinyConfig, TinyMiMo
from hal.speculative import GreedyDecoder, MultiLayerEagleWorker

SMALL = TinyConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=6, sliding_window=8)
MAX_SEQ = 96


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyMiMo:
    """A small model whose MTP blocks were distilled briefly, so drafts are often accepted."""
    m = TinyMiMo(SMALL)
    distill(m, hal.get_backend("cpu"), DistillConfig(num_sequences=48, seq_len=40, steps=60, batch_size=16), cache_dir=tmp_path_factory.mktemp("mtp"))
    return m


def engines(model: TinyMiMo, device: str, num_steps: int, page_size: int, emulate: bool = False,
            **kw: object) -> tuple[GreedyDecoder, MultiLayerEagleWorker]:
    backend = hal.get_backend(device, emulate=emulate)
    args = dict(page_size=page_size, max_batch_size=4, max_seq_len=MAX_SEQ, **kw)
    return GreedyDecoder(model, backend, **args), MultiLayerEagleWorker(model, backend, num_steps=num_steps, **args)


# -- chain bookkeeping, against hand-computed cases --------------------------------------------


def test_greedy_accept_hand_computed() -> None:
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 8]])
    target = torch.tensor([[5, 6, 7, 4], [5, 6, 7, 4], [5, 6, 7, 4], [5, 6, 7, 4]])
    # all three drafts match -> 3 + bonus; second mismatches -> 1 + 1; first mismatches -> bonus only;
    # a later match after a mismatch does not count.
    assert greedy_accept(drafts, target).tolist() == [4, 2, 1, 3]
    later_match = greedy_accept(torch.tensor([[9, 6, 7]]), torch.tensor([[5, 6, 7, 4]]))
    assert later_match.tolist() == [1]


def test_greedy_accept_rejects_bad_shapes() -> None:
    with pytest.raises(SpecError, match="target_tokens"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))


def test_rotate_input_ids_shifts_each_request_and_writes_the_draft() -> None:
    ids = torch.tensor([10, 11, 12, 20, 21, 22])  # two requests of 3 rows
    out = rotate_input_ids(ids, torch.tensor([1, 5]), torch.tensor([99, 88]))
    assert out.tolist() == [11, 99, 20, 21, 22, 88]
    with pytest.raises(SpecError):
        rotate_input_ids(ids, torch.tensor([1]), torch.tensor([1, 2]))


# -- lossless -------------------------------------------------------------------------------------

prompt = st.lists(st.integers(1, SMALL.vocab_size - 1), min_size=1, max_size=24)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    prompts=st.lists(prompt, min_size=1, max_size=4),
    num_steps=st.integers(1, 3),
    page_size=st.sampled_from([16, 64]),
    data=st.data(),
)
def test_speculative_equals_plain_greedy_on_cpu(
    model: TinyMiMo, prompts: list[list[int]], num_steps: int, page_size: int, data: st.DataObject
) -> None:
    """Token for token, with per-request limits and (sometimes) an EOS the target really emits,
    so requests finish at different iterations."""
    plain, spec = engines(model, "cpu", num_steps, page_size)
    max_new = data.draw(st.lists(st.integers(1, 40), min_size=len(prompts), max_size=len(prompts)), label="max_new")
    free_run = plain.generate(prompts, max_new).tokens
    emitted = sorted({t for out in free_run for t in out})
    eos = data.draw(st.none() | st.sampled_from(emitted), label="eos")
    expect = plain.generate(prompts, max_new, eos_token_id=eos)
    got = spec.generate(prompts, max_new, eos_token_id=eos)
    assert got.tokens == expect.tokens
    for out, limit in zip(got.tokens, max_new):
        assert len(out) == limit or (eos is not None and out[-1] == eos and eos not in out[:-1])
    assert all(1 <= a <= num_steps + 1 for a in got.accept_lengths)
    assert spec.allocator.num_free_pages == spec.allocator.num_pages


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prompts=st.lists(prompt, min_size=1, max_size=3), num_steps=st.integers(1, 3), max_new=st.integers(1, 24))
def test_speculative_equals_plain_greedy_on_emulated_npu(
    model: TinyMiMo, prompts: list[list[int]], num_steps: int, max_new: int
) -> None:
    # FIA v2 takes bf16/fp16 only, and a multiple of 128 as page size with head dim 192.
    plain, spec = engines(model, "npu", num_steps, 128, emulate=True, kv_dtype=torch.bfloat16)
    assert spec.backend_name == "npu"
    assert spec.generate(prompts, max_new).tokens == plain.generate(prompts, max_new).tokens


def test_eos_stops_each_request_and_outputs_still_match(model: TinyMiMo) -> None:
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], list(range(10, 30))]
    plain, spec = engines(model, "cpu", 3, 16)
    free = plain.generate(prompts, 30).tokens
    eos = free[1][4]  # a token request 1 really produces
    expect = plain.generate(prompts, 30, eos_token_id=eos).tokens
    got = spec.generate(prompts, 30, eos_token_id=eos).tokens
    assert got == expect
    assert expect[1][-1] == eos and len(expect[1]) <= 5  # stopped at its first EOS
    for out in expect:
        assert eos not in out[:-1]


def test_distilled_drafts_are_accepted(model: TinyMiMo) -> None:
    _, spec = engines(model, "cpu", 3, 16)
    result = spec.generate([[5, 6, 7, 8, 9], list(range(10, 30))], 40)
    # Fewer target forwards than tokens is the whole point of MTP.
    assert result.mean_accept_length > 2.0
    assert result.target_forwards < result.num_generated


# -- KV slots ---------------------------------------------------------------------------------------


def test_allocator_is_full_again_after_a_batch(model: TinyMiMo) -> None:
    _, spec = engines(model, "cpu", 3, 16)
    total = spec.allocator.num_free_pages
    spec.generate([[1, 2, 3], list(range(1, 40)), [7] * 9], [5, 30, 17])
    assert spec.allocator.num_free_pages == total
    assert spec.allocator.full.num_free == spec.allocator.full.num_pages
    assert spec.allocator.swa is not None and spec.allocator.swa.num_free == spec.allocator.swa.num_pages


def test_allocator_is_freed_when_generation_raises(model: TinyMiMo) -> None:
    _, spec = engines(model, "cpu", 2, 16)
    total = spec.allocator.num_free_pages
    with pytest.raises(SpecError):
        spec.generate([[1, 2, 3]], MAX_SEQ)  # prompt + new tokens + drafts exceed max_seq_len
    assert spec.allocator.num_free_pages == total


def test_bad_arguments_raise_typed_errors(model: TinyMiMo) -> None:
    with pytest.raises(SpecError, match="num_steps"):
        MultiLayerEagleWorker(model, hal.get_backend("cpu"), num_steps=4)
    _, spec = engines(model, "cpu", 3, 16)
    with pytest.raises(SpecError, match="max_batch_size"):
        spec.generate([[1]] * 5, 3)


# -- hal demo ----------------------------------------------------------------------------------------


def test_demo_runs_and_reports_identical_outputs() -> None:
    from hal.tools.cli import build_parser

    args = build_parser().parse_args(
        ["demo", "--train-steps", "5", "--train-sequences", "8", "--max-new-tokens", "6", "--batch-size", "2", "--no-cache"]
    )
    out = io.StringIO()
    assert demo.run(args, out=out) == 0
    text = out.getvalue()
    assert "outputs identical: yes" in text
    assert "backend: cpu" in text and "speedup:" in text and "accept length:" in text


def test_demo_on_the_emulated_npu_runs_bf16_weights_and_kv_and_judges_departures() -> None:
    from hal.backends.npu import emulator
    from hal.tools.cli import build_parser

    args = build_parser().parse_args(
        ["demo", "--device", "npu", "--emulate", "--train-steps", "5", "--train-sequences", "8", "--max-new-tokens", "24",
         "--batch-size", "2", "--no-cache"]
    )
    out = io.StringIO()
    code = demo.run(args, out=out)
    text = out.getvalue()
    assert "weights: bfloat16, KV cache: bfloat16, pages of 128 tokens" in text
    # identical, or every departure judged a near-tie by the float32 model
    assert code == 0 and ("outputs identical: yes" in text or "agree up to bfloat16 rounding" in text), text


def test_the_demos_judge_refuses_a_token_rounding_cannot_explain() -> None:
    from hal.speculative.mimo import MiMoV2Flash

    with tempfile.TemporaryDirectory() as scratch:
        TinyMiMo(TinyConfig(num_layers=6, num_mtp_layers=1)).save_pretrained(scratch)
        exact, low = MiMoV2Flash.from_pretrained(scratch), MiMoV2Flash.from_pretrained(scratch, dtype=torch.bfloat16)
    prefix = [5, 9, 17, 3, 40]
    logits = demo._dense_logits(exact, prefix)[-1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert not demo.near_tie(exact, low, prefix, best, worst).within
    same = demo.near_tie(exact, low, prefix, best, best)
    assert same.within and same.gap == 0 and 0 < same.delta < 1  # bf16 rounding, measured, not assumed


def test_demo_on_an_unavailable_device_fails_with_one_line_before_training(monkeypatch, capsys) -> None:
    from hal.tools.cli import main

    def no_training(*args, **kwargs):
        raise AssertionError("the demo trained before checking its device")

    monkeypatch.setattr(demo, "distill", no_training)
    assert main(["demo", "--device", "npu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hal demo: BackendUnavailableError:") and "torch_npu" in err and "\n" not in err
    assert main(["demo", "--device", "tpu"]) == 1
    assert "unknown device 'tpu'" in capsys.readouterr().err


# -- draft-extend bookkeeping, against a dense teacher-forced reference ---------------------------


def _dense_drafts(model: TinyMiMo, committed: list[int], bonus_and_drafts: list[int], steps: int) -> list[int]:
    """MTP block k's argmax at the last committed position, computed densely over the whole sequence:
    block k at position p reads (target_hidden[p], token[p + k + 1])."""
    from hal.speculative.distill import DenseAttend

    n = len(committed)
    attend = DenseAttend(1, n)
    chain = committed + bonus_and_drafts
    with torch.no_grad():
        hidden = model.target_hidden(torch.tensor(committed), attend.positions, attend)
        out = []
        for k in range(steps):
            ids = torch.tensor(chain[k + 1 : k + 1 + n])
            out.append(int(model.logits(model.mtp_hidden(k, ids, hidden, attend.positions, attend)[-1]).argmax()))
            if len(chain) < n + k + 2:
                chain.append(out[-1])
    return out


def test_prefill_and_draft_extend_produce_the_dense_drafts(model: TinyMiMo) -> None:
    """After prefill every MTP block's draft equals the dense chain (ids rotated k + 1 times); after each
    iteration MTP block 0's draft equals the dense block 0 at the last accepted row, so positions, slots,
    hidden-state rows and the select index line up. (Blocks k >= 1 may differ after an iteration: their
    KV at the k positions before the committed length was computed from drafts, as in SGLang.)"""
    _, spec = engines(model, "cpu", 3, 16)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 33)), [3] * 11]
    requests = spec._new_requests(prompts, 30)
    try:
        with torch.no_grad():
            verify_ids = spec._prefill(requests, frozenset())
        for r in requests:
            assert r.drafts == _dense_drafts(model, r.prompt, [r.output[-1]], 3)
        seen_accepts: set[int] = set()
        previous = requests
        for _ in range(6):
            active = [r for r in requests if not r.finished]
            verify_ids = spec.keep_rows(verify_ids, previous, active)
            # the device-side verify rows are what the host bookkeeping says: [bonus, d1..dS]
            assert verify_ids.tolist() == [[r.output[-1], *r.drafts] for r in active]
            with torch.no_grad():
                verify_ids, accepted = spec._step(active, verify_ids.view(-1), frozenset())
            seen_accepts.update(accepted)
            previous = active
            for r in active:
                committed = (r.prompt + r.output)[: r.committed]
                assert r.committed == len(r.prompt) + len(r.output) - 1  # the bonus is not in the cache yet
                assert r.drafts[0] == _dense_drafts(model, committed, [r.output[-1]], 1)[0]
        assert len(seen_accepts) > 1  # both rejections and multi-token accepts were exercised
    finally:
        for r in requests:
            spec._finish(r)
    assert spec.allocator.num_free_pages == spec.allocator.num_pages


def test_prefill_writes_mtp_kv_only_for_the_positions_a_draft_can_see(model: TinyMiMo) -> None:
    """The MTP blocks' SWA window W: their prefill covers each prompt's last W + 1 positions, where the
    first draft and every later one read, and leaves the MTP pool's rows of earlier positions as they
    were; the target's pool holds every prompt position. The drafts equal the dense ones over the whole
    prompt (``test_prefill_and_draft_extend_produce_the_dense_drafts``)."""
    _, spec = engines(model, "cpu", 3, 16)
    window = spec.draft_layers[0].sliding_window
    prompts = [list(range(1, 4 * window)), [7] * (window + 1), [9, 8, 7]]
    requests = spec._new_requests(prompts, 4)
    sentinel = 1234.5
    for layer in range(spec.mtp_pool.spec.num_layers):
        spec.mtp_pool.k_buffer(layer).fill_(sentinel)
    try:
        with torch.no_grad():
            spec._prefill(requests, frozenset())
        for r in requests:
            n = len(r.prompt)
            slots = spec.page_table.slots(r.rid, range(n))
            for layer in range(spec.mtp_pool.spec.num_layers):
                rows = spec.mtp_pool.k_buffer(layer).view(-1, *spec.mtp_pool.k_buffer(layer).shape[2:])[slots]
                written = (rows != sentinel).flatten(1).any(1).tolist()
                assert written == [p >= n - 1 - window for p in range(n)], (r.rid, layer)
            target = spec.target_pool.k_buffer(0).view(-1, *spec.target_pool.k_buffer(0).shape[2:])[slots]
            assert bool((target != 0).flatten(1).any(1).all())
    finally:
        for r in requests:
            spec._finish(r)


def test_draft_extend_rows_carry_the_rotated_tokens(model: TinyMiMo) -> None:
    """At draft step k the row at position p (up to the last accepted row) is fed token p + k + 1:
    verified tokens first, then the bonus, then the fresh drafts d1'..dk' of this iteration."""
    _, spec = engines(model, "cpu", 3, 16)
    fed: list[list[int]] = []
    for runner in spec.draft_runners:
        def record(inputs, metadata, run=runner.run):  # type: ignore[no-untyped-def]
            fed.append(inputs["input_ids"].tolist())
            return run(inputs, metadata)

        runner.run = record  # type: ignore[method-assign]
    requests = spec._new_requests([[5, 6, 7, 8, 9], list(range(40, 60))], 30)
    rows = 4
    try:
        with torch.no_grad():
            verify_ids = spec._prefill(requests, frozenset())
            previous = requests
            for _ in range(5):
                active = [r for r in requests if not r.finished]
                before = [r.committed for r in active]
                fed.clear()
                verify_ids, accepts = spec._step(active, spec.keep_rows(verify_ids, previous, active).view(-1), frozenset())
                previous = active
                for b, (r, start, a) in enumerate(zip(active, before, accepts)):
                    chain = r.prompt + r.output + r.drafts
                    for k in range(3):
                        got = fed[k][b * rows : b * rows + a]
                        assert got == [chain[start + i + k + 1] for i in range(a)], (k, a)
    finally:
        for r in requests:
            spec._finish(r)


def test_a_cycles_draft_steps_share_one_plan_and_stay_lossless(model: TinyMiMo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft steps of one cycle read one metadata record: the first step's plan serves the
    others (one ``plan`` call per cycle on the MTP kernel, the prefill's tail aside), and the
    tokens still equal plain greedy decoding's."""
    plain, spec = engines(model, "cpu", 3, 4)
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8, 6, 4, 2, 11, 13, 1]]
    expected = plain.generate(prompts, 20).tokens
    kernel = spec.mtp_attention
    made = []
    real_plan = type(kernel).plan

    def counted(self, metadata):  # type: ignore[no-untyped-def]
        made.append(metadata.mode)
        return real_plan(self, metadata)

    monkeypatch.setattr(type(kernel), "plan", counted)
    result = spec.generate(prompts, 20)
    assert result.tokens == expected
    cycles = result.target_forwards - 1  # the prefill is the first forward
    drafts = [mode for mode in made if mode == hal.ForwardMode.DRAFT_EXTEND_V2]
    assert len(drafts) == cycles, (len(drafts), cycles)  # without sharing: 3 per cycle
