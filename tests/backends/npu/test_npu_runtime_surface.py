"""The npu backend reaches its vendor runtime only through ``NpuRuntime`` handles, and the
emulated and the real runtime offer one list of names: what the backend's call sites use is what
``hal.backends.npu.runtime`` lists, what the emulator provides, and what ``runtime.ascend()``
requires of a real torch_npu."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch

import hal.backends.npu
from hal.backends.npu import emulator, runtime

BACKEND_DIR = Path(hal.backends.npu.__file__).parent
BACKEND_MODULES = sorted(p for p in BACKEND_DIR.glob("*.py") if p.name != "runtime.py")


def runtime_uses(tree: ast.AST) -> dict[str, set[str]]:
    """Names used through a runtime handle: ``<...>.runtime.torch_npu.X``, ``<...>.runtime.npu.X``,
    and ``npu.X`` where a local ``npu`` was bound to ``<...>.runtime.npu``."""
    uses: dict[str, set[str]] = {"torch_npu": set(), "npu": set()}
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "npu":
            for target in node.targets:
                if isinstance(target, ast.Name):
                    aliases.add(target.id)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            for target in node.targets:
                if isinstance(target, ast.Tuple):
                    for name, value in zip(target.elts, node.value.elts):
                        if isinstance(name, ast.Name) and isinstance(value, ast.Attribute) and value.attr == "npu":
                            aliases.add(name.id)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Attribute) and owner.attr in uses and isinstance(owner.value, ast.Attribute) \
                and owner.value.attr == "runtime":
            uses[owner.attr].add(node.attr)
        elif isinstance(owner, ast.Attribute) and owner.attr in uses and isinstance(owner.value, ast.Name) \
                and owner.value.id in ("runtime", "ascend", "emulated"):
            uses[owner.attr].add(node.attr)
        elif isinstance(owner, ast.Name) and owner.id in aliases:
            uses["npu"].add(node.attr)
    return uses


def all_uses() -> dict[str, set[str]]:
    total: dict[str, set[str]] = {"torch_npu": set(), "npu": set()}
    for path in BACKEND_MODULES:
        for kind, names in runtime_uses(ast.parse(path.read_text())).items():
            total[kind] |= names
    return total


def test_the_backends_call_sites_are_exactly_the_listed_names() -> None:
    uses = all_uses()
    assert uses["torch_npu"] == set(runtime.TORCH_NPU_OPS)
    assert uses["npu"] <= set(runtime.TORCH_NPU_RUNTIME), uses["npu"] - set(runtime.TORCH_NPU_RUNTIME)
    # every listed runtime name is called somewhere (the probe's is_available/device_count included)
    assert set(runtime.TORCH_NPU_RUNTIME) - uses["npu"] == set()


def test_the_emulator_provides_exactly_the_listed_names() -> None:
    emulated = emulator.npu_runtime()
    public = {n for n in vars(emulated.torch_npu) if not n.startswith("_")} - {"npu", "IS_HAL_EMULATOR"}
    assert public == set(runtime.TORCH_NPU_OPS)
    assert {n for n in vars(emulated.npu) if not n.startswith("_")} == set(runtime.TORCH_NPU_RUNTIME)
    assert emulated.emulated and emulated.tensor_device(3) == torch.device("cpu")


def test_no_backend_module_reaches_torch_npu_around_its_runtime() -> None:
    for path in BACKEND_MODULES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                assert not any(n.split(".")[0] == "torch_npu" for n in names), f"{path.name} imports torch_npu"
            if isinstance(node, ast.Attribute) and node.attr == "npu" and isinstance(node.value, ast.Name) and node.value.id == "torch":
                raise AssertionError(f"{path.name}:{node.lineno} uses torch.npu instead of its runtime handle")


def test_a_real_torch_npu_lacking_a_listed_name_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("torch_npu")
    fake.__version__ = "2.8.0"  # type: ignore[attr-defined]
    fake.npu_scatter_nd_update_ = lambda *a: None  # type: ignore[attr-defined]
    npu = types.SimpleNamespace(**{n: object() for n in runtime.TORCH_NPU_RUNTIME})
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    runtime.ascend.cache_clear()
    try:
        with pytest.raises(ImportError, match="lacks what hal's npu backend calls: torch_npu.npu_fused_infer_attention_score_v2"):
            runtime.ascend()
        fake.npu_fused_infer_attention_score_v2 = lambda *a, **k: None  # type: ignore[attr-defined]
        runtime.ascend.cache_clear()
        real = runtime.ascend()
        assert real.torch_npu is fake and real.npu is npu and not real.emulated
    finally:
        runtime.ascend.cache_clear()


def test_the_process_wide_emulator_is_not_taken_for_a_real_torch_npu() -> None:
    with emulator.emulated():
        runtime.ascend.cache_clear()
        with pytest.raises(ImportError, match="hal's CPU emulator"):
            runtime.ascend()
        assert not hal.backends.npu.NpuBackend.probe().available
    runtime.ascend.cache_clear()
