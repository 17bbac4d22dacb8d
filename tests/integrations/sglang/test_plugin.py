"""hal's SGLang entry points: what they register, and that an installed hal changes nothing for
a server that does not ask for it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytest.importorskip("sglang")

from hal.integrations.sglang import plugin  # noqa: E402
from sglang.srt import platforms  # noqa: E402
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.platforms.cpu import CpuSRTPlatform  # noqa: E402


def test_entry_points_are_installed() -> None:
    general = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    platform = {ep.name: ep.value for ep in entry_points(group="sglang.srt.platforms")}
    assert general.get("hal") == "hal.integrations.sglang.plugin:register"
    assert platform.get("hal") == "hal.integrations.sglang.plugin:activate_platform"


def test_register_adds_the_backend_once() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    backends_before = {k: v for k, v in ATTENTION_BACKENDS.items() if k != "hal"}
    choices_before = [c for c in ATTENTION_BACKEND_CHOICES if c != "hal"]
    plugin.register()
    plugin.register()
    assert ATTENTION_BACKEND_CHOICES.count("hal") == 1
    assert ATTENTION_BACKENDS["hal"] is plugin.create_attention_backend
    # Every other backend and choice is as it was.
    assert {k: v for k, v in ATTENTION_BACKENDS.items() if k != "hal"} == backends_before
    assert [c for c in ATTENTION_BACKEND_CHOICES if c != "hal"] == choices_before


def test_platform_stays_sglangs_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    assert plugin.activate_platform() is None
    assert type(platforms._resolve_platform()) is CpuSRTPlatform
    monkeypatch.setenv("SGLANG_PLATFORM", "npu")
    assert plugin.activate_platform() is None


def test_platform_hal_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    platform = platforms._resolve_platform()
    from hal.integrations.sglang.graph import HalGraphBackend, HalMultiLayerEagleDraftExtendRunner
    from hal.integrations.sglang.kv_pool import HalMHATokenToKVPool
    from hal.integrations.sglang.platform import HalPlatform
    from sglang.srt.speculative.multi_layer_eagle_draft_extend_cuda_graph_runner import (
        MultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
    )

    assert type(platform) is HalPlatform
    assert isinstance(platform, CpuSRTPlatform) and platform.is_cpu()  # the device stays SGLang's CPU
    assert platform.is_out_of_tree()
    # The classes SGLang constructs itself come bound to the one backend the platform resolved.
    pool_cls, graph_cls = platform.get_kv_pool_cls(kind="mha"), platform.get_full_graph_backend_cls()
    assert issubclass(pool_cls, HalMHATokenToKVPool) and issubclass(HalMHATokenToKVPool, MHATokenToKVPool)
    assert issubclass(graph_cls, HalGraphBackend)
    assert pool_cls.hal_backend is graph_cls.hal_backend is platform.hal_backend
    assert platform.get_kv_pool_cls(kind="mha") is pool_cls  # bound once
    assert platform.get_kv_pool_cls(kind="mla") is None
    runner = platform.get_speculative_graph_runner_cls(algorithm="EAGLE", phase="multi_layer_draft_extend")
    assert runner is HalMultiLayerEagleDraftExtendRunner
    assert issubclass(runner, MultiLayerEagleMultiStepDraftExtendCudaGraphRunner)
    assert platform.get_speculative_graph_runner_cls(algorithm="EAGLE", phase="draft_decode") is None
    assert platform.get_speculative_graph_runner_cls(algorithm="EAGLE", phase="draft_extend") is None
    # the EAGLE family (multi-layer on MiMo-V2-Flash), its alias NEXTN, STANDALONE, and NGRAM's trees
    assert [platform.supports_speculative_algorithm(a) for a in ("EAGLE", "NEXTN", "STANDALONE", "NGRAM", "DFLASH")] == [True, True, True, True, False]
    assert platform.supports_speculative_draft_attention_backend("EAGLE", "hal")
    assert not platform.supports_speculative_draft_attention_backend("EAGLE", "triton")
    assert platform.hal_backend is platform.hal_backend and platform.hal_backend.device.type == "cpu"
    assert platform.get_default_attention_backend() == "hal"
    # hal's CPU backend runs graphs eagerly: SGLang is told not to capture.
    assert platform.capabilities.graph_capture is False


def member_exists(owner: type, member: str) -> bool:
    """A method or class attribute, a dataclass/msgspec field, or an instance attribute its
    class (or a base) assigns in its source."""
    import inspect

    if hasattr(owner, member) or member in getattr(owner, "__annotations__", {}):
        return True
    for cls in inspect.getmro(owner):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if f"self.{member} =" in source or f"self.{member}:" in source or f"    {member}:" in source:
            return True
    return False


def test_every_listed_internal_exists_in_the_pinned_sglang() -> None:
    import importlib

    from hal.integrations.sglang import SGLANG_INTERNALS

    missing = []
    for module_name, names in SGLANG_INTERNALS.items():
        module = importlib.import_module(module_name)
        for name in names:
            head, _, member = name.partition(".")
            if not hasattr(module, head):
                missing.append(f"{module_name}.{head}")
            elif member and not member_exists(getattr(module, head), member):
                missing.append(f"{module_name}.{name}")
    assert not missing, missing


def test_speculative_decoding_without_hals_platform_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SGLANG_PLATFORM=hal, SGLang's draft worker would fail later with 'EAGLE is not
    supported in attention backend hal'; the first model runner refuses, naming the variable."""
    import types

    from hal.errors import UnsupportedConfigError
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    runner = types.SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.EAGLE)
    with pytest.raises(UnsupportedConfigError, match="set SGLANG_PLATFORM=hal"):
        plugin.create_attention_backend(runner)


@pytest.mark.parametrize(("algorithm", "topk", "named"), [("NGRAM", None, "speculative algorithm NGRAM makes tree verify batches"),
                                                          ("EAGLE", 2, "speculative_eagle_topk=2 makes tree verify batches"),
                                                          ("NEXTN", 4, "speculative_eagle_topk=4 makes tree verify batches")])
def test_tree_configurations_start_only_on_a_backend_whose_kernel_serves_trees(algorithm: str, topk: int | None,
                                                                               named: str) -> None:
    """NGRAM and EAGLE with topk > 1 make tree verify batches: served where the backend's kernel
    serves trees (every in-tree one), refused by name at start-up where it verifies chains only,
    where SGLang would otherwise fail at the first verify."""
    from hal.backends.cpu import CpuBackend
    from hal.backends.cpu.attention import CpuAttention
    from hal.errors import UnsupportedConfigError

    class ChainsOnlyAttention(CpuAttention):
        serves_trees = False

    class ChainsOnly(CpuBackend):
        name = "chains-only"
        attention_class = ChainsOnlyAttention

    with pytest.raises(UnsupportedConfigError, match=named + ", and the chains-only backend's kernel verifies chains only"):
        plugin.check_speculative_configuration(algorithm, topk, ChainsOnly())
    plugin.check_speculative_configuration(algorithm, topk, CpuBackend())
    plugin.check_speculative_configuration("EAGLE", 1, ChainsOnly())  # a chain: any kernel
    plugin.check_speculative_configuration("NEXTN", None, ChainsOnly())


@pytest.mark.parametrize("topk", [2, 4])
def test_topk_above_one_on_the_multi_layer_eagle_worker_is_refused_at_start_up(topk: int) -> None:
    """SGLang's multi-layer worker (MiMo-V2-Flash's MTP) drafts and accepts as a chain: with topk 2
    it returned tokens that differ from plain decoding while hal's tree verify was exact (the NGRAM
    Engine test shows that), so the configuration is refused, naming the worker."""
    from hal.backends.cpu import CpuBackend
    from hal.errors import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match=f"speculative_eagle_topk={topk} on SGLang's multi-layer EAGLE worker"):
        plugin.check_speculative_configuration("EAGLE", topk, CpuBackend(), multi_layer=True)
    plugin.check_speculative_configuration("EAGLE", 1, CpuBackend(), multi_layer=True)


def test_an_algorithm_hal_does_not_serve_is_refused_at_start_up() -> None:
    from hal.backends.cpu import CpuBackend
    from hal.errors import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match="speculative algorithm DFLASH is not served; hal serves EAGLE, NEXTN, NGRAM, STANDALONE"):
        plugin.check_speculative_configuration("DFLASH", None, CpuBackend())


def test_importing_the_platform_module_resolves_nothing() -> None:
    """hal's backend is resolved when sglang reads ``HalPlatform`` (activating the platform), not
    when the module is imported."""
    code = textwrap.dedent(
        """
        import hal.integrations.sglang.platform as platform
        from hal.integrations import edge
        assert edge._resolved == {}, edge._resolved
        cls = platform.HalPlatform
        assert edge._resolved["sglang"] is cls.hal_backend and platform.HalPlatform is cls
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
