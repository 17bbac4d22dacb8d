"""Device string -> backend bundle, resolved lazily.

Registering a backend stores an import path; nothing is imported until ``get_backend``
(or ``list_backends``) asks for it, so ``import hal`` never pulls in torch_npu or triton.
Third-party backends register through the entry-point group ``hal.backends``::

    [project.entry-points."hal.backends"]
    mydev = "my_package.backend:MyBackend"

``"auto"`` tries every registered backend that declares an ``auto_priority`` (a class attribute,
higher first; built-ins: npu 300, cuda 200, cpu 0) and returns the first available one. A backend
without one is used only when named. Looking up priorities imports each backend's module (never
its vendor runtime: backend modules import that lazily).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import threading
from typing import Any

import attrs
import torch

from hal.errors import BackendRegistrationError, BackendUnavailableError, UnknownDeviceError
from hal.protocols import Availability, Backend

ENTRY_POINT_GROUP = "hal.backends"

_BUILTIN = {
    "cpu": "hal.backends.cpu:CpuBackend",
    "npu": "hal.backends.npu:NpuBackend",
    "cuda": "hal.backends.cuda:CudaBackend",
}
_INSTALL_HINT = {
    "npu": "install the Ascend extra (pip install '.[npu]') and the Ascend CANN toolkit",
    "cuda": "install the CUDA extra (pip install '.[cuda]') and a CUDA build of torch on a machine with an NVIDIA GPU",
}
_DEVICE_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::(\d+))?$")


@attrs.frozen
class BackendInfo:
    """One row of ``list_backends()``: where a device type comes from and whether it can run here."""
    device_type: str
    target: str  # "module:Class" or a class's qualname
    source: str  # builtin / entry point / registered
    availability: Availability
    collective_backend: str = "-"  # hccl / nccl / gloo; "-" when the class cannot be imported
    auto_priority: int | None = None  # where "auto" tries it (higher first); None: never


@attrs.define
class _Entry:
    target: str | type
    source: str


_lock = threading.RLock()
_entries: dict[str, _Entry] = {k: _Entry(v, "builtin") for k, v in _BUILTIN.items()}
_instances: dict[tuple[str, int | None, bool], Any] = {}
_entry_points_loaded = False


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        name = ep.name.lower()  # parse_device lower-cases what it looks up
        if name not in _entries or _entries[name].source != "registered":
            _entries[name] = _Entry(ep.value, f"entry point ({ep.dist.name if ep.dist else '?'})")


def register_backend(device_type: str, target: str | type, *, override: bool = False) -> None:
    """Register ``target`` ("module:Class" or a class) for ``device_type``; imports nothing.

    Device types are case-insensitive (stored lower-case), as ``get_backend`` looks them up.
    """
    if not isinstance(device_type, str) or not _DEVICE_RE.match(device_type) or ":" in device_type:
        raise UnknownDeviceError(f"register_backend: {device_type!r} is not a valid device type name")
    device_type = device_type.lower()
    with _lock:
        _load_entry_points()
        if device_type in _entries and not override:
            raise BackendRegistrationError(
                f"register_backend: {device_type!r} is already registered to {_entries[device_type].target!r}; "
                "pass override=True to replace it"
            )
        _entries[device_type] = _Entry(target, "registered")
        for key in [k for k in _instances if k[0] == device_type]:
            del _instances[key]


def unregister_backend(device_type: str) -> None:
    """Forget ``device_type`` and its cached instances (no error if it was not registered)."""
    device_type = device_type.lower()
    with _lock:
        _entries.pop(device_type, None)
        for key in [k for k in _instances if k[0] == device_type]:
            del _instances[key]


def registered_device_types() -> list[str]:
    """Every registered device type (builtin, entry points, run-time registrations), sorted."""
    with _lock:
        _load_entry_points()
        return sorted(_entries)


def backend_class(device_type: str) -> type:
    """The class registered for ``device_type``, imported (its module, not its vendor runtime)."""
    device_type = device_type.lower()
    if device_type not in _entries:
        hint = _device_hint(device_type)
        raise UnknownDeviceError(
            f"unknown device type {device_type!r}: registered device types are {sorted(_entries)}{hint}"
        )
    entry = _entries[device_type]
    if isinstance(entry.target, type):
        return entry.target
    module_name, _, attr = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = _INSTALL_HINT.get(device_type, f"install the package that provides {module_name}")
        raise BackendUnavailableError(
            f"backend {device_type!r} cannot be imported ({exc}); {hint}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise BackendUnavailableError(f"backend {device_type!r}: {module_name} has no {attr!r}") from exc


def _probe(cls: type, *, emulated: bool = False) -> Availability:
    try:
        if emulated:
            return cls.probe_emulation()  # type: ignore[attr-defined, no-any-return]
        return cls.probe()  # type: ignore[attr-defined, no-any-return]
    except Exception as exc:  # a probe must not take the registry down
        return Availability(False, f"probe failed: {type(exc).__name__}: {exc}")


def parse_device(device: str | torch.device) -> tuple[str, int | None]:
    """``"npu:1"`` -> ``("npu", 1)``; ``"cuda"`` -> ``("cuda", None)``."""
    if isinstance(device, torch.device):
        return device.type, device.index
    if not isinstance(device, str):
        raise UnknownDeviceError(f"device must be a str or torch.device, got {type(device).__name__}")
    m = _DEVICE_RE.match(device.strip())
    if not m:
        raise UnknownDeviceError(
            f"bad device string {device!r}: expected 'type' or 'type:index', e.g. 'npu:0', 'cuda', 'cpu', 'auto'"
        )
    return m.group(1).lower(), (int(m.group(2)) if m.group(2) is not None else None)


# Names people type for a registered device type.
_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "ascend": "npu", "host": "cpu"}


def _device_hint(device_type: str) -> str:
    """``"; did you mean 'npu:0'?"`` for ``npu0``, ``'cuda'`` for ``gpu``; empty when nothing is close."""
    glued = re.fullmatch(r"([a-z_]+?)(\d+)", device_type)
    if glued and glued.group(1) in _entries:
        return f"; did you mean '{glued.group(1)}:{glued.group(2)}'?"
    alias = _ALIASES.get(device_type)
    return f"; did you mean {alias!r}?" if alias in _entries else ""


def get_backend(device: str | torch.device = "auto", *, emulate: bool = False) -> Backend:
    """The backend bundle for ``device`` (``"npu"``, ``"npu:1"``, ``"cuda"``, ``"cpu"``, ``"auto"``).

    ``emulate=True`` builds the backend on its CPU emulator of the vendor runtime (its class's
    ``probe_emulation()`` says whether it has one). The emulator belongs to that instance:
    nothing is installed in the process, so every other library still sees the real machine.
    """
    device_type, index = parse_device(device)
    with _lock:
        _load_entry_points()
        if device_type == "auto":
            if index is not None:
                raise UnknownDeviceError(f"'auto' takes no index, got {device!r}")
            if emulate:
                raise UnknownDeviceError("'auto' cannot be emulated: name the device to emulate, e.g. 'npu'")
            reasons = []
            for candidate in auto_order():
                try:
                    return get_backend(candidate)
                except BackendUnavailableError as exc:
                    reasons.append(f"{candidate}: {exc}")
            raise BackendUnavailableError("no backend is available for 'auto': " + "; ".join(reasons))
        if device_type not in _entries:
            raise UnknownDeviceError(
                f"unknown device {str(device)!r}: registered device types are {sorted(_entries)} (and 'auto')"
                f"{_device_hint(device_type)}"
            )
        key = (device_type, index, emulate)
        if key in _instances:
            cached = _instances[key]
            if _probe(type(cached), emulated=emulate).available:
                return cached  # type: ignore[no-any-return]
            del _instances[key]  # the runtime it was built on has gone: build anew
        cls = backend_class(device_type)
        if emulate and not has_emulator(device_type):
            raise BackendUnavailableError(f"backend {device_type!r} has no emulator (its probe_emulation() returns None)")
        availability = _probe(cls, emulated=emulate)
        if not availability.available:
            hint = "" if emulate else _INSTALL_HINT.get(device_type, "")  # the emulator says what it needs itself
            raise BackendUnavailableError(
                f"backend {device_type!r} is not available: {availability.reason}" + (f"; {hint}" if hint else "")
            )
        if index is not None and availability.device_count and index >= availability.device_count:
            raise BackendUnavailableError(
                f"device {device_type}:{index} does not exist: {availability.device_count} {device_type} device(s) found"
            )
        instance = cls(index=index, emulated=True) if emulate else cls(index=index)
        _instances[key] = instance
        return instance  # type: ignore[no-any-return]


def _auto_priority(cls: type) -> int | None:
    priority = getattr(cls, "auto_priority", None)
    return priority if isinstance(priority, int) and not isinstance(priority, bool) else None


def auto_order() -> list[str]:
    """Device types ``"auto"`` tries, highest ``auto_priority`` first (ties by name); backends whose
    module cannot be imported, or that declare no priority, are left out."""
    with _lock:
        _load_entry_points()
        ranked = []
        for device_type in sorted(_entries):
            try:
                priority = _auto_priority(backend_class(device_type))
            except BackendUnavailableError:
                continue
            if priority is not None:
                ranked.append((-priority, device_type))
        return [device_type for _, device_type in sorted(ranked)]


def has_emulator(device_type: str) -> bool:
    """Whether the backend for ``device_type`` offers a CPU emulator (``probe_emulation()`` answers)."""
    try:
        probe = getattr(backend_class(device_type), "probe_emulation", None)
        return callable(probe) and probe() is not None
    except (BackendUnavailableError, UnknownDeviceError):
        return False


def list_backends() -> list[BackendInfo]:
    """Every registered backend with its availability, from each class's cheap ``probe()``
    (imports each backend module, never a vendor runtime)."""
    with _lock:
        _load_entry_points()
        out = []
        for device_type in sorted(_entries):
            entry = _entries[device_type]
            target = entry.target if isinstance(entry.target, str) else entry.target.__qualname__
            try:
                cls = backend_class(device_type)
            except BackendUnavailableError as exc:
                out.append(BackendInfo(device_type, target, entry.source, Availability(False, str(exc))))
                continue
            out.append(BackendInfo(device_type, target, entry.source, _probe(cls),
                                   str(getattr(cls, "collective_backend", "-")), _auto_priority(cls)))
        return out
