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


def _after_import(target: str, wrap) -> None:  # type: ignore[no-untyped-def]
    """Call ``wrap(module)`` right after the module named ``target`` is executed, in this process."""
    import importlib.abc
    import importlib.machinery
    import sys

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
                wrap(module)

            spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Wrap())


def _log_hal_forwards(path: str) -> None:
    """Append ``<mode> <KV pool class>`` for every forward the attention backend ``hal`` prepares
    to ``path``, in any process: the Engine tests read it to tell what served a request."""

    def wrap(module):  # type: ignore[no-untyped-def]
        cls = module.HalAttnBackend
        original = cls.init_forward_metadata

        def init_forward_metadata(self, forward_batch):  # type: ignore[no-untyped-def]
            original(self, forward_batch)
            tree = " tree" if getattr(self.forward_metadata, "tree_mask", None) is not None else ""
            with open(path, "a") as log:
                log.write(f"{forward_batch.forward_mode.name} {type(self.sgl_pool).__name__}{tree}\n")

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


if os.environ.get("HAL_SGLANG_FORWARD_LOG"):
    _log_hal_forwards(os.environ["HAL_SGLANG_FORWARD_LOG"])
if os.environ.get("HAL_NPU_EMULATOR_LOG"):
    _log_npu_emulator_calls(os.environ["HAL_NPU_EMULATOR_LOG"])
