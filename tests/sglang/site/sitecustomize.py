"""Start-up of every Python process in hal's SGLang test environment (on PYTHONPATH there).

torchvision's registry wheel is a CUDA build: beside a CPU torch its C extension does not load, and
its import then fails registering fake kernels for two ops nobody defined. Declaring their schemas
first lets the pure-Python parts SGLang imports load; the ops themselves stay unimplemented.
"""

import torch


def _declare_missing_torchvision_ops() -> None:
    for name in ("nms", "qnms"):
        try:
            getattr(torch.ops.torchvision, name)
        except (AttributeError, RuntimeError):
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


_declare_missing_torchvision_ops()
