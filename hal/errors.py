"""Typed errors. Every message names the bad value and what was expected."""

from __future__ import annotations


class HalError(Exception):
    """Base of every error hal raises on purpose."""


class UnknownDeviceError(HalError, ValueError):
    """A device string names no registered backend."""


class BackendRegistrationError(HalError, ValueError):
    """A device type is registered twice without ``override=True``."""


class BackendUnavailableError(HalError, RuntimeError):
    """The backend is registered, but this machine lacks what it needs."""


class SpecError(HalError, ValueError):
    """A data contract (spec, metadata) was built with an invalid field."""


class KVLayoutError(HalError, ValueError):
    """A KV write or read does not fit the pool's layout (shape, dtype, device)."""


class CacheLocationError(KVLayoutError, IndexError):
    """A KV cache location lies outside the pool, or in an unmapped SWA page."""


class PoolTooLargeError(HalError, MemoryError):
    """A KV pool would need more bytes than its device has (or than a tensor can hold)."""


class OutOfPagesError(HalError, RuntimeError):
    """The page allocator has fewer free pages than requested."""


class UnsupportedConfigError(HalError, NotImplementedError):
    """The backend cannot run this layer/pool configuration (e.g. a head dim its kernel lacks)."""


class GraphError(HalError, RuntimeError):
    """Graph capture, update or replay was misused."""


class BatchTooLargeError(GraphError, ValueError):
    """A batch is larger than every captured graph and eager fallback is off."""


class ResultMismatchError(HalError, AssertionError):
    """A backend computed something other than the oracle or the baseline it is timed against (``hal bench`` will not time it)."""


class CheckpointError(HalError, ValueError):
    """A model checkpoint that cannot be loaded: a missing file, a missing, unexpected or misshaped
    tensor, an unsupported model type or config value (the message names it)."""


class DistributedError(HalError, RuntimeError):
    """A tensor-parallel group could not start, or one of its ranks failed."""
