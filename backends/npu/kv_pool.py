"""The split K/V pool on Ascend: 2 MiB-aligned buffers, KV writes by ``npu_scatter_nd_update_``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hal.backends.npu.runtime import NpuRuntime
from hal.sdk import KVPoolSpec, SpecError, SplitKVPool

BUFFER_ALIGNMENT = 2 * 1024 * 1024  # bytes; large-page aligned buffers suit HCCL/RDMA registration


def aligned_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, alignment: int) -> torch.Tensor:
    """A zeroed contiguous tensor of ``shape`` whose first element sits at an ``alignment``-byte address."""
    elem = torch.empty((), dtype=dtype).element_size()
    if alignment % elem:
        raise ValueError(f"alignment {alignment} is not a multiple of the element size {elem}")
    numel = math.prod(shape)
    raw = torch.zeros(numel + alignment // elem, dtype=dtype, device=device)
    offset = (-raw.data_ptr() % alignment) // elem
    return raw[offset : offset + numel].view(shape)


class NpuKVPool(SplitKVPool):
    """``SplitKVPool`` whose K and V sub-pool tensors are separate, aligned allocations, written
    through ``runtime`` (its backend's torch_npu handles; the attention kernel over it uses them too)."""

    def __init__(
        self,
        spec: KVPoolSpec,
        device: torch.device | str = "cpu",
        *,
        runtime: NpuRuntime,
        storage: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        if not isinstance(runtime, NpuRuntime):
            raise SpecError(f"NpuKVPool: runtime must be an NpuRuntime (its backend's), got {type(runtime).__name__}")
        self.runtime = runtime
        super().__init__(spec, device, storage=storage)

    def _allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        return aligned_zeros(shape, self.spec.dtype, self.device, BUFFER_ALIGNMENT)

    def _write_rows(self, buffer: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
        # buffer is one layer as [slots, heads, dim] (3-D: the 4-D [slot, 1, heads, dim] form fails
        # tiling on the device); K and V are written separately, each with its own head dim.
        if loc.shape[0] == 0:
            return
        self.runtime.torch_npu.npu_scatter_nd_update_(buffer, loc.view(-1, 1), rows)
