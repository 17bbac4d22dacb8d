"""hal: a hardware abstraction layer for LLM inference engines.

    import hal
    be = hal.get_backend("npu:0")          # or "cuda", "cpu", "auto"
    pool = be.create_kv_pool(spec)         # split K/V buffers, paged
    attn = be.create_attention(pool)       # FIA v2 on NPU, Triton on GPU, torch on CPU
    graph = be.create_graph()              # NPUGraph / CUDAGraph / eager

Layers, each importing only those below it:
``hal.tools`` (CLI, conformance kit, bench, pytest plugin, testing helpers) ->
``hal.speculative`` (MTP worker, models) and ``hal.backends.*`` (cpu, npu, cuda) ->
the core (this package's modules; ``hal.sdk`` is the backend author's view of it).

The names below load on first use, so ``import hal`` (and ``hal --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> defining module
_EXPORTS = {
    "KVAllocator": "hal.allocator",
    "PageAllocator": "hal.allocator",
    "RequestPageTable": "hal.allocator",
    "BackendRegistrationError": "hal.errors",
    "BackendUnavailableError": "hal.errors",
    "BatchTooLargeError": "hal.errors",
    "CacheLocationError": "hal.errors",
    "CheckpointError": "hal.errors",
    "DistributedError": "hal.errors",
    "GraphError": "hal.errors",
    "HalError": "hal.errors",
    "KVLayoutError": "hal.errors",
    "OutOfPagesError": "hal.errors",
    "ResultMismatchError": "hal.errors",
    "SpecError": "hal.errors",
    "UnknownDeviceError": "hal.errors",
    "UnsupportedConfigError": "hal.errors",
    "TPGroup": "hal.distributed",
    "init_tensor_parallel": "hal.distributed",
    "GraphUpdate": "hal.graph",
    "GraphRunner": "hal.graph_runner",
    "SplitKVPool": "hal.kv_pool",
    "AttentionMetadata": "hal.metadata",
    "build_metadata": "hal.metadata",
    "ForwardPlan": "hal.plan",
    "AttentionKernel": "hal.protocols",
    "Availability": "hal.protocols",
    "Backend": "hal.protocols",
    "Graph": "hal.protocols",
    "KVPool": "hal.protocols",
    "get_backend": "hal.registry",
    "list_backends": "hal.registry",
    "parse_device": "hal.registry",
    "register_backend": "hal.registry",
    "unregister_backend": "hal.registry",
    "ForwardMode": "hal.spec",
    "KVPoolSpec": "hal.spec",
    "LayerSpec": "hal.spec",
    "SWAPoolSpec": "hal.spec",
    "tree_mask_from_parents": "hal.tree",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from hal.allocator import KVAllocator, PageAllocator, RequestPageTable
    from hal.errors import (
        BackendRegistrationError,
        BackendUnavailableError,
        BatchTooLargeError,
        CacheLocationError,
        CheckpointError,
        DistributedError,
        GraphError,
        HalError,
        KVLayoutError,
        OutOfPagesError,
        ResultMismatchError,
        SpecError,
        UnknownDeviceError,
        UnsupportedConfigError,
    )
    from hal.distributed import TPGroup, init_tensor_parallel
    from hal.graph import GraphUpdate
    from hal.graph_runner import GraphRunner
    from hal.kv_pool import SplitKVPool
    from hal.metadata import AttentionMetadata, build_metadata
    from hal.plan import ForwardPlan
    from hal.protocols import AttentionKernel, Availability, Backend, Graph, KVPool
    from hal.registry import get_backend, list_backends, parse_device, register_backend, unregister_backend
    from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec
    from hal.tree import tree_mask_from_parents
