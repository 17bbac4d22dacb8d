"""The ``hal`` command line: version, help without torch, lazy sub-commands, installed names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hal
from hal.tools.cli import COMMANDS

TORCH_PROBE = "import sys\n{body}\nprint('torch imported:', 'torch' in sys.modules)\n"


def _python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_version() -> None:
    proc = subprocess.run([sys.executable, "-m", "hal.tools.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"hal {hal.__version__}"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], *([c, "--help"] for c in COMMANDS)])
def test_help_and_version_import_no_torch(argv: list[str]) -> None:
    body = (
        "from hal.tools.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
    )
    proc = _python(TORCH_PROBE.format(body=body))
    assert proc.returncode == 0, proc.stderr
    assert "usage: hal" in proc.stdout or "hal " in proc.stdout
    assert proc.stdout.strip().endswith("torch imported: False"), proc.stdout


def test_import_hal_imports_no_torch_until_a_name_is_used() -> None:
    proc = _python(TORCH_PROBE.format(body="import hal\nassert hal.__version__"))
    assert proc.stdout.strip() == "torch imported: False", proc.stderr
    proc = _python(TORCH_PROBE.format(body="import hal\nassert hal.get_backend('cpu').name == 'cpu'"))
    assert proc.stdout.strip() == "torch imported: True", proc.stderr


def test_public_api_names_resolve() -> None:
    for name in hal.__all__:
        assert getattr(hal, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hal.nope  # noqa: B018
    assert set(hal.__all__) <= set(dir(hal))


def test_installed_names_live_under_hal_only(tmp_path: Path) -> None:
    code = (
        "import importlib.util, hal, hal.backends.npu, hal.backends.cuda, hal.speculative, hal.tools.conformance\n"
        "print([importlib.util.find_spec(n) is None for n in ('backends', 'speculative')])\n"
        "print(hal.backends.npu.NpuBackend.__module__, hal.speculative.MultiLayerEagleWorker.__module__)\n"
    )
    proc = _python(code, cwd=tmp_path)  # outside the repository: only what is installed
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[True, True]", "hal.backends.npu hal.speculative.mtp"]
    fail = _python("import backends", cwd=tmp_path)
    assert fail.returncode != 0 and "No module named 'backends'" in fail.stderr


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hal.speculative import TinyConfig, TinyMiMo

    return Path(TinyMiMo(TinyConfig(num_layers=2, num_mtp_layers=1)).save_pretrained(tmp_path_factory.mktemp("tiny")))


def _bad_invocations(model: Path, tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "not.json").write_text("[[1, 2")
    (tmp / "oov.json").write_text("[[1, 2, 100000]]")
    return [
        (["generate", "--model", str(model), "--prompts-file", str(tmp / "not.json")], "not JSON"),
        (["generate", "--model", str(model), "--prompts-file", str(tmp / "oov.json")], "token id 100000 is outside the vocabulary"),
        (["generate", "--model", str(model), "--prompts-file", str(tmp / "missing.json")], "--prompts-file "),
        (["generate", "--model", str(model), "--prompt-ids", "1,2", "--num-draft-steps", "2"],
         "--num-draft-steps 2 needs --speculative mtp"),
        (["generate", "--model", str(model), "--prompt-ids", "1,2", "--speculative", "mtp", "--num-draft-steps", "5"],
         "--num-draft-steps 5: --speculative mtp needs 1..1"),
        (["generate", "--model", str(model), "--prompt-ids", "1,2", "--devcie", "npu"], "hal generate: unrecognized arguments: --devcie npu"),
        (["demo", "--device", "npu0"], "did you mean 'npu:0'?"),
        (["demo", "--device", "gpu"], "did you mean 'cuda'?"),
        (["demo", "--export", str(tmp / "not.json")], "--export "),
        (["demo", "--export", str(model)], "the directory is not empty"),
        (["generate", "--model", str(model), "--prompt-ids", "1,2", "--max-new-tokens", "-5"], "argument --max-new-tokens: must be an int >= 1, got '-5'"),
        (["generate", "--model", str(model), "--prompt-ids", "1,x"], "--prompt-ids must be comma-separated ints"),
        (["generate", "--model", str(tmp / "nowhere"), "--prompt-ids", "1,2"], "nowhere: no such directory"),
        (["generate", "--model", str(model / "model.safetensors"), "--prompt-ids", "1,2"],
         f"is a file; give the checkpoint directory that holds it (config.json and the safetensors), e.g. --model {model}"),
        (["generate", "--model", str(model), "--prompt-ids", "1,2", "--device", "npu", "--emulate", "--kv-dtype", "float32"],
         "--kv-dtype float32: backend 'npu', layer 0: FIA v2 takes float16/bfloat16"),
        (["demo", "--device", "npu", "--emulate", "--kv-dtype", "float32"], "--kv-dtype float32: backend 'npu'"),
        (["demo", "--export", "/proc/hal-export"], "--export /proc/hal-export: cannot be written"),
        (["generate", "--model", str(model), "--prompt-ids", "1,2", "--tp-timeout", "nan"], "argument --tp-timeout: must be a number > 0"),
        (["demo", "--batch-size", "0"], "argument --batch-size: must be an int >= 1, got '0'"),
        (["demo", "--device", "nosuch"], "unknown device 'nosuch'"),
        (["bench", "--repeats", "two"], "argument --repeats: must be an int >= 1, got 'two'"),
        (["conformance", "--device", "nosuch"], "unknown device 'nosuch'"),
    ]


def test_bad_options_and_files_are_one_line_never_a_traceback(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Through the CLI entry point: one line on stderr naming the option or file, a non-zero exit,
    and for generate nothing loaded (the checks run against config.json first)."""
    for argv, names in _bad_invocations(tiny_checkpoint, tmp_path):
        proc = subprocess.run([sys.executable, "-m", "hal.tools.cli", *argv], capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, (argv, proc.stderr)
        assert names in lines[0] and proc.stdout == "", (argv, lines[0])


def test_progress_is_a_bar_on_a_terminal_and_a_line_per_quarter_elsewhere() -> None:
    import io

    from hal.tools.demo import progress_printer

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    log, tty = io.StringIO(), Terminal()
    for stream in (log, tty):
        show = progress_printer(stream)
        for done in range(31):
            show("loading weights", done, 30, None)
    lines = log.getvalue().splitlines()  # the start, then each quarter crossed
    assert "\r" not in log.getvalue() and [line.split()[-1] for line in lines] == ["0/30", "8/30", "15/30", "23/30", "30/30"]
    assert all(line.startswith("loading weights") for line in lines)
    assert tty.getvalue().count("\r") == 31 and tty.getvalue().endswith("30/30\n")


def test_a_reader_that_leaves_early_is_not_an_error() -> None:
    """``hal conformance --list | head -1``: the pipe closes while hal still writes."""
    proc = subprocess.Popen([sys.executable, "-m", "hal.tools.cli", "conformance", "--list"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()  # the first check's name
    proc.stdout.close()  # head -1 exits
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err


def test_demo_stops_working_once_its_reader_has_gone(tmp_path: Path) -> None:
    """``hal demo | head -1``: the demo stops at its next progress report after the reader left
    (the checkpoint it would export at the end is never written), exit 0, nothing on stderr."""
    export = tmp_path / "export"
    proc = subprocess.Popen([sys.executable, "-m", "hal.tools.cli", "demo", "--no-cache", "--train-sequences", "8",
                             "--train-steps", "400", "--export", str(export)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"generating training data")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 0 and err == "", err
    assert export.is_dir() and not any(export.iterdir())  # made by the up-front check, never filled


def test_an_interrupted_command_says_so_in_one_line() -> None:
    import signal
    import time

    # A shell's background job inherits SIGINT ignored, and Python then keeps it ignored: restore
    # Ctrl-C's default in the child, as a terminal's foreground process has it.
    proc = subprocess.Popen([sys.executable, "-m", "hal.tools.cli", "demo", "--no-cache"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(4)  # into the work (imports and data generation), not a timing assertion
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().splitlines() == ["hal demo: interrupted"], (proc.returncode, err)
