"""Everything a backend author needs, in one module; a backend imports from here and nowhere else.

Adding a backend (device type ``mydev``; ``tests/tools/oot_backend/site/hal_oot_example`` is a complete one):

1. **Pool**: subclass ``SplitKVPool``; override ``_allocate(shape)`` and ``_write_rows(buffer, loc,
   rows)`` only where your memory or write op differs. Layout, SWA mapping and validation come with it.
2. **Kernel**: subclass ``AttentionKernelBase`` and implement ``_attend(q, layer, plan, sinks)``;
   where your op has limits, the classmethod ``unsupported_reason(layer, kv_dtype, page_size,
   max_q_len, batch_size)`` (a sentence, or None): ``Backend.unsupported_reason`` answers with it
   before anything is built, and ``forward`` (which validates every argument) raises it as an
   ``UnsupportedConfigError`` before writing K/V, then calls ``_attend`` (an op that writes the new
   K/V as it attends overrides ``_write_and_attend`` and asks ``pool.slots_for_forward`` where the
   rows go; one that writes its result into the caller's ``out`` overrides ``_attend_into``, else
   ``forward`` copies it there). Route SWA layers with
   ``self.block_table(layer, plan.metadata)``; what you derive from the metadata for a kind of
   layer goes in ``plan.per_layer_kind`` (once per forward). Set ``seq_len_fill_value``. Verify
   batches over draft trees (``metadata.tree_mask``, ``hal.tree``; ``tree_depths`` gives positions)
   reach ``_attend`` only if the class sets ``serves_trees = True``; otherwise they are refused.
3. **Host-side op arguments** (like FIA's ``actual_seq_kvlen``, baked into a captured op): call
   ``self.record_updatable_call(layer)`` where each such op is issued and return its arguments from
   ``updatable_params(metadata, layer)``. Kernels that read only device tensors do neither.
4. **Graph**: subclass ``GraphBase`` and implement ``_capture(fn, memory_pool)`` and
   ``_replay(host_params)`` (one mapping per captured call; set ``takes_host_params = True`` if your
   graph applies them); its constructor takes the keyword ``tp_group`` and passes it on to
   ``GraphBase.__init__``. Capture span, warm-up, TP barrier and buffer copies come with it.
   Without a graph runtime use ``EagerGraph``.
5. **Backend**: subclass ``BackendBase``: ``name``, ``device_type``, ``collective_backend``,
   ``kv_pool_class``, ``attention_class``, ``graph_class``, ``default_page_size`` (one the kernel
   takes in every mode), ``preferred_dtype`` (weights), ``host_memory = True`` if its tensors
   live on the host, a cheap ``probe()`` that never imports
   the vendor runtime eagerly, ``auto_priority`` if ``"auto"`` may pick it; override
   ``synchronize``/``graph_memory_pool`` where they are not no-ops. Optional
   ``probe_emulation()`` classmethod and an ``emulated`` keyword on ``__init__`` for ``emulate=True``
   (the emulator reached through the instance, never installed process-wide).
6. **Register** it from your distribution's ``pyproject.toml``::

       [project.entry-points."hal.backends"]
       mydev = "my_package.backend:MyBackend"

   or at run time: ``hal.register_backend("mydev", "my_package.backend:MyBackend")``.
7. **Check** it: ``hal info`` (availability and why), then ``hal conformance --device mydev``, which
   holds your kernel to ``paged_oracle`` (``hal.oracle``: the definition, as dense float64 math).
"""

from hal.attention import AttentionKernelBase
from hal.backend import BackendBase, host_memory_bytes
from hal.errors import (
    BackendUnavailableError,
    CacheLocationError,
    GraphError,
    HalError,
    KVLayoutError,
    SpecError,
    UnsupportedConfigError,
)
from hal.graph import EagerGraph, GraphBase, GraphUpdate, copy_into, is_capturing
from hal.kv_pool import SplitKVPool, copy_rows
from hal.metadata import AttentionMetadata
from hal.plan import ForwardPlan
from hal.protocols import Availability, KVPool
from hal.oracle import OracleAttention, dense_attention, paged_oracle
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec
from hal.tree import tree_depths

__all__ = [
    "AttentionKernelBase",
    "AttentionMetadata",
    "Availability",
    "BackendBase",
    "BackendUnavailableError",
    "CacheLocationError",
    "EagerGraph",
    "ForwardMode",
    "ForwardPlan",
    "GraphBase",
    "GraphError",
    "GraphUpdate",
    "HalError",
    "KVLayoutError",
    "KVPool",
    "KVPoolSpec",
    "LayerSpec",
    "OracleAttention",
    "SpecError",
    "SplitKVPool",
    "UnsupportedConfigError",
    "copy_into",
    "copy_rows",
    "dense_attention",
    "host_memory_bytes",
    "is_capturing",
    "paged_oracle",
    "tree_depths",
]
