"""Start-up of every Python process in hal's SGLang test environment (on PYTHONPATH there).

torchvision's registry wheel is a CUDA build: beside a CPU torch its C extension does not load, and
its import then fails registering fake kernels for two ops nobody defined. Declaring their schemas
first lets the pure-Python parts SGLang imports load; the ops themselves stay unimplemented.
"""

import os

import torch


def _declare_missing_torchvision_ops() -> None:
    for name in ("nms", "qnms"):
        try:
            getattr(torch.ops.torchvision, name)
        except (AttributeError, RuntimeError):
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


_declare_missing_torchvision_ops()


_WRAPS: dict = {}  # module name -> the wraps to call on it, in the order they were asked for


def _after_import(target: str, wrap) -> None:  # type: ignore[no-untyped-def]
    """Call ``wrap(module)`` right after the module named ``target`` is executed, in this process."""
    import importlib.abc
    import importlib.machinery
    import sys

    if target in _WRAPS:
        _WRAPS[target].append(wrap)
        return
    _WRAPS[target] = [wrap]

    class _Wrap(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path_, target_=None):  # type: ignore[no-untyped-def]
            if fullname != target:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path_)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_wrap(module):  # type: ignore[no-untyped-def]
                exec_module(module)
                for each in _WRAPS[target]:
                    each(module)

            spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Wrap())


def _log_hal_forwards(path: str) -> None:
    """Append ``<mode> <KV pool class>`` for every forward the attention backend ``hal`` prepares
    to ``path``, in any process: the Engine tests read it to tell what served a request. With
    ``HAL_SGLANG_EXTEND_LOG`` set, also ``<prefix lens> <extend lens>`` (comma-separated) of every
    EXTEND forward to that file, in order: a prefill's target forward, then its draft extends."""
    extend_path = os.environ.get("HAL_SGLANG_EXTEND_LOG")

    def wrap(module):  # type: ignore[no-untyped-def]
        cls = module.HalAttnBackend
        original = cls.init_forward_metadata

        def init_forward_metadata(self, forward_batch):  # type: ignore[no-untyped-def]
            original(self, forward_batch)
            tree = " tree" if getattr(self.forward_metadata, "tree_mask", None) is not None else ""
            with open(path, "a") as log:
                log.write(f"{forward_batch.forward_mode.name} {type(self.sgl_pool).__name__}{tree}\n")
            if extend_path and forward_batch.forward_mode.name == "EXTEND":
                lens = (forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu)
                with open(extend_path, "a") as log:
                    log.write(" ".join(",".join(str(n) for n in column) for column in lens) + "\n")

        cls.init_forward_metadata = init_forward_metadata

    def wrap_draft(module):  # type: ignore[no-untyped-def]
        multi_step = module.HalMultiStepDraftBackend
        original_multi_step = multi_step.init_forward_metadata

        def init_multi_step_metadata(self, forward_batch):  # type: ignore[no-untyped-def]
            original_multi_step(self, forward_batch)
            with open(path, "a") as log:
                log.write(f"DRAFT_DECODE_STEPS topk={self.topk} steps={self.speculative_num_steps}\n")

        multi_step.init_forward_metadata = init_multi_step_metadata

    _after_import("hal.integrations.sglang.attention", wrap)
    _after_import("hal.integrations.sglang.draft", wrap_draft)


def _log_npu_emulator_calls(path: str) -> None:
    """Append one word per call of hal's emulated Ascend runtime to ``path``, in any process:
    ``FIA`` (an eager or capturing FIA v2 call), ``SCATTER`` (a K/V write), ``CAPTURE`` (an NPUGraph
    captured), ``REPLAY`` and ``UPDATE`` (a replay and the host-parameter update it took). The engine
    tests read it to tell that hal's Ascend path served a request."""

    def logged(word, fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            result = fn(*args, **kwargs)
            with open(path, "a") as log:
                log.write(word + "\n")
            return result

        return call

    def wrap(module):  # type: ignore[no-untyped-def]
        ops = module.npu_runtime().torch_npu
        ops.npu_fused_infer_attention_score_v2 = logged("FIA", ops.npu_fused_infer_attention_score_v2)
        ops.npu_scatter_nd_update_ = logged("SCATTER", ops.npu_scatter_nd_update_)
        graph = module.NPUGraph
        graph.capture_end = logged("CAPTURE", graph.capture_end)
        graph.replay = logged("REPLAY", graph.replay)
        graph.update = logged("UPDATE", graph.update)

    _after_import("hal.backends.npu.emulator", wrap)


def _log_prefill_drafts(path: str) -> None:
    """Append one JSON line per request of every prefill's draft extend (multi-layer EAGLE) to
    ``path``, in any process: its prompt length, and each draft step's token and probability."""

    def wrap(module):  # type: ignore[no-untyped-def]
        import json

        worker = module.MultiLayerEagleDraftWorker
        original = worker._draft_extend_for_prefill

        def draft_extend_for_prefill(self, batch, *args, **kwargs):  # type: ignore[no-untyped-def]
            drafts = original(self, batch, *args, **kwargs)
            with open(path, "a") as log:
                for length, tokens, probs in zip(batch.seq_lens_cpu.tolist(), drafts.topk_index.tolist(), drafts.topk_p.tolist()):
                    log.write(json.dumps({"prompt": length, "tokens": tokens, "probs": probs}) + "\n")
            return drafts

        worker._draft_extend_for_prefill = draft_extend_for_prefill

    _after_import("sglang.srt.speculative.multi_layer_eagle_worker_v2", wrap)


def _whole_prefill_draft_extend() -> None:
    """Run every prefill's draft extend over the whole prompt, as upstream's does (hal's patch in
    ``patches/`` cuts it to the draft window's tail): the before of a before/after comparison."""

    def wrap(module):  # type: ignore[no-untyped-def]
        module.MultiLayerEagleDraftWorker._prefill_window_tail = lambda self, batch, kv_loc_plan: None

    _after_import("sglang.srt.speculative.multi_layer_eagle_worker_v2", wrap)


if os.environ.get("HAL_SGLANG_WHOLE_PREFILL_DRAFT_EXTEND") == "1":
    _whole_prefill_draft_extend()
if os.environ.get("HAL_SGLANG_PREFILL_DRAFT_LOG"):
    _log_prefill_drafts(os.environ["HAL_SGLANG_PREFILL_DRAFT_LOG"])
if os.environ.get("HAL_SGLANG_FORWARD_LOG"):
    _log_hal_forwards(os.environ["HAL_SGLANG_FORWARD_LOG"])
if os.environ.get("HAL_NPU_EMULATOR_LOG"):
    _log_npu_emulator_calls(os.environ["HAL_NPU_EMULATOR_LOG"])
