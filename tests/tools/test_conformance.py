"""The conformance kit: the reference passes it, and deliberately broken backends fail the
checks that cover what they break (and only get "unsupported" for what they decline)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import hal
from hal.backends.cpu import CpuBackend
from hal.backends.cpu.attention import CpuAttention
from hal.backends.cpu.kv_pool import CpuKVPool
from hal.graph import EagerGraph
from hal.tools.conformance import (
    Check,
    CheckResult,
    Status,
    attention_cases,
    build_suite,
    format_table,
    loop_configs,
    run_check,
    run_suite,
    summarize,
)
from hal.errors import UnsupportedConfigError
from hal.graph import GraphUpdate


def _by_status(results: list[CheckResult]) -> dict[Status, list[CheckResult]]:
    out: dict[Status, list[CheckResult]] = {s: [] for s in Status}
    for r in results:
        out[r.status].append(r)
    return out


def _features(results: list[CheckResult]) -> set[str]:
    return {f for r in results for f in r.check.features}


def test_reference_backend_passes_the_full_suite() -> None:
    results = run_suite(CpuBackend(), build_suite())
    by = _by_status(results)
    assert not by[Status.FAILED], [(r.check.name, r.detail) for r in by[Status.FAILED]]
    assert not by[Status.UNSUPPORTED]
    features = _features(results)
    for required in (
        "kv pool: round trip",
        "kv pool: no aliasing",
        "kv pool: bad input",
        "kv pool: SWA mapping",
        "attention: sliding window",
        "attention: sinks",
        "attention: hybrid SWA pool",
        "attention: GQA",
        "attention: qk_head_dim != v_head_dim",
        "graph: DRAFT_EXTEND_V2 replay (every draft step)",
        "graph: padded batch",
        "errors: attention bad input",
        "attention: NaN/inf in unseen slots",
        "attention: NaN/inf in a new row",
    ):
        assert required in features
    for mode in ("EXTEND", "DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"):
        assert f"attention: {mode}" in features
    for ps in (16, 64, 128):
        assert f"attention: page size {ps}" in features
    for dtype in ("float32", "float16", "bfloat16"):
        assert f"attention: {dtype}" in features


def test_quick_suite_covers_every_feature_of_the_full_suite() -> None:
    full = {f for c in build_suite() for f in c.features}
    quick = {f for c in build_suite(quick=True) for f in c.features}
    assert quick == full
    assert len(build_suite(quick=True)) < len(build_suite())


def test_attention_cases_cross_every_mode_with_every_variant() -> None:
    cases = attention_cases()
    combos = {(c.mode, c.layer.sliding_window is not None, c.layer.has_sinks, c.hybrid) for c in cases}
    assert len(combos) == 4 * 4
    # Hybrid cases put the layer in the SWA sub-pool, so they need a window.
    assert all(c.layer.sliding_window is not None for c in cases if c.hybrid)


def test_loop_schedules_pad_fall_back_and_replay_again() -> None:
    for cfg in loop_configs() + loop_configs(quick=True):
        sizes = cfg.schedule
        captured = set(cfg.batch_sizes)
        assert any(b not in captured and b < max(captured) for b in sizes), cfg.label  # padded
        assert any(b > max(captured) for b in sizes), cfg.label  # eager fallback
        assert len(set(sizes)) > 1, cfg.label  # the batch changes


def test_summarize_counts_each_check_once_per_feature() -> None:
    def check(name: str, *features: str) -> Check:
        return Check(name, features, lambda backend: None)

    results = [
        CheckResult(check("a", "x", "y"), Status.PASSED),
        CheckResult(check("b", "x"), Status.FAILED, "bad"),
        CheckResult(check("c", "y", "z"), Status.UNSUPPORTED, "no"),
        CheckResult(check("d", "x"), Status.PASSED),
    ]
    rows = {r.feature: (r.passed, r.failed, r.unsupported) for r in summarize(results)}
    assert rows == {"x": (2, 1, 0), "y": (1, 0, 1), "z": (0, 0, 1)}
    table = format_table(results).splitlines()
    assert table[0].split("|")[1].strip() == "feature"
    assert [c.strip() for c in table[-1].split("|")[1:-1]] == ["**total (4 checks)**", "2", "1", "1"]


def test_run_check_classifies_outcomes() -> None:
    def unsupported(backend: object) -> None:
        raise UnsupportedConfigError("no fp64 here")

    def crashes(backend: object) -> None:
        raise RuntimeError("kernel exploded")

    be = CpuBackend()
    assert run_check(be, Check("u", ("f",), unsupported)).status is Status.UNSUPPORTED
    crashed = run_check(be, Check("c", ("f",), crashes))
    assert crashed.status is Status.FAILED and "RuntimeError: kernel exploded" in crashed.detail
    assert run_check(be, Check("p", ("f",), lambda b: None)).status is Status.PASSED


# ---------------------------------------------------------------------------------------------
# broken backends: each must fail the checks covering its defect


class _ShiftedVPool(CpuKVPool):
    """Writes V one slot after where it belongs."""

    def _write_rows(self, buffer: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
        if rows.shape[-1] != self.spec.head_dim:  # the V buffer (the configs use dk != dv)
            loc = (loc + 1) % buffer.shape[0]
        super()._write_rows(buffer, loc, rows)


class _IgnoresSwaMappingPool(CpuKVPool):
    def translate_loc(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        return loc


class _UncheckedPool(CpuKVPool):
    """Clamps out-of-range locations instead of raising."""

    def _validate(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pass

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = self.num_slots(layer) if 0 <= layer < self.spec.num_layers else 1
        super().set_kv(min(max(layer, 0), self.spec.num_layers - 1), loc.long().clamp(0, n - 1), k, v)


class _WindowOffByOne(CpuAttention):
    def forward(self, q, k, v, layer, plan, save_kv_cache=True, *, sinks=None):  # type: ignore[no-untyped-def]
        if layer.sliding_window is not None:
            import attrs

            layer = attrs.evolve(layer, sliding_window=layer.sliding_window + 1)
        return super().forward(q, k, v, layer, plan, save_kv_cache, sinks=sinks)


class _SinksIgnored(CpuAttention):
    def forward(self, q, k, v, layer, plan, save_kv_cache=True, *, sinks=None):  # type: ignore[no-untyped-def]
        import attrs

        return super().forward(q, k, v, attrs.evolve(layer, has_sinks=False), plan, save_kv_cache)


class _PaddingLeaks(CpuAttention):
    """Sends writes for the padding slot 0 to the pool's last slot."""

    def forward(self, q, k, v, layer, plan, save_kv_cache=True, *, sinks=None):  # type: ignore[no-untyped-def]
        import attrs

        last = (self.pool.spec.num_pages + 1) * self.pool.spec.page_size - 1
        md = plan.metadata
        loc = torch.where(md.out_cache_loc == 0, last, md.out_cache_loc)
        return super().forward(q, k, v, layer, self.plan(attrs.evolve(md, out_cache_loc=loc)), save_kv_cache, sinks=sinks)


class _UntypedErrors(CpuAttention):
    def forward(self, q, k, v, layer, plan, save_kv_cache=True, *, sinks=None):  # type: ignore[no-untyped-def]
        try:
            return super().forward(q, k, v, layer, plan, save_kv_cache, sinks=sinks)
        except hal.HalError as exc:
            raise RuntimeError(str(exc)) from None


class _NoBf16(CpuAttention):
    def forward(self, q, k, v, layer, plan, save_kv_cache=True, *, sinks=None):  # type: ignore[no-untyped-def]
        if q.dtype == torch.bfloat16:
            raise UnsupportedConfigError("this kernel has no bfloat16 path")
        return super().forward(q, k, v, layer, plan, save_kv_cache, sinks=sinks)


class _StaleMetadataGraph(EagerGraph):
    """Copies new inputs but keeps the metadata buffers it was captured with."""

    def replay(self, update: GraphUpdate | None = None) -> None:
        if update is not None:
            floats = tuple((d, s) for d, s in update.buffer_copies if d.is_floating_point())
            update = GraphUpdate(buffer_copies=floats, host_params=update.host_params)
        super().replay(update)


def _backend(pool_cls: type = CpuKVPool, attention_cls: type = CpuAttention, graph_cls: type = EagerGraph) -> CpuBackend:
    class Broken(CpuBackend):
        name = "broken"

        def create_kv_pool(self, spec):  # type: ignore[no-untyped-def]
            return pool_cls(spec, self.device)

        def create_attention(self, pool):  # type: ignore[no-untyped-def]
            return attention_cls(pool)

        def create_graph(self, *, tp_group=None):  # type: ignore[no-untyped-def]
            return graph_cls()

    return Broken()


@pytest.mark.parametrize(
    ("backend_kwargs", "select", "must_fail", "must_pass"),
    [
        ({"pool_cls": _ShiftedVPool}, ["kv pool", "DECODE"], {"kv pool: round trip", "kv pool: no aliasing", "attention: DECODE"}, {"kv pool: layout"}),
        ({"pool_cls": _IgnoresSwaMappingPool}, ["kv pool"], {"kv pool: SWA mapping"}, {"kv pool: layout"}),
        ({"pool_cls": _UncheckedPool}, ["kv pool"], {"kv pool: bad input"}, {"kv pool: round trip"}),
        ({"attention_cls": _WindowOffByOne}, ["DECODE"], {"attention: sliding window"}, set()),
        ({"attention_cls": _SinksIgnored}, ["TARGET_VERIFY"], {"attention: sinks"}, set()),
        ({"attention_cls": _PaddingLeaks}, ["graph loop decode"], {"graph: padded batch"}, set()),
        ({"attention_cls": _UntypedErrors}, ["errors: attention"], {"errors: attention bad input"}, set()),
        ({"graph_cls": _StaleMetadataGraph}, ["graph loop"], {"graph: DECODE replay", "graph: TARGET_VERIFY replay"}, set()),
    ],
    ids=["v-shifted", "swa-mapping-ignored", "no-validation", "window-off-by-one", "sinks-ignored",
         "padding-leaks", "untyped-errors", "stale-graph-metadata"],
)
def test_broken_backend_fails_the_covering_checks(
    backend_kwargs: dict, select: list[str], must_fail: set[str], must_pass: set[str]
) -> None:
    results = run_suite(_backend(**backend_kwargs), build_suite(quick=True, select=select))
    by = _by_status(results)
    failed = _features(by[Status.FAILED])
    assert must_fail <= failed, (must_fail - failed, [(r.check.name, r.status) for r in results])
    for feature in must_pass:
        relevant = [r for r in results if feature in r.check.features]
        assert relevant and all(r.status is Status.PASSED for r in relevant), feature


def test_window_and_sink_defects_spare_the_cases_without_them() -> None:
    for attention_cls, flag in ((_WindowOffByOne, "sliding_window"), (_SinksIgnored, "has_sinks")):
        checks = [c for c in build_suite(quick=True, select=["attention: "]) if not c.name.startswith("attention bad")]
        results = run_suite(_backend(attention_cls=attention_cls), checks)
        for r in results:
            case_uses = "swa" in r.check.name if flag == "sliding_window" else "sinks" in r.check.name
            if flag == "has_sinks" and r.check.name.startswith("attention bad input"):
                case_uses = True  # it calls a sinks layer without sinks, which a sink-ignoring kernel lets through
            if not case_uses:
                assert r.status is Status.PASSED, (r.check.name, r.detail)


def test_declined_configurations_are_unsupported_not_failed() -> None:
    results = run_suite(_backend(attention_cls=_NoBf16), build_suite(quick=True, select=["attention", "graph"]))
    by = _by_status(results)
    assert not by[Status.FAILED], [(r.check.name, r.detail) for r in by[Status.FAILED]]
    assert by[Status.UNSUPPORTED] and all("bfloat16" in r.detail for r in by[Status.UNSUPPORTED])
    assert all("bfloat16" in r.check.name or "bf16" in r.check.name for r in by[Status.UNSUPPORTED])
    assert by[Status.PASSED]


# ---------------------------------------------------------------------------------------------
# the command line


@pytest.fixture
def broken_device() -> Iterator[str]:
    hal.register_backend("brokenv", type(_backend(pool_cls=_ShiftedVPool)))
    yield "brokenv"
    hal.unregister_backend("brokenv")


def test_cli_prints_the_table_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    from hal.tools.cli import main

    assert main(["conformance", "--device", "cpu", "--quick", "-k", "kv pool"]) == 0
    out = capsys.readouterr().out
    assert "| kv pool: round trip" in out and "0 failed" in out


def test_cli_exits_nonzero_on_a_failure(capsys: pytest.CaptureFixture[str], broken_device: str) -> None:
    from hal.tools.cli import main

    assert main(["conformance", "--device", broken_device, "-k", "round trip"]) == 1
    out = capsys.readouterr().out
    assert "failed:" in out and "kv pool round trip" in out


def test_cli_unknown_device_is_one_line_with_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    from hal.tools.cli import main

    assert main(["conformance", "--device", "nosuchdev", "--quick"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "UnknownDeviceError" in err[0] and "nosuchdev" in err[0]


def test_cli_lists_checks_and_rejects_an_empty_selection(capsys: pytest.CaptureFixture[str]) -> None:
    from hal.tools.cli import main

    assert main(["conformance", "--device", "cpu", "--list"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert len(listed) == len(build_suite())
    assert main(["conformance", "--device", "cpu", "-k", "no check is called this"]) == 2


def _hal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hal.tools.cli", *args], capture_output=True, text=True, timeout=120)


def test_hal_help_and_info_through_the_command_line() -> None:
    from hal.tools.cli import COMMANDS

    top = _hal("--help")
    assert top.returncode == 0
    for command in COMMANDS:
        assert command in top.stdout
    info = _hal("info")
    assert info.returncode == 0, info.stderr
    rows = {line.split()[0]: line for line in info.stdout.splitlines() if line.strip()}
    assert rows["cpu"].split()[1] == "yes"
    assert rows["npu"].split()[1] == "no" and "torch_npu" in rows["npu"]  # says why
    assert rows["cuda"].split()[1] == "no"


@pytest.mark.parametrize("command", ["info", "conformance", "bench"])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hal.tools.cli import main

    assert main([command, "--help"]) == 0
    assert "usage: hal" in capsys.readouterr().out


def test_device_defaults_to_cpu_in_every_command() -> None:
    from hal.tools.cli import COMMANDS, build_parser

    parser = build_parser()
    required = {"generate": ["--model", "DIR"]}
    parsed = {command: parser.parse_args([command, *required.get(command, [])]) for command in COMMANDS}
    assert all(getattr(args, "device", "cpu") == "cpu" for args in parsed.values())
    assert {c for c, args in parsed.items() if hasattr(args, "device")} == {"demo", "conformance", "bench", "generate"}


def test_conformance_without_device_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    from hal.tools.cli import main

    assert main(["conformance", "-k", "round trip"]) == 0
    assert "backend 'cpu'" in capsys.readouterr().out


def test_unavailable_device_with_an_emulator_says_emulate_runs_it_here(capsys: pytest.CaptureFixture[str]) -> None:
    from hal.tools.cli import main

    assert main(["conformance", "--device", "npu", "-k", "round trip"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "torch_npu is not installed" in err and "add --emulate to run it here" in err
    assert main(["conformance", "--device", "tpu"]) == 1  # unknown, not unavailable: no hint
    assert "--emulate" not in capsys.readouterr().err
