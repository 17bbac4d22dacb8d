"""The upstream patch SGLang needs for a platform to supply the multi-layer EAGLE draft-extend
runner (``hal/integrations/sglang/patches/``): it applies cleanly to the pinned SGLang source, and
the patched worker asks the platform where the unpatched one branches on ``_is_npu``."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

sglang = pytest.importorskip("sglang")

import hal.integrations.sglang  # noqa: E402

PATCH = Path(hal.integrations.sglang.__file__).parent / "patches" / "multi_layer_eagle_worker_v2_oot_draft_extend_runner.patch"
TARGET = "python/sglang/srt/speculative/multi_layer_eagle_worker_v2.py"


@pytest.fixture
def source_tree(tmp_path: Path) -> Path:
    """The pinned SGLang file at its place in SGLang's repository layout."""
    assert sglang.__version__ == hal.integrations.sglang.TESTED_SGLANG_VERSION
    dest = tmp_path / TARGET
    dest.parent.mkdir(parents=True)
    shutil.copy(Path(sglang.__file__).parent / "srt" / "speculative" / "multi_layer_eagle_worker_v2.py", dest)
    return tmp_path


def git_apply(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "apply", *args, str(PATCH)], cwd=tree, capture_output=True, text=True)


def load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Runner:
    def __init__(self, worker: object) -> None:
        self.worker = worker


class _Platform:
    """An out-of-tree platform that supplies a draft-extend runner and records the question."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def is_out_of_tree(self) -> bool:
        return True

    def get_speculative_graph_runner_cls(self, algorithm: str, phase: str) -> type:
        self.asked.append((algorithm, phase))
        return _Runner


def capture_with(module: types.ModuleType, platform: _Platform) -> object:
    """Run the worker's ``_capture_cuda_graphs`` as on a device with graphs on."""
    module._is_cpu = False
    module._is_npu = False
    module.current_platform = platform
    module.check_cuda_graph_backend = lambda *args: False
    module.get_available_gpu_memory = lambda *args: 0.0
    worker = types.SimpleNamespace(
        speculative_algorithm=types.SimpleNamespace(name="MULTI_LAYER_EAGLE"), device="cpu", gpu_id=0,
        draft_runner_list=[types.SimpleNamespace(attn_backend=types.SimpleNamespace(
            draft_extend_metadata_captured_in_graph=lambda: False, supports_draft_extend_metadata_staging=False,
        ))],
        _specialized_graph_memory_usage={}, _specialized_graph_time_usage={},
    )
    module.MultiLayerEagleMultiStepDraftExtendCudaGraphRunner = lambda w: "built-in runner"
    module.MultiLayerEagleDraftWorker._capture_cuda_graphs(worker)
    return worker.cuda_graph_runner_for_draft_extend


def test_patch_applies_cleanly(source_tree: Path) -> None:
    check = git_apply(source_tree, "--check", "--verbose")
    assert check.returncode == 0, check.stderr
    assert git_apply(source_tree).returncode == 0
    reverse = git_apply(source_tree, "--reverse", "--check")
    assert reverse.returncode == 0, reverse.stderr


def test_patched_worker_takes_the_platforms_runner(source_tree: Path) -> None:
    unpatched = load(source_tree / TARGET, "hal_test_mlew_unpatched")
    platform = _Platform()
    assert capture_with(unpatched, platform) == "built-in runner"
    assert platform.asked == []  # upstream never asks the platform: hence the patch

    assert git_apply(source_tree).returncode == 0
    patched = load(source_tree / TARGET, "hal_test_mlew_patched")
    platform = _Platform()
    runner = capture_with(patched, platform)
    assert isinstance(runner, _Runner)
    assert platform.asked == [("MULTI_LAYER_EAGLE", "draft_extend")]
