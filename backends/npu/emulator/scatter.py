"""``npu_scatter_nd_update_`` (torch_npu), in place, with its shape and dtype rules."""

from __future__ import annotations

import torch

from hal.backends.npu.emulator.errors import fail

_SCATTER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.int64)


def npu_scatter_nd_update_(input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """In place: ``input[tuple(indices[k])] = updates[k]`` for every leading index ``k``; returns ``input``."""
    if not 1 <= input.dim() <= 8:
        fail(f"npu_scatter_nd_update_: input must have 1..8 dims, got shape {tuple(input.shape)}")
    if input.dtype not in _SCATTER_DTYPES:
        fail(f"npu_scatter_nd_update_: input dtype {input.dtype} unsupported (one of {list(_SCATTER_DTYPES)})")
    if updates.dtype != input.dtype:
        fail(f"npu_scatter_nd_update_: updates dtype {updates.dtype} must equal the input dtype {input.dtype}")
    if indices.dtype not in (torch.int32, torch.int64):
        fail(f"npu_scatter_nd_update_: indices must be int32 or int64, got {indices.dtype}")
    if indices.dim() < 2:
        fail(f"npu_scatter_nd_update_: indices must be at least 2-D (..., a), got shape {tuple(indices.shape)}")
    a = indices.shape[-1]
    if not 1 <= a <= input.dim():
        fail(f"npu_scatter_nd_update_: indices' last dim {a} must be in 1..input.dim()={input.dim()}")
    want = (*indices.shape[:-1], *input.shape[a:])
    if tuple(updates.shape) != want:
        fail(
            f"npu_scatter_nd_update_: updates shape {tuple(updates.shape)} must be indices.shape[:-1] + "
            f"input.shape[{a}:] = {want}"
        )
    if len({input.device, indices.device, updates.device}) > 1:
        fail("npu_scatter_nd_update_: input, indices and updates must be on one device")
    index = tuple(indices[..., i].long() for i in range(a))
    input.index_put_(index, updates)
    return input
