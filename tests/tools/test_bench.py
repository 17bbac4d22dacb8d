"""``hal bench``: the harness alternates its two sides, the memory figures match a hand count,
the dense baselines agree with the paged kernel, and the command writes its table and plot."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch

import hal
from hal.backends.cpu import CpuBackend
from hal.backends.cpu.attention import CpuAttention
from hal.tools.bench import BenchConfig, bench_memory, markdown_table, run_benchmarks, time_pair, write_outputs
from hal.tools import measurement
from hal.tools.measurement import Measurement

TINY = attrs.evolve(BenchConfig.quick(), decode_batch=2, decode_kv_len=160, extend_len=96, write_tokens=256,
                    q_heads=8, kv_heads=2, repeats=2, warmup=1, min_sample_s=0.0)


class _CountingBackend(CpuBackend):
    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1


def test_time_pair_alternates_and_synchronizes_around_every_sample() -> None:
    be = _CountingBackend()
    calls: list[str] = []
    pt = time_pair(be, lambda: calls.append("a"), lambda: calls.append("b"), repeats=4, warmup=2)
    assert pt.a >= 0 and pt.b >= 0
    assert calls[:4] == ["a", "b", "a", "b"]  # warm-up pairs
    timed = calls[4 + 2:]  # after the two single calibration calls
    assert timed == ["a", "b"] * 4
    assert be.syncs == 2 * (2 + 2 * 4)  # before and after every calibration and timed sample


def test_paired_ratio_is_the_median_of_per_pair_ratios(monkeypatch) -> None:
    """On a fake clock with hand-picked durations: pairs (2, 1), (30, 10), (4, 4) after one
    calibration call each give per-pair ratios 2, 3, 1, so the paired ratio is 2 where the ratio
    of the medians (4 / 4) would be 1."""

    now = [0.0]
    monkeypatch.setattr(measurement.time, "perf_counter", lambda: now[0])
    durations = {"a": iter([1.0, 2.0, 30.0, 4.0]), "b": iter([1.0, 1.0, 10.0, 4.0])}

    def tick(side: str) -> Callable[[], None]:
        def fn() -> None:
            now[0] += next(durations[side])

        return fn

    pt = time_pair(CpuBackend(), tick("a"), tick("b"), repeats=3, warmup=0)
    assert (pt.a, pt.b, pt.a_over_b) == (4.0, 4.0, 2.0)


def test_memory_rows_match_a_hand_count_for_mimo_v2_flash() -> None:
    rows = {m.name: m for m in bench_memory()}
    full = rows["KV bytes/token, one MiMo full layer (4 kv heads)"]
    swa = rows["KV bytes/token, one MiMo SWA layer (8 kv heads)"]
    total = rows["KV bytes/token, all 48 MiMo layers (9 full + 39 SWA)"]
    # bf16: 2 bytes; split K 192 + V 128, padded K 192 + V 192.
    assert (full.hal, full.baseline) == (4 * (192 + 128) * 2, 4 * (192 + 192) * 2)
    assert (swa.hal, swa.baseline) == (8 * 320 * 2, 8 * 384 * 2)
    assert (total.hal, total.baseline) == (9 * 2560 + 39 * 5120, 9 * 3072 + 39 * 6144)
    assert total.ratio == pytest.approx(100 * (1 - 320 / 384))


def test_run_benchmarks_and_outputs(tmp_path: Path) -> None:
    results = run_benchmarks(CpuBackend(), TINY, log=lambda line: None)
    names = [m.name for m in results]
    assert any(n.startswith("KV write, 64 scattered tokens (set_kv vs copy_)") for n in names)
    assert any(n.startswith("paged decode attention") for n in names)
    assert any(n.startswith("paged extend attention") for n in names)
    assert any(n.startswith("dispatch: decode forward via hal") for n in names)
    for m in results:
        assert m.baseline > 0 and math.isfinite(m.hal) and math.isfinite(m.ratio)
        assert (m.met is None) == (m.target == "")
    paths = write_outputs(results, tmp_path, "title")
    md, csv_path, png = paths
    table_lines = [line for line in md.read_text().splitlines() if line.startswith("| ")]
    assert len(table_lines) == len(results) + 2  # header, separator, one row each
    with csv_path.open() as fh:
        assert len(list(csv.reader(fh))) == len(results) + 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_targets_are_judged_from_the_ratio() -> None:
    m = Measurement("x", 1.0, 2.0, "ms", 0.5, "hal/SDPA time", "<= 1.5", True)
    table = markdown_table([m])
    assert table.splitlines()[2].split("|")[-2].strip() == "yes"
    miss = attrs.evolve(m, met=False)
    assert "**no**" in markdown_table([miss])


def test_bench_command_writes_results(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import hal.tools.bench
    from hal.tools.cli import main

    monkeypatch.setattr(hal.tools.bench.BenchConfig, "quick", classmethod(lambda cls: TINY))
    assert main(["bench", "--quick", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "| benchmark |" in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.csv", "results.md", "results.png"]
    assert main(["bench", "--repeats", "0"]) == 2


def test_bench_unwritable_out_fails_in_one_line_before_timing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import hal.tools.bench
    from hal.tools.cli import main

    def no_timing(*args, **kwargs):
        raise AssertionError("benchmarks ran before the output directory was checked")

    monkeypatch.setattr(hal.tools.bench, "run_benchmarks", no_timing)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "--quick", "--out", str(blocker / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hal bench: ") and str(blocker) in err and "\n" not in err


class _HalfAttention(CpuAttention):
    """Returns half the right output."""

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().forward(*args, **kwargs) / 2


class _WrongAttentionBackend(CpuBackend):
    device_type = "wrongattn"

    def create_attention(self, pool):  # type: ignore[no-untyped-def]
        return _HalfAttention(pool)


def test_bench_refuses_to_time_a_kernel_that_disagrees_with_the_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hal
    import hal.tools.bench
    from hal.tools.cli import main

    monkeypatch.setattr(hal.tools.bench.BenchConfig, "quick", classmethod(lambda cls: TINY))
    hal.register_backend("wrongattn", _WrongAttentionBackend)
    try:
        assert main(["bench", "--quick", "--device", "wrongattn", "--out", str(tmp_path)]) == 1
    finally:
        hal.unregister_backend("wrongattn")
    err = capsys.readouterr().err.strip()
    assert err.startswith("hal bench: ResultMismatchError: dense baseline") and "\n" not in err
    assert not (tmp_path / "results.md").exists()


def test_dense_baselines_compute_the_paged_result() -> None:
    from hal.tools.bench_kernels import _dense_baselines

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 1, 24), torch.randn(2, 2, 40, 24), torch.randn(2, 2, 40, 16)
    # Independent dense reference: repeat kv heads, softmax over all keys (decode: no mask).
    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    expect = torch.softmax(q @ kr.transpose(-1, -2) * 0.3, -1) @ vr
    for name, fn in _dense_baselines(q, k, v, 0.3, decode=True).items():
        torch.testing.assert_close(fn(), expect, atol=1e-5, rtol=1e-5, msg=name)
    qe = torch.randn(1, 8, 40, 24)
    mask = torch.ones(40, 40, dtype=torch.bool).tril()
    scores = (qe @ kr[:1].transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    expect_e = torch.softmax(scores, -1) @ vr[:1]
    for name, fn in _dense_baselines(qe, k[:1], v[:1], 0.3, decode=False).items():
        torch.testing.assert_close(fn(), expect_e, atol=1e-5, rtol=1e-5, msg=name)


def test_rows_report_the_spread_and_call_a_verdict_that_could_go_either_way_noisy() -> None:
    from hal.tools.bench_report import better_direction
    from hal.tools.measurement import judged

    wide = judged("x", 1, 1, "ms", [1.0, 2.0, 3.0], "hal/SDPA time", "<= 1.5")
    assert (wide.ratio, wide.met, wide.spread, wide.noisy) == (2.0, False, (1.0, 3.0), True)
    across = judged("x", 1, 1, "tok/s", [0.95, 1.0, 1.1], "hal/plain tok/s", ">= 1")
    assert across.met and across.noisy  # the bound 1 lies inside 0.95-1.1
    clear = judged("x", 1, 1, "tok/s", [1.2, 1.25, 1.3], "hal/plain tok/s", ">= 1")
    assert clear.met and not clear.noisy
    assert "1.2 to 1.3" in markdown_table([clear]) and "(noisy)" in markdown_table([across])
    negative = judged("n", 1.0, 1.0, "ms", [-40.6, -33.2, -35.0], "difference %")
    assert "-40.6 to -33.2" in markdown_table([negative])  # not "-40.6--33.2"
    assert better_direction(clear) == "higher" and better_direction(wide) == "lower"


def test_plain_decoder_rows_check_tokens_and_carry_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hal bench --plain`` on a small undistilled model: per shape a greedy and an MTP row against
    the plain decoder and an MTP row against hal's greedy (timed by the same runs), each with the
    target and the spread; a plain decoder that disagrees stops the run."""
    import hal.tools.bench_decoding as decoding
    from hal.errors import ResultMismatchError
    from hal.speculative.model import TinyConfig, TinyMiMo
    from hal.tools.plain_decoder import PlainDecoder

    monkeypatch.setattr(decoding, "_distilled_demo_model", lambda: TinyMiMo(TinyConfig(num_layers=3, num_mtp_layers=3)))
    rows = decoding.bench_vs_plain(hal.get_backend("cpu"), True, log=lambda line: None)
    assert [(m.target, m.ratio_of) for m in rows] == [
        (">= 1", "hal/plain tok/s"), (">= 2", "hal/plain tok/s"), (">= 1", "MTP/greedy tok/s"), ("", "% of the bound")] * 2
    judged_rows = [m for m in rows if m.ratio_of != "% of the bound"]
    for m in judged_rows:
        assert m.spread is not None and m.spread[0] <= m.ratio <= m.spread[1] and m.met is not None
    for greedy, mtp, versus in zip(rows[::4], rows[1::4], rows[2::4]):
        assert (versus.hal, versus.baseline) == (mtp.hal, greedy.hal)
    for bound in rows[3::4]:
        assert bound.ratio == pytest.approx(bound.hal / bound.baseline * 100) and "verify =" in bound.name

    real = PlainDecoder.generate

    def off_by_one(self, prompts, max_new_tokens):  # type: ignore[no-untyped-def]
        result = real(self, prompts, max_new_tokens)
        return attrs.evolve(result, tokens=tuple(tuple(t + 1 for t in row) for row in result.tokens))

    monkeypatch.setattr(PlainDecoder, "generate", off_by_one)
    with pytest.raises(ResultMismatchError, match="differ from the plain decoder's"):
        decoding.bench_vs_plain(hal.get_backend("cpu"), True, log=lambda line: None)


def test_the_mtp_bound_times_every_runner_call_and_leaves_the_engines_as_they_were() -> None:
    """``mtp_cycle_bound`` times the decode, verify and draft runners' calls (and each prefill) on
    the engines themselves, then gives them back their own methods; the bound is the accept length
    over a cycle's forwards, counted in decode forwards."""
    import hal.tools.bench_decoding as decoding
    from hal.speculative import GreedyDecoder, MultiLayerEagleWorker
    from hal.speculative.model import TinyConfig, TinyMiMo

    model = TinyMiMo(TinyConfig(num_layers=3, num_mtp_layers=3))
    args = {"max_batch_size": 2, "max_seq_len": 48, "graph_batch_sizes": [2]}
    greedy, mtp = GreedyDecoder(model, hal.get_backend("cpu"), **args), MultiLayerEagleWorker(model, hal.get_backend("cpu"), **args)
    prompts = [[3, 5, 7, 9], [2, 4, 6, 8, 10, 12]]
    expected = greedy.generate(prompts, 12).tokens
    cycle = decoding.mtp_cycle_bound(greedy, mtp, prompts, 12)
    assert all("run" not in vars(r) for r in (greedy.decode_runner, mtp.verify_runner, *mtp.draft_runners))
    assert "_prefill_target" not in vars(greedy) and "_prefill" not in vars(mtp)
    assert mtp.generate(prompts, 12).tokens == expected  # the engines decode as before
    assert 1 <= cycle["accept"] <= mtp.num_steps + 1 and cycle["verify"] > 0 and cycle["draft"] > 0 and cycle["achieved"] > 0
    assert cycle["bound"] == pytest.approx(cycle["accept"] / (cycle["verify"] + mtp.num_steps * cycle["draft"]))
