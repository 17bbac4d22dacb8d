"""Dependencies point one way: core <- backends, speculative <- tooling.

- The core (``hal/*.py``) imports nothing from ``hal.backends``, ``hal.speculative`` or ``hal.tools``.
- A backend (``backends/<name>/``, imported as ``hal.backends.<name>``) imports the core only: no
  other backend, no speculative, no tooling.
- ``speculative/`` (``hal.speculative``) imports the core only.
- An engine adapter (``hal/integrations/``) imports the core and its engine only; only the tooling
  may import it (so nothing in hal needs an engine installed).
- The tooling (``hal/tools/``) may import everything.
- Nothing imports the generic top-level names ``backends`` or ``speculative``.
- The out-of-tree example backend imports hal through ``hal.sdk`` alone.

The checker reads every import statement in the AST (function bodies and ``TYPE_CHECKING``
blocks included) and resolves relative imports against the file's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest

REPO = Path(__file__).resolve().parents[2]
OOT_EXAMPLE = REPO / "tests" / "tools" / "oot_backend" / "site" / "hal_oot_example"
# folder -> import name of the package it holds
PACKAGE_ROOTS = {"hal": "hal", "backends": "hal.backends", "speculative": "hal.speculative"}
GENERIC_TOP_LEVEL = {"backends", "speculative"}


@attrs.frozen
class WrongWay:
    path: str
    line: int
    module: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.module}: {self.why}"


def module_name(rel_path: Path) -> str:
    """``backends/npu/graph.py`` -> ``hal.backends.npu.graph``."""
    parts = list(rel_path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE_ROOTS[parts[0]], *parts[1:]])


def layer_of(module: str) -> str:
    """``core``, ``tools``, ``speculative``, ``backend:<name>`` (``backends`` for the package itself), or ``outside``."""
    parts = module.split(".")
    if parts[0] != "hal":
        return "outside"
    if len(parts) == 1:
        return "core"
    if parts[1] == "tools":
        return "tools"
    if parts[1] == "speculative":
        return "speculative"
    if parts[1] == "integrations":
        return "integrations"
    if parts[1] == "backends":
        return f"backend:{parts[2]}" if len(parts) > 2 else "backends"
    return "core"


def why_not(importer: str, imported: str) -> str | None:
    """Why module ``importer`` may not import ``imported``, or None if it may."""
    if imported.split(".")[0] in GENERIC_TOP_LEVEL:
        return "generic top-level name; it lives under hal's namespace"
    src, dst = layer_of(importer), layer_of(imported)
    if dst in ("outside", "core") or src == "tools" or src == dst:
        return None
    if dst == "tools":
        return f"{src} may not import the tooling"
    if src == "core":
        return f"the core may not import {dst}"
    if src == "speculative":
        return "speculative imports the core only"
    if src == "integrations" or dst == "integrations":
        return "an engine adapter imports the core only, and only the tooling imports it"
    if src.startswith("backend") and dst == "speculative":
        return "a backend imports the core only"
    if src.startswith("backend") and dst.startswith("backend"):
        return "a backend may not import another backend"
    return None


def imported_modules(source: str, importer: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``source``; ``from m import a`` yields ``m.a`` too,
    since ``a`` may be a submodule."""
    package = importer if is_package else importer.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def wrong_way_imports(source: str, rel_path: Path) -> list[WrongWay]:
    importer = module_name(rel_path)
    out = []
    for line, module in imported_modules(source, importer, rel_path.name == "__init__.py"):
        why = why_not(importer, module)
        if why is not None:
            out.append(WrongWay(str(rel_path), line, module, why))
    return out


def scan_tree(root: Path) -> list[WrongWay]:
    out = []
    for folder in PACKAGE_ROOTS:
        for path in sorted((root / folder).rglob("*.py")):
            out += wrong_way_imports(path.read_text(), path.relative_to(root))
    return out


def test_the_repository_imports_point_one_way() -> None:
    found = scan_tree(REPO)
    assert not found, "\n".join(map(str, found))


def test_the_scanner_reads_every_layer() -> None:
    scanned = {layer_of(module_name(p.relative_to(REPO))) for f in PACKAGE_ROOTS for p in (REPO / f).rglob("*.py")}
    assert {"core", "tools", "speculative", "integrations", "backend:cpu", "backend:npu", "backend:cuda"} <= scanned


@pytest.mark.parametrize(
    ("rel_path", "source"),
    [
        ("hal/metadata.py", "from hal.backends.cpu import CpuBackend"),
        ("hal/graph_runner.py", "def f():\n    import hal.speculative.engine"),
        ("hal/registry.py", "from hal.tools import cli"),
        ("hal/oracle.py", "from hal import tools"),
        ("hal/spec.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hal.tools.testing import TOLERANCE"),
        ("backends/cuda/__init__.py", "from hal.backends.cpu.attention import CpuAttention"),
        ("backends/npu/graph.py", "from ..cuda import graph"),
        ("backends/cpu/attention.py", "from hal.speculative import GreedyDecoder"),
        ("backends/npu/emulator/fia.py", "from hal.tools.testing import TOLERANCE"),
        ("speculative/mtp.py", "from hal.backends.cpu import CpuBackend"),
        ("speculative/engine.py", "from hal.tools.cli import backend_from_args"),
        ("hal/tools/cli.py", "import backends.cpu"),
        ("speculative/model.py", "from speculative.chain import greedy_accept"),
        ("hal/integrations/sglang/attention.py", "from hal.backends.cpu import CpuBackend"),
        ("hal/metadata.py", "def f():\n    from hal.integrations.sglang import plugin"),
        ("speculative/engine.py", "import hal.integrations.sglang.attention"),
    ],
)
def test_a_wrong_way_import_is_flagged(rel_path: str, source: str) -> None:
    found = wrong_way_imports(source, Path(rel_path))
    assert found, f"{rel_path}: {source!r} passed"
    assert all(str(v).startswith(f"{rel_path}:") for v in found)


@pytest.mark.parametrize(
    ("rel_path", "source"),
    [
        ("hal/graph_runner.py", "from hal.graph import GraphUpdate\nfrom . import metadata"),
        ("backends/npu/attention.py", "from hal.backends.npu import runtime\nfrom .emulator import fia\nfrom hal.sdk import LayerSpec"),
        ("backends/npu/emulator/runtime.py", "from ..runtime import npu\nfrom hal.backends.npu.emulator.fia import FIA_V2"),
        ("speculative/mtp.py", "import hal\nfrom hal.speculative.chain import greedy_accept\nimport torch"),
        ("hal/tools/bench.py", "from hal.backends.cpu.attention import CpuAttention\nfrom hal.speculative import distill"),
        ("hal/integrations/sglang/attention.py", "from hal.metadata import build_metadata\nfrom sglang.srt.layers import radix_attention\nfrom .kv_pool import store_in_hal_pool"),
    ],
)
def test_right_way_imports_pass(rel_path: str, source: str) -> None:
    assert wrong_way_imports(source, Path(rel_path)) == []


def test_an_injected_wrong_way_import_fails_the_tree_scan(tmp_path: Path) -> None:
    for folder in PACKAGE_ROOTS:
        for path in (REPO / folder).rglob("*.py"):
            target = tmp_path / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
    assert scan_tree(tmp_path) == []
    victim = tmp_path / "hal" / "kv_pool.py"
    victim.write_text(victim.read_text() + "\nfrom hal.backends.npu.kv_pool import NpuKVPool\n")
    found = scan_tree(tmp_path)
    assert found and {v.path for v in found} == {"hal/kv_pool.py"}
    assert all(v.module.startswith("hal.backends.npu.kv_pool") for v in found)
    assert "the core may not import backend:npu" in str(found[0])


def test_the_out_of_tree_example_imports_hal_through_the_sdk_only() -> None:
    hal_imports = set()
    for path in OOT_EXAMPLE.rglob("*.py"):
        for _, module in imported_modules(path.read_text(), f"hal_oot_example.{path.stem}", path.name == "__init__.py"):
            if module.split(".")[0] == "hal":
                hal_imports.add(module)
    assert "hal.sdk" in hal_imports
    assert all(m == "hal.sdk" or m.startswith("hal.sdk.") for m in hal_imports), sorted(hal_imports)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the repository modules it imports (any import statement, lazy ones included);
    ``from m import a`` counts as importing ``m.a`` when that is a module, else ``m``."""
    paths = {module_name(p.relative_to(root)): p for folder in PACKAGE_ROOTS for p in (root / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for importer, path in paths.items():
        edges = set()
        for _, module in imported_modules(path.read_text(), importer, path.name == "__init__.py"):
            while module and module not in paths:
                module = module.rpartition(".")[0]
            if module and module != importer:
                edges.add(module)
        graph[importer] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph = {m: {e for e in edges if not m.startswith(e + ".")} for m, edges in import_graph(REPO).items()}
    assert circles(graph) == []


def test_a_circle_is_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_in_tree_backends_import_the_core_through_the_sdk_only() -> None:
    """``hal.sdk`` says a backend imports from it and nowhere else in the core; the in-tree backends
    are held to it as the out-of-tree example is (their own package aside)."""
    stray = []
    for path in (REPO / "backends").rglob("*.py"):
        rel = path.relative_to(REPO)
        for line, module in imported_modules(path.read_text(), module_name(rel), path.name == "__init__.py"):
            if module.split(".")[0] == "hal" and not module.startswith(("hal.sdk", "hal.backends")):
                stray.append(f"{rel}:{line}: {module}")
    assert not stray, stray
