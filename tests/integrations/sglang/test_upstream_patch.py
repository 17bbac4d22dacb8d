"""The upstream patches SGLang needs for hal's platform to serve speculative decoding
(``hal/integrations/sglang/patches/``): each applies cleanly to the pinned SGLang source, and each
patched file asks the platform where the unpatched one branches on a device or a fixed table.

The pinned source is the installed file, with the patch reversed when ``.ci/sglang`` has already
applied it to the installed SGLang."""

from __future__ import annotations

import subprocess
import types
from pathlib import Path

import pytest

sglang = pytest.importorskip("sglang")

import torch  # noqa: E402

import hal.integrations.sglang  # noqa: E402
from hal.tools import testing  # noqa: E402

PATCHES = Path(hal.integrations.sglang.__file__).parent / "patches"
WORKER = ("multi_layer_eagle_worker_v2_oot_draft_extend_runner.patch", "python/sglang/srt/speculative/multi_layer_eagle_worker_v2.py")
DRAFT_UTILS = ("draft_utils_platform_draft_backends.patch", "python/sglang/srt/speculative/draft_utils.py")
MIMO_NEXTN = ("mimo_v2_nextn_platform_empty_cache.patch", "python/sglang/srt/models/mimo_v2_nextn.py")
ALLOCATION = ("allocation_get_last_loc_host_tensors.patch", "python/sglang/srt/mem_cache/allocation.py")
GRAPH_SETUP = ("cuda_graph_setup_platform_graph_runner_on_cpu.patch",
               "python/sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py")
GRAPH_MODES = ("model_runner_platform_graph_modes_on_cpu.patch", "python/sglang/srt/model_executor/model_runner.py")
GRAPH_MARKER = ("decode_cuda_graph_runner_capture_marker_without_stream_query.patch",
                "python/sglang/srt/model_executor/runner/decode_cuda_graph_runner.py")
GRAPH_BACKEND = ("runner_backend_platform_graph_backend_on_every_device.patch",
                 "python/sglang/srt/model_executor/runner_backend/utils.py")
PREFILL_TAIL = ("multi_layer_eagle_worker_v2_prefill_draft_extend_window_tail.patch", WORKER[1])
ALL = [WORKER, DRAFT_UTILS, MIMO_NEXTN, ALLOCATION, GRAPH_SETUP, GRAPH_MODES, GRAPH_MARKER, GRAPH_BACKEND, PREFILL_TAIL]


def git_apply(tree: Path, patch: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "apply", *args, str(PATCHES / patch)], cwd=tree, capture_output=True, text=True)


def pinned_source(tmp_path: Path, patch: str, target: str) -> Path:
    """A tree holding the pinned SGLang file at its place in SGLang's repository layout."""
    assert sglang.__version__ == hal.integrations.sglang.TESTED_SGLANG_VERSION
    installed = Path(sglang.__file__).parent.parent / target.removeprefix("python/")
    return testing.pinned_source(tmp_path, installed, target, PATCHES / patch)


def before_and_after(tmp_path: Path, patch: str, target: str) -> tuple[types.ModuleType, types.ModuleType]:
    tree = pinned_source(tmp_path, patch, target)
    before = testing.module_from_file(f"hal_test_{Path(target).stem}_unpatched", tree / target)
    assert git_apply(tree, patch).returncode == 0
    return before, testing.module_from_file(f"hal_test_{Path(target).stem}_patched", tree / target)


@pytest.mark.parametrize(("patch", "target"), ALL, ids=[p for p, _ in ALL])
def test_patch_applies_cleanly(tmp_path: Path, patch: str, target: str) -> None:
    tree = pinned_source(tmp_path, patch, target)
    check = git_apply(tree, patch, "--check", "--verbose")
    assert check.returncode == 0, check.stderr
    assert git_apply(tree, patch).returncode == 0
    reverse = git_apply(tree, patch, "--reverse", "--check")
    assert reverse.returncode == 0, reverse.stderr


class _Runner:
    def __init__(self, worker: object) -> None:
        self.worker = worker


class _Platform:
    """An out-of-tree platform that supplies a draft-extend runner and records the questions."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, ...]] = []

    def is_out_of_tree(self) -> bool:
        return True

    def get_speculative_graph_runner_cls(self, algorithm: str, phase: str) -> type:
        self.asked.append((algorithm, phase))
        return _Runner

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        self.asked.append((algorithm, backend))
        return backend == "plugin-backend"

    def create_speculative_draft_decode_backend(self, backend: str, runner: object, topk: int, num_steps: int) -> object:
        self.asked.append(("draft decode", backend, topk, num_steps))
        return types.SimpleNamespace(runner=runner, attn_backends=[types.SimpleNamespace() for _ in range(num_steps - 1)])

    def empty_cache(self) -> None:
        self.asked.append(("empty_cache",))

    def synchronize(self) -> None:
        self.asked.append(("synchronize",))


def capture_with(module: types.ModuleType, platform: _Platform) -> object:
    """Run the worker's ``_capture_cuda_graphs`` as on a device with graphs on."""
    module._is_cpu = False
    module._is_npu = False
    module.current_platform = platform
    module.check_cuda_graph_backend = lambda *args: False
    module.get_available_gpu_memory = lambda *args: 0.0
    worker = types.SimpleNamespace(
        speculative_algorithm=types.SimpleNamespace(name="EAGLE"), device="cpu", gpu_id=0,
        draft_runner_list=[types.SimpleNamespace(attn_backend=types.SimpleNamespace(
            draft_extend_metadata_captured_in_graph=lambda: False, supports_draft_extend_metadata_staging=False,
        ))],
        _specialized_graph_memory_usage={}, _specialized_graph_time_usage={},
    )
    module.MultiLayerEagleMultiStepDraftExtendCudaGraphRunner = lambda w: "built-in runner"
    module.MultiLayerEagleDraftWorker._capture_cuda_graphs(worker)
    return worker.cuda_graph_runner_for_draft_extend


def test_patched_worker_takes_the_platforms_runner(tmp_path: Path) -> None:
    unpatched, patched = before_and_after(tmp_path, *WORKER)
    platform = _Platform()
    assert capture_with(unpatched, platform) == "built-in runner"
    assert platform.asked == []  # upstream never asks the platform: hence the patch
    platform = _Platform()
    runner = capture_with(patched, platform)
    assert isinstance(runner, _Runner)
    assert platform.asked == [("EAGLE", "multi_layer_draft_extend")]
    # hal's platform answers that question with its runner, and the single-layer worker's
    # ("draft_extend") with SGLang's choice.
    from hal.integrations.sglang.graph import HalMultiLayerEagleDraftExtendRunner
    from hal.integrations.sglang.platform import HalPlatform

    assert HalPlatform().get_speculative_graph_runner_cls("EAGLE", "multi_layer_draft_extend") is HalMultiLayerEagleDraftExtendRunner
    assert HalPlatform().get_speculative_graph_runner_cls("EAGLE", "draft_extend") is None


def draft_extend_backend(module: types.ModuleType, platform: _Platform, backend: str, monkeypatch: pytest.MonkeyPatch) -> object:
    """``DraftBackendFactory.create_draft_extend_backend`` for a server configured with ``backend``."""
    import sglang.srt.layers.attention.attention_registry as registry

    monkeypatch.setattr(registry, "attn_backend_wrapper_for_draft_extend", lambda runner, b: b)
    monkeypatch.setitem(registry.ATTENTION_BACKENDS, "plugin-backend", lambda runner: types.SimpleNamespace(runner=runner))
    module.attention_backends = lambda: (backend, backend)
    module.get_spec = lambda: types.SimpleNamespace(speculative_algorithm="EAGLE", speculative_attention_mode="prefill")
    if hasattr(module, "current_platform"):
        module.current_platform = platform
    runner = types.SimpleNamespace(draft_attention_backend=None)
    return module.DraftBackendFactory(runner, topk=1, speculative_num_steps=3).create_draft_extend_backend()


def draft_decode_backend(module: types.ModuleType, platform: _Platform, backend: str, monkeypatch: pytest.MonkeyPatch) -> object:
    """``DraftBackendFactory.create_decode_backend`` (EAGLE's multi-step draft decode, topk 4, 3 steps)."""
    import sglang.srt.layers.attention.attention_registry as registry

    monkeypatch.setitem(registry.ATTENTION_BACKENDS, "plugin-backend", lambda runner: types.SimpleNamespace(runner=runner))
    module.attention_backends = lambda: (backend, backend)
    module.get_spec = lambda: types.SimpleNamespace(speculative_algorithm="EAGLE", speculative_attention_mode="prefill")
    module._assert_draft_needs_no_conv_sidecar = lambda runner: None
    if hasattr(module, "current_platform"):
        module.current_platform = platform
    runner = types.SimpleNamespace(draft_attention_backend=None)
    return module.DraftBackendFactory(runner, topk=4, speculative_num_steps=3).create_decode_backend()


def test_patched_draft_tables_take_the_platforms_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unpatched, patched = before_and_after(tmp_path, *DRAFT_UTILS)
    with pytest.raises(ValueError, match="EAGLE is not supported in attention backend plugin-backend"):
        draft_extend_backend(unpatched, _Platform(), "plugin-backend", monkeypatch)
    platform = _Platform()
    backend = draft_extend_backend(patched, platform, "plugin-backend", monkeypatch)
    assert backend.prefill_attention_backend_str == backend.decode_attention_backend_str == "plugin-backend"
    assert platform.asked == [("EAGLE", "plugin-backend")]
    # a backend the platform does not vouch for is refused as before
    with pytest.raises(ValueError, match="EAGLE is not supported in attention backend torch_native"):
        draft_extend_backend(patched, _Platform(), "torch_native", monkeypatch)
    # Multi-step draft decode: the fixed table refuses the plugin's backend; patched, the platform builds the container.
    with pytest.raises(ValueError, match="EAGLE is not supported in decode attention backend plugin-backend"):
        draft_decode_backend(unpatched, _Platform(), "plugin-backend", monkeypatch)
    platform = _Platform()
    container = draft_decode_backend(patched, platform, "plugin-backend", monkeypatch)
    assert ("draft decode", "plugin-backend", 4, 3) in platform.asked
    assert len(container.attn_backends) == 2
    assert all(child.decode_attention_backend_str == "plugin-backend" for child in container.attn_backends)
    with pytest.raises(ValueError, match="EAGLE is not supported in decode attention backend torch_native"):
        draft_decode_backend(patched, _Platform(), "torch_native", monkeypatch)


def test_patched_mimo_mtp_asks_the_platform_to_synchronize(tmp_path: Path) -> None:
    unpatched, patched = before_and_after(tmp_path, *MIMO_NEXTN)

    def swap_head(module: types.ModuleType) -> None:
        mtp = module.MiMoV2MTP.__new__(module.MiMoV2MTP)
        torch.nn.Module.__init__(mtp)
        mtp.model = torch.nn.Module()
        mtp.model.embed_tokens = torch.nn.Embedding(4, 2)
        mtp.lm_head = torch.nn.Linear(2, 4)
        mtp.set_embed_and_head(torch.nn.Parameter(torch.ones(4, 2)), torch.nn.Parameter(torch.ones(4, 2)))
        assert torch.equal(mtp.lm_head.weight, torch.ones(4, 2))

    if not torch.cuda.is_available():
        with pytest.raises(AssertionError, match="not compiled with CUDA"):  # upstream calls torch.cuda directly
            swap_head(unpatched)
    platform = _Platform()
    patched.current_platform = platform
    swap_head(patched)
    assert platform.asked == [("empty_cache",), ("synchronize",)]


def test_patched_last_loc_asks_the_tensors_device_not_the_backends_name(tmp_path: Path) -> None:
    """Speculative decoding with pages asks each request's last KV slot; on host tensors upstream
    launches a Triton kernel unless the backend is named "ascend" or "torch_native"."""
    unpatched, patched = before_and_after(tmp_path, *ALLOCATION)
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10) + 100
    pools, prefix = torch.tensor([2, 0, 3]), torch.tensor([4, 0, 10])
    expected = torch.tensor([123, -1, 139])  # slot of position prefix - 1 (hand-computed), -1 for an empty prefix
    launches: list[str] = []

    def triton_launch(*args: object) -> None:  # on a machine without a GPU: "0 active drivers"
        launches.append("triton")
        raise RuntimeError("0 active drivers")

    for module in (unpatched, patched):
        module.attention_backends = lambda: ("hal", "hal")
        module.get_last_loc_triton = triton_launch
    with pytest.raises(RuntimeError, match="0 active drivers"):
        unpatched.get_last_loc(req_to_token, pools, prefix)
    assert launches == ["triton"]
    assert torch.equal(patched.get_last_loc(req_to_token, pools, prefix).long(), expected)
    assert launches == ["triton"]  # the patched helper launched nothing


class _GraphPlatform:
    """A platform whose graph runner class is ``runner`` (None: the in-tree choice)."""

    def __init__(self, runner: type | None) -> None:
        self.runner = runner
        self.device_name = "cpu"

    def get_graph_runner_cls(self) -> type | None:
        return self.runner


def test_patched_graph_setup_captures_on_a_cpu_through_the_platforms_runner(tmp_path: Path) -> None:
    """On a CPU device upstream captures only through torch.compile's CPU graph runner; patched, a
    platform that supplies its own graph runner (hal's, for a backend whose graphs replay without
    Python) gets it built unless graphs are disabled; without one, nothing changes."""
    unpatched, patched = before_and_after(tmp_path, *GRAPH_SETUP)

    class Runner:
        capture_bs = [1, 2]

        def __init__(self, model_runner: object) -> None:
            self.model_runner = model_runner

    def decode_capture(module: types.ModuleType, platform: _GraphPlatform, disabled: bool = False) -> object:
        module.current_platform = platform
        module.check_cuda_graph_backend = lambda phase, backend: disabled and backend == module.Backend.DISABLED
        module.get_flags = lambda: types.SimpleNamespace(capture=types.SimpleNamespace(enable_torch_compile=False))
        module.get_disagg = lambda: types.SimpleNamespace(disaggregation_mode="null")
        module.get_model = lambda: types.SimpleNamespace(model_impl="auto")
        module.get_available_gpu_memory = lambda *args: 0.0
        module.get_exec = lambda: types.SimpleNamespace(graph=types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(
            decode=types.SimpleNamespace(backend="full"))))
        model_runner = types.SimpleNamespace(
            is_draft_worker=False, is_generation=True, device="cpu", gpu_id=0,
            spec_algorithm=types.SimpleNamespace(is_speculative=lambda: False),
        )
        return module.capture_decode_graph(model_runner=model_runner).runner

    assert decode_capture(unpatched, _GraphPlatform(Runner)) is None
    built = decode_capture(patched, _GraphPlatform(Runner))
    assert isinstance(built, Runner)
    assert decode_capture(patched, _GraphPlatform(None)) is None  # no platform runner: as upstream
    assert decode_capture(patched, _GraphPlatform(Runner), disabled=True) is None  # --disable-cuda-graph holds


def test_patched_model_runner_replays_verify_graphs_on_a_cpu_through_the_platforms_runner(tmp_path: Path) -> None:
    """Which forward modes may replay a graph on a CPU device: upstream, decode only (torch.compile's
    CPU graphs); patched, with a platform graph runner, decode and target verify, as on a device."""
    import ast

    from sglang.srt.model_executor.forward_batch_info import ForwardMode as modes

    tree = pinned_source(tmp_path, *GRAPH_MODES)
    unpatched = (tree / GRAPH_MODES[1]).read_text()
    assert git_apply(tree, GRAPH_MODES[0]).returncode == 0
    patched = (tree / GRAPH_MODES[1]).read_text()

    def graph_modes(source: str, platform: _GraphPlatform) -> set[str]:
        """The modes the runner's ``mode_check`` expression admits on a CPU device (the expression
        itself, evaluated on a CPU model runner and each forward mode)."""
        tree = ast.parse(source)
        checks = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "mode_check" for t in n.targets)]
        assert len(checks) == 1
        expression = compile(ast.Expression(checks[0]), "mode_check", "eval")
        admitted = set()
        for mode in (modes.DECODE, modes.TARGET_VERIFY, modes.EXTEND):
            check = eval(expression, {"current_platform": platform},  # noqa: S307 - SGLang's own expression
                         {"self": types.SimpleNamespace(device="cpu"), "forward_batch": types.SimpleNamespace(forward_mode=mode)})
            if check():
                admitted.add(mode.name)
        return admitted

    assert graph_modes(unpatched, _GraphPlatform(object)) == {"DECODE"}
    assert graph_modes(patched, _GraphPlatform(object)) == {"DECODE", "TARGET_VERIFY"}
    assert graph_modes(patched, _GraphPlatform(None)) == {"DECODE"}  # no platform runner: as upstream


def test_patched_capture_marker_runs_where_the_device_module_cannot_say_it_captures(tmp_path: Path) -> None:
    """``torch.cpu`` has no ``is_current_stream_capturing``: upstream's capture marker raises on a CPU
    device; patched, a module without it is treated as not capturing (no marker event to record)."""
    unpatched, patched = before_and_after(tmp_path, *GRAPH_MARKER)
    assert not hasattr(torch.cpu, "is_current_stream_capturing")
    for module, raises in ((unpatched, True), (patched, False)):
        runner = module.DecodeCudaGraphRunner.__new__(module.DecodeCudaGraphRunner)
        runner.device_module = torch.cpu
        runner.in_graph_metadata_prep_done = None
        if raises:
            with pytest.raises(AttributeError, match="is_current_stream_capturing"):
                runner._record_in_graph_metadata_prep_done()
        else:
            runner._record_in_graph_metadata_prep_done()
            assert runner.in_graph_metadata_prep_done is None


def test_patched_decode_graphs_go_through_the_platforms_graph_backend_on_an_npu(tmp_path: Path) -> None:
    """On an NPU device upstream takes SGLang's own NPU graph backend whatever the platform says, so
    hal's platform on Ascend would capture hal's attention through a backend that replays FIA on the
    captured lengths (which hal's attention refuses); patched, an out-of-tree platform's full graph
    backend serves the NPU too. In-tree platforms and other graph modes are as upstream."""
    unpatched, patched = before_and_after(tmp_path, *GRAPH_BACKEND)

    class PlatformGraphs:
        def __init__(self, runner: object, *, enable_memory_saver: bool = False) -> None:
            self.runner = runner

    class Platform:
        def __init__(self, out_of_tree: bool) -> None:
            self.out_of_tree = out_of_tree

        def is_out_of_tree(self) -> bool:
            return self.out_of_tree

        def get_full_graph_backend_cls(self) -> type:
            return PlatformGraphs

    def resolved(module: types.ModuleType, device: str, out_of_tree: bool = True, mode: str = "full") -> str:
        module.current_platform = Platform(out_of_tree)
        module.get_exec = lambda: types.SimpleNamespace(
            graph=types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(decode=types.SimpleNamespace(backend=mode)),
                                        debug_cuda_graph=False),
            features=types.SimpleNamespace(enable_memory_saver=False))
        module.FullCudaGraphBackend = type("FullCudaGraphBackend", (PlatformGraphs,), {})  # SGLang's, which needs CUDA
        runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(device=device))
        try:
            return type(module.resolve_decode_backend(runner)).__name__
        except Exception:  # SGLang's NPU graph backend, which needs torch_npu to be built
            return "NPUCudaGraphBackend"

    assert resolved(unpatched, "npu") == "NPUCudaGraphBackend"
    assert resolved(patched, "npu") == resolved(patched, "cpu") == resolved(unpatched, "cpu") == "PlatformGraphs"
    assert resolved(patched, "npu", out_of_tree=False) == resolved(unpatched, "npu", out_of_tree=False)
    assert resolved(patched, "cpu", out_of_tree=False) == resolved(unpatched, "cpu", out_of_tree=False) == "FullCudaGraphBackend"


def test_patched_prefill_draft_extend_cuts_to_the_window_tail_only_where_nothing_reads_before_it(tmp_path: Path) -> None:
    """What the window-tail patch cuts (each request's last W + 1 new rows, as a prefix-extended
    batch) and where it runs the whole prefill: a radix cache, a draft layer without a window,
    chain-style hidden states, logprobs. Upstream has no cut; the engine test
    (``test_mimo_mtp_engine.py``) shows the cut drafts what the whole extend drafts."""
    unpatched, patched = before_and_after(tmp_path, *PREFILL_TAIL)
    assert not hasattr(unpatched.MultiLayerEagleDraftWorker, "_prefill_window_tail")
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    def draft_layer(window: int) -> RadixAttention:
        layer = RadixAttention.__new__(RadixAttention)
        torch.nn.Module.__init__(layer)
        layer.sliding_window_size = window
        return layer

    def tail(windows: tuple[int, ...] = (16, 16), radix: bool = False, chain: bool = False, logprob: bool = False,
             mode: ForwardMode = ForwardMode.EXTEND) -> object:
        worker = types.SimpleNamespace(
            server_args=types.SimpleNamespace(disable_radix_cache=not radix), chain_mtp_hidden_states=chain,
            draft_runner_list=[types.SimpleNamespace(model=torch.nn.Sequential(draft_layer(w))) for w in windows],
        )
        worker._draft_layers_window = types.MethodType(patched.MultiLayerEagleDraftWorker._draft_layers_window, worker)
        batch = types.SimpleNamespace(
            forward_mode=mode, return_logprob=logprob, input_embeds=None, multimodal_inputs=[None, None, None],
            input_ids=torch.arange(100, 150), out_cache_loc=torch.arange(1000, 1050), prefix_lens=[0, 7, 3],
            extend_lens=[30, 5, 15], extend_num_tokens=50, extend_logprob_start_lens=[0, 0, 0],
        )
        return patched.MultiLayerEagleDraftWorker._prefill_window_tail(worker, batch, kv_loc_plan=object())

    cut, rows = tail()
    # W + 1 = 17 rows of the 30-token request (rows 13..29), all of the 5- and 15-token ones
    assert rows.tolist() == list(range(13, 30)) + list(range(30, 50))
    assert cut.input_ids.tolist() == [100 + r for r in rows.tolist()]
    assert cut.out_cache_loc.tolist() == [1000 + r for r in rows.tolist()]
    assert (cut.prefix_lens, cut.extend_lens, cut.extend_num_tokens) == ([13, 7, 3], [17, 5, 15], 37)
    assert tail(windows=(4, 4))[0].extend_lens == [5, 5, 5]
    assert tail(windows=(40, 40)) is None  # every request fits in the tail: nothing to cut
    for whole in (tail(radix=True), tail(windows=(16, -1)), tail(windows=(16, 8)), tail(chain=True), tail(logprob=True),
                  tail(mode=ForwardMode.MIXED)):
        assert whole is None
