"""An out-of-tree hal backend, written the way a third party would: nothing in hal/ changes.

It registers the device type ``oot`` through the ``hal.backends`` entry point of its
distribution (see ``hal_oot_example-0.1.0.dist-info/entry_points.txt``) or programmatically
with ``hal.register_backend("oot", "hal_oot_example:OotBackend")``.

What it shows:
- ``ArenaKVPool``: its own allocation (every sub-pool carved from one flat arena) and its own
  row writes (``index_put_``), inheriting hal's split-K/V layout and validation.
- ``HostLenAttention``: a kernel whose op takes *host-side* lengths, like Ascend FIA's
  ``actual_seq_kvlen``. A captured call keeps the lengths it was captured with until the
  graph update replaces them, so it declares them in ``updatable_params``.
- ``ReplayGraph``: a Graph that bakes those host parameters at capture and applies
  ``GraphUpdate.host_params`` on replay, one mapping per captured call.
"""

from hal_oot_example.backend import ArenaKVPool, HostLenAttention, OotBackend, ReplayGraph

__all__ = ["ArenaKVPool", "HostLenAttention", "OotBackend", "ReplayGraph"]
