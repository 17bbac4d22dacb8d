"""The device-string registry: lookups, errors, lazy loading, plugins and emulation opt-in."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hal
from hal.backends.cpu import CpuBackend
from hal import registry
from hal.errors import BackendUnavailableError, UnknownDeviceError
from hal.protocols import Availability

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str) -> subprocess.CompletedProcess:
    """A fresh interpreter, so nothing another test imported or installed (an emulator) leaks in."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch):
    """The registry module with private copies of its tables, restored after the test."""
    monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    monkeypatch.setattr(registry, "_instances", {})
    monkeypatch.setattr(registry, "_entry_points_loaded", registry._entry_points_loaded)
    return registry


def fake_backend(
    name: str, *, available: bool = True, count: int = 2, reason: str = "fake reason", probe_error: bool = False,
    auto_priority: int | None = None,
):
    """A new backend class (``with_emulation`` gives it an emulator)."""

    def probe(cls) -> Availability:
        if probe_error:
            raise RuntimeError("boom")
        return Availability(cls.available, reason, cls.count)

    def init(self, index: int | None = None) -> None:
        self.index = index
        self.device = torch.device("cpu")

    return type(
        name,
        (),
        {
            "name": name,
            "device_type": name.lower(),
            "collective_backend": "gloo",
            "auto_priority": auto_priority,
            "available": available,
            "count": count,
            "__init__": init,
            "probe": classmethod(probe),
            "is_available": classmethod(lambda cls: cls.probe().available),
        },
    )


def with_emulation(cls):
    """``cls`` with an emulator: ``probes`` counts probe_emulation calls, ``emulated`` marks instances."""
    cls.probes = 0
    cls.emulator_available = True

    def probe_emulation(klass) -> Availability:
        klass.probes += 1
        return Availability(klass.emulator_available, "fake emulator", klass.count)

    def init(self, index: int | None = None, *, emulated: bool = False) -> None:
        self.index, self.emulated = index, emulated
        self.device = torch.device("cpu")

    cls.probe_emulation = classmethod(probe_emulation)
    cls.__init__ = init
    return cls


# -- lookups ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device", ["cpu", "cpu:0", "CPU", " cpu ", "Cpu:0", torch.device("cpu"), torch.device("cpu", 0)], ids=repr
)
def test_cpu_lookups(device) -> None:
    be = hal.get_backend(device)
    assert isinstance(be, CpuBackend)
    assert isinstance(be, hal.Backend)
    assert (be.name, be.device_type, be.collective_backend) == ("cpu", "cpu", "gloo")
    assert be.device == torch.device("cpu")


def test_instances_are_cached_per_device_and_index() -> None:
    assert hal.get_backend("cpu") is hal.get_backend(" CPU ")
    assert hal.get_backend("cpu:0") is hal.get_backend(torch.device("cpu", 0))


@pytest.mark.parametrize(
    "device, expected",
    [("npu:1", ("npu", 1)), ("NPU", ("npu", None)), (" cuda:0 ", ("cuda", 0)), ("my_dev:12", ("my_dev", 12)),
     (torch.device("cpu"), ("cpu", None)), (torch.device("cpu", 3), ("cpu", 3))],
    ids=repr,
)
def test_parse_device(device, expected) -> None:
    assert hal.parse_device(device) == expected


@pytest.mark.parametrize("device", ["", ":", "cpu:", "cpu:x", "cpu:-1", "cpu:0:1", "c p u", "1cpu", "npu:1.0", "npu 0"])
def test_bad_device_strings(device: str) -> None:
    with pytest.raises(UnknownDeviceError, match="bad device string .* expected 'type' or 'type:index'"):
        hal.get_backend(device)


@pytest.mark.parametrize("device", [5, None, 1.0])
def test_non_string_devices(device) -> None:
    with pytest.raises(UnknownDeviceError, match="must be a str or torch.device"):
        hal.get_backend(device)


@pytest.mark.parametrize("device", ["tpu", "tpu:0", "Metal"])
def test_unknown_device_lists_the_registered_types(device: str) -> None:
    with pytest.raises(UnknownDeviceError) as info:
        hal.get_backend(device)
    message = str(info.value)
    assert f"unknown device {device!r}" in message
    for name in registry.registered_device_types():
        assert repr(name) in message
    assert {"cpu", "npu", "cuda"} <= set(registry.registered_device_types())


def test_auto_misuse() -> None:
    with pytest.raises(UnknownDeviceError, match="'auto' takes no index"):
        hal.get_backend("auto:0")
    with pytest.raises(UnknownDeviceError, match="'auto' cannot be emulated"):
        hal.get_backend("auto", emulate=True)


def test_cpu_index_beyond_the_device_count() -> None:
    with pytest.raises(BackendUnavailableError, match=r"device cpu:1 does not exist: 1 cpu device\(s\) found"):
        hal.get_backend("cpu:1")


def test_emulate_without_an_emulator_is_an_error() -> None:
    with pytest.raises(BackendUnavailableError, match="backend 'cpu' has no emulator"):
        hal.get_backend("cpu", emulate=True)


# -- fresh interpreters -------------------------------------------------------------------------------


def test_getting_the_cpu_backend_imports_no_vendor_runtime() -> None:
    code = "import hal, sys; hal.get_backend('cpu'); assert 'torch_npu' not in sys.modules and 'triton' not in sys.modules"
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr


def test_npu_and_cuda_are_unavailable_here_with_an_install_hint() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    code = textwrap.dedent(
        """
        import json, hal
        out = {"auto": type(hal.get_backend("auto")).__name__}
        for dev in ("npu", "npu:0", "cuda", "cuda:1"):
            try:
                hal.get_backend(dev)
                out[dev] = ["returned a backend", ""]
            except Exception as exc:
                out[dev] = [type(exc).__name__, str(exc)]
        print(json.dumps(out))
        """
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["auto"] == "CpuBackend"
    for dev in ("npu", "npu:0"):
        error, message = out[dev]
        assert error == "BackendUnavailableError"
        assert "backend 'npu' is not available" in message and "pip install '.[npu]'" in message and "CANN" in message
    for dev in ("cuda", "cuda:1"):
        error, message = out[dev]
        assert error == "BackendUnavailableError"
        assert "backend 'cuda' is not available" in message and "pip install '.[cuda]'" in message


# -- programmatic registration -------------------------------------------------------------------------


def test_register_override_unregister(isolated) -> None:
    first, second = fake_backend("FakeOne"), fake_backend("FakeTwo")
    hal.register_backend("fakedev", first)
    be = hal.get_backend("fakedev:1")
    assert type(be) is first and be.index == 1
    assert hal.get_backend("fakedev:1") is be
    with pytest.raises(hal.BackendRegistrationError, match="'fakedev' is already registered"):
        hal.register_backend("fakedev", second)
    assert hal.get_backend("fakedev:1") is be  # a refused registration changes nothing
    hal.register_backend("fakedev", second, override=True)
    assert type(hal.get_backend("fakedev:1")) is second  # the cached instance went with the old class
    info = {i.device_type: i for i in hal.list_backends()}["fakedev"]
    assert (info.source, info.target, info.availability.available) == ("registered", "FakeTwo", True)
    hal.unregister_backend("fakedev")
    with pytest.raises(UnknownDeviceError, match="unknown device 'fakedev'"):
        hal.get_backend("fakedev")
    hal.unregister_backend("fakedev")  # unregistering twice is harmless


def test_device_types_are_case_insensitive(isolated) -> None:
    hal.register_backend("MyDev", fake_backend("MyDev"))
    assert type(hal.get_backend("mydev")).__name__ == "MyDev"
    assert hal.get_backend("MYDEV") is hal.get_backend("mydev")
    assert "mydev" in registry.registered_device_types()
    hal.unregister_backend("MYDEV")
    with pytest.raises(UnknownDeviceError):
        hal.get_backend("mydev")


@pytest.mark.parametrize("name", ["bad:0", "", "has space", "0abc", "a-b", 5])
def test_register_rejects_bad_names(isolated, name) -> None:
    with pytest.raises(UnknownDeviceError, match="not a valid device type name"):
        hal.register_backend(name, fake_backend("X"))


def test_string_targets_are_imported_lazily(isolated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = "hal_test_lazy_backend"
    (tmp_path / f"{module}.py").write_text(
        "import torch\n"
        "class LazyBackend:\n"
        "    name = device_type = 'lazydev'\n"
        "    collective_backend = 'gloo'\n"
        "    def __init__(self, index=None):\n"
        "        self.device = torch.device('cpu')\n"
        "    @classmethod\n"
        "    def probe(cls):\n"
        "        from hal.protocols import Availability\n"
        "        return Availability(True, 'lazy', 1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    hal.register_backend("lazydev", f"{module}:LazyBackend")
    assert module not in sys.modules  # registering imports nothing
    be = hal.get_backend("lazydev")
    assert module in sys.modules and type(be).__name__ == "LazyBackend"
    monkeypatch.delitem(sys.modules, module)


def test_unimportable_targets(isolated) -> None:
    hal.register_backend("ghost", "hal_no_such_module_anywhere:Backend")
    with pytest.raises(BackendUnavailableError, match="cannot be imported .*install the package that provides hal_no_such_module_anywhere"):
        hal.get_backend("ghost")
    hal.register_backend("hollow", "hal.backends.cpu:NoSuchBackend")
    with pytest.raises(BackendUnavailableError, match="hal.backends.cpu has no 'NoSuchBackend'"):
        hal.get_backend("hollow")
    infos = {i.device_type: i for i in hal.list_backends()}
    assert not infos["ghost"].availability.available and "cannot be imported" in infos["ghost"].availability.reason


def test_unavailable_and_broken_probes(isolated) -> None:
    hal.register_backend("offline", fake_backend("Offline", available=False, reason="cable unplugged"))
    with pytest.raises(BackendUnavailableError, match="backend 'offline' is not available: cable unplugged"):
        hal.get_backend("offline")
    hal.register_backend("flaky", fake_backend("Flaky", probe_error=True))
    with pytest.raises(BackendUnavailableError, match="probe failed: RuntimeError: boom"):
        hal.get_backend("flaky")
    infos = {i.device_type: i for i in hal.list_backends()}
    assert infos["flaky"].availability == Availability(False, "probe failed: RuntimeError: boom")
    assert infos["offline"].availability.reason == "cable unplugged"


def test_emulation_is_built_only_when_asked_and_stays_with_its_instance(isolated) -> None:
    emu = with_emulation(fake_backend("Emu", available=False, reason="no hardware"))
    hal.register_backend("emu", emu)
    with pytest.raises(BackendUnavailableError, match="no hardware"):
        hal.get_backend("emu")
    be = hal.get_backend("emu:1", emulate=True)
    assert type(be) is emu and be.index == 1 and be.emulated
    assert hal.get_backend("emu:1", emulate=True) is be
    with pytest.raises(BackendUnavailableError, match="no hardware"):  # the emulated instance changed nothing
        hal.get_backend("emu")
    with pytest.raises(BackendUnavailableError, match="does not exist"):
        hal.get_backend("emu:2", emulate=True)  # the emulator's device count (2) bounds the index


def test_a_cached_emulated_backend_whose_emulator_went_away_is_not_returned(isolated) -> None:
    emu = with_emulation(fake_backend("Emu", available=False, reason="no hardware"))
    hal.register_backend("emu", emu)
    first = hal.get_backend("emu", emulate=True)
    emu.emulator_available = False
    with pytest.raises(BackendUnavailableError, match="fake emulator"):
        hal.get_backend("emu", emulate=True)
    emu.emulator_available = True
    assert hal.get_backend("emu", emulate=True) is not first


def test_a_backend_without_an_emulator_refuses_emulate(isolated) -> None:
    hal.register_backend("plain", fake_backend("Plain"))
    with pytest.raises(BackendUnavailableError, match="has no emulator"):
        hal.get_backend("plain", emulate=True)
    assert not registry.has_emulator("plain") and registry.has_emulator("npu")


def test_auto_picks_the_first_available_in_order(isolated) -> None:
    npu = fake_backend("FakeNpu", available=False, reason="no npu here", auto_priority=300)
    cuda = fake_backend("FakeCuda", auto_priority=200)
    hal.register_backend("npu", npu, override=True)
    hal.register_backend("cuda", cuda, override=True)
    assert type(hal.get_backend("auto")) is cuda
    npu.available = True
    registry._instances.clear()
    assert type(hal.get_backend("auto")) is npu
    npu.available = cuda.available = False
    registry._instances.clear()
    assert isinstance(hal.get_backend("auto"), CpuBackend)
    hal.unregister_backend("npu")  # a missing candidate is skipped
    assert isinstance(hal.get_backend("auto"), CpuBackend)
    hal.register_backend("cpu", fake_backend("FakeCpu", available=False, reason="no cpu either", auto_priority=0), override=True)
    with pytest.raises(BackendUnavailableError, match="no backend is available for 'auto': cuda: .*fake reason.*; cpu: .*no cpu either"):
        hal.get_backend("auto")


def test_entry_point_plugins(isolated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "halplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: halplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[hal.backends]\n"
        "plugdev = halplug_mod:PlugBackend\n"
        "ShoutDev = halplug_mod:PlugBackend\n"
        "broken = halplug_missing_mod:Nope\n"
    )
    (tmp_path / "halplug_mod.py").write_text(
        "import torch\n"
        "from hal.protocols import Availability\n"
        "class PlugBackend:\n"
        "    name = device_type = 'plugdev'\n"
        "    collective_backend = 'gloo'\n"
        "    def __init__(self, index=None):\n"
        "        self.index, self.device = index, torch.device('cpu')\n"
        "    @classmethod\n"
        "    def probe(cls):\n"
        "        return Availability(True, 'plugin', 4)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "halplug_mod", raising=False)
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    be = hal.get_backend("plugdev:3")
    assert type(be).__name__ == "PlugBackend" and be.index == 3
    assert type(hal.get_backend("shoutdev")).__name__ == "PlugBackend"  # names are case-insensitive
    with pytest.raises(BackendUnavailableError, match="install the package that provides halplug_missing_mod"):
        hal.get_backend("broken")
    infos = {i.device_type: i for i in hal.list_backends()}
    assert infos["plugdev"].source == "entry point (halplug)"
    assert infos["plugdev"].target == "halplug_mod:PlugBackend"
    assert infos["plugdev"].availability.device_count == 4
    monkeypatch.delitem(sys.modules, "halplug_mod")


def test_list_backends_contents() -> None:
    infos = hal.list_backends()
    names = [i.device_type for i in infos]
    assert names == sorted(names)
    by_name = {i.device_type: i for i in infos}
    assert {"cpu", "npu", "cuda"} <= set(by_name)
    cpu = by_name["cpu"]
    assert (cpu.target, cpu.source, cpu.availability.available, cpu.availability.device_count) == (
        "hal.backends.cpu:CpuBackend", "builtin", True, 1
    )
    for name in ("npu", "cuda"):
        assert by_name[name].target == f"hal.backends.{name}:{name.capitalize()}Backend"
        assert by_name[name].source == "builtin"
        assert by_name[name].availability.reason  # available or not, it says why


def test_auto_considers_entry_point_backends_by_their_declared_priority(isolated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "halprio-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: halprio\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[hal.backends]\nhigh = halprio_mod:High\nquiet = halprio_mod:Quiet\n")
    (tmp_path / "halprio_mod.py").write_text(
        "from hal.sdk import Availability, BackendBase, SplitKVPool\n"
        "class High(BackendBase):\n"
        "    name = device_type = 'high'\n"
        "    auto_priority = 250\n"
        "    available = True\n"
        "    host_memory = True\n"
        "    @classmethod\n"
        "    def probe(cls):\n"
        "        return Availability(cls.available, 'high plug-in', 1)\n"
        "class Quiet(High):\n"
        "    name = device_type = 'quiet'\n"
        "    auto_priority = None\n"
        "    available = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "halprio_mod", raising=False)
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    registry._load_entry_points()
    # The built-in accelerators, unavailable whatever ran before in this process (an emulator, a GPU).
    hal.register_backend("npu", fake_backend("FakeNpu", available=False, auto_priority=300), override=True)
    hal.register_backend("cuda", fake_backend("FakeCuda", available=False, auto_priority=200), override=True)
    order = registry.auto_order()
    assert "quiet" not in order  # no declared priority: used only when named
    assert order.index("high") < order.index("cpu")
    assert order == ["npu", "high", "cuda", "cpu"]  # 300, 250, 200, 0
    picked = hal.get_backend("auto")
    high = sys.modules["halprio_mod"].High
    assert type(picked) is high  # npu and cuda are unavailable here, the plug-in beats cpu
    high.available = False
    registry._instances.clear()
    assert isinstance(hal.get_backend("auto"), CpuBackend)
    infos = {i.device_type: i for i in hal.list_backends()}
    assert (infos["high"].auto_priority, infos["quiet"].auto_priority, infos["cpu"].auto_priority) == (250, None, 0)
    assert infos["cpu"].collective_backend == "gloo"
    monkeypatch.delitem(sys.modules, "halprio_mod")


def test_list_backends_imports_no_vendor_runtime() -> None:
    code = (
        "import sys, hal\n"
        "infos = {i.device_type: i for i in hal.list_backends()}\n"
        "assert infos['cpu'].availability.available\n"
        "print(sorted(m for m in ('triton', 'torch_npu') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
