"""hal: a hardware abstraction layer for LLM inference engines.

    import hal
    be = hal.get_backend("npu:0")          # or "cuda", "cpu", "auto"
    pool = be.create_kv_pool(spec)         # split K/V buffers, paged
    attn = be.create_attention(pool)       # FIA v2 on NPU, Triton on GPU, torch on CPU
    graph = be.create_graph()              # NPUGraph / CUDAGraph / eager
"""

from hal.allocator import KVAllocator, PageAllocator, RequestPageTable
from hal.errors import (
    BackendRegistrationError,
    BackendUnavailableError,
    BatchTooLargeError,
    CacheLocationError,
    GraphError,
    HalError,
    KVLayoutError,
    OutOfPagesError,
    ResultMismatchError,
    SpecError,
    UnknownDeviceError,
    UnsupportedConfigError,
)
from hal.graph import GraphUpdate
from hal.graph_runner import GraphRunner
from hal.kv_pool import SplitKVPool
from hal.metadata import AttentionMetadata, build_metadata
from hal.protocols import AttentionKernel, Availability, Backend, Graph, KVPool
from hal.registry import get_backend, list_backends, parse_device, register_backend, unregister_backend
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec

__version__ = "0.1.0"

__all__ = [
    "AttentionKernel",
    "AttentionMetadata",
    "Availability",
    "Backend",
    "BackendRegistrationError",
    "BackendUnavailableError",
    "BatchTooLargeError",
    "CacheLocationError",
    "ForwardMode",
    "Graph",
    "GraphError",
    "GraphRunner",
    "GraphUpdate",
    "HalError",
    "KVAllocator",
    "KVLayoutError",
    "KVPool",
    "KVPoolSpec",
    "LayerSpec",
    "OutOfPagesError",
    "ResultMismatchError",
    "PageAllocator",
    "RequestPageTable",
    "SWAPoolSpec",
    "SpecError",
    "SplitKVPool",
    "UnknownDeviceError",
    "UnsupportedConfigError",
    "build_metadata",
    "get_backend",
    "list_backends",
    "parse_device",
    "register_backend",
    "unregister_backend",
]
