"""hal/ and speculative/ must not branch on the device: that is what backends/ is for.

The checker reads the AST (so comments, docstrings and messages may name devices freely) and
flags four things:
- ``is_npu()`` / ``is_cuda()`` / ``x.is_cuda``-style device predicates, called or read;
- comparisons of a device-like expression (``x.device.type``, ``self.device_type``, ``device``,
  ``str(device)``, ``backend.name``) with a device name, including ``in (...)``, ``startswith``,
  ``torch.device("cuda")`` operands and ``match``/``case``;
- any use of ``torch.npu`` / ``torch.cuda`` (attribute chains, ``from torch import cuda``,
  ``getattr(torch, "npu")``);
- imports of ``torch_npu`` or ``triton``, static or through importlib / ``__import__``.
``hal/registry.py`` maps device strings to backends, so device-name comparisons are allowed
there (imports and the rest are not).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import attrs
import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("hal", "speculative")
DEVICE_STRINGS_ALLOWED = {Path("hal/registry.py")}

DEVICES = ("npu", "cuda", "cpu", "gpu", "hip", "rocm", "xpu", "mps", "ascend")
DEVICE_LITERAL = re.compile(rf"^({'|'.join(DEVICES)})(:\d+)?$", re.IGNORECASE)
DEVICE_PREDICATE = re.compile(rf"^_?is_({'|'.join(DEVICES)})(_[a-z0-9]+)*$")
DEVICE_ATTRS = {"type", "device", "device_type", "device_name", "name"}
DEVICE_NAMES = re.compile(r"^(device|dev|device_type|device_name)$|_(device|device_type)$")
VENDOR_MODULES = {"torch_npu", "triton"}
TORCH_DEVICE_MODULES = {"npu", "cuda"}
DYNAMIC_IMPORTS = {"import_module", "__import__", "find_spec"}


@attrs.frozen
class Violation:
    path: str
    line: int
    rule: str
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.code}"


def _is_device_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return bool(DEVICE_LITERAL.match(node.value))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_device_literal(e) for e in node.elts)
    if isinstance(node, ast.Call) and _call_name(node) == "device" and node.args:  # torch.device("cuda")
        return _is_device_literal(node.args[0])
    return False


def _is_device_like(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in DEVICE_ATTRS
    if isinstance(node, ast.Name):
        return bool(DEVICE_NAMES.search(node.id))
    if isinstance(node, ast.Call) and _call_name(node) in ("str", "repr") and node.args:
        return _is_device_like(node.args[0])
    return False


def _call_name(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _top_module(name: str) -> str:
    return name.split(".", 1)[0]


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str, source: str, allow_device_strings: bool) -> None:
        self.path = path
        self.lines = source.splitlines()
        self.allow_device_strings = allow_device_strings
        self.torch_names = {"torch"}
        self.found: list[Violation] = []

    def flag(self, node: ast.AST, rule: str) -> None:
        line = getattr(node, "lineno", 0)
        code = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        self.found.append(Violation(self.path, line, rule, code))

    def _torch_chain(self, node: ast.AST) -> list[str] | None:
        """``torch.a.b`` -> ["a", "b"] when the chain is rooted at an alias of torch."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.torch_names:
            return parts[::-1]
        return None

    # imports ------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] in VENDOR_MODULES:
                self.flag(node, f"imports {alias.name}")
            elif parts[0] == "torch" and TORCH_DEVICE_MODULES & set(parts[1:]):
                self.flag(node, f"imports {alias.name}")
            elif alias.name == "torch" and alias.asname:
                self.torch_names.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        parts = module.split(".")
        if node.level == 0 and parts[0] in VENDOR_MODULES:
            self.flag(node, f"imports from {module}")
        elif node.level == 0 and parts[0] == "torch":
            names = {a.name for a in node.names}
            if TORCH_DEVICE_MODULES & (set(parts[1:]) | (names if len(parts) == 1 else set())):
                self.flag(node, f"imports torch device module via 'from {module} import ...'")

    # calls and attributes -----------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        name = _call_name(node)
        first = node.args[0] if node.args else None
        is_str = isinstance(first, ast.Constant) and isinstance(first.value, str)
        if name in DYNAMIC_IMPORTS and is_str and _top_module(first.value) in VENDOR_MODULES:
            self.flag(node, f"imports {first.value} dynamically")
        if (
            name in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in self.torch_names
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in TORCH_DEVICE_MODULES
        ):
            self.flag(node, f"uses torch.{node.args[1].value}")
        if (
            not self.allow_device_strings
            and name == "startswith"
            and isinstance(node.func, ast.Attribute)
            and _is_device_like(node.func.value)
            and first is not None
            and _is_device_literal(first)
        ):
            self.flag(node, "compares a device with a device name")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if DEVICE_PREDICATE.match(node.attr):
            self.flag(node, f"device predicate {node.attr}")
        chain = self._torch_chain(node)
        if chain is not None and TORCH_DEVICE_MODULES & set(chain):
            self.flag(node, "uses torch." + ".".join(chain))
            return  # one report per chain, not one per prefix
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if DEVICE_PREDICATE.match(node.id):
            self.flag(node, f"device predicate {node.id}")

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        # Defining is_cuda() is as much a device branch as calling it.
        if DEVICE_PREDICATE.match(node.name):
            self.flag(node, f"defines device predicate {node.name}")
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    # comparisons --------------------------------------------------------------------------
    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        if (
            not self.allow_device_strings
            and any(_is_device_literal(o) for o in operands)
            and any(_is_device_like(o) for o in operands)
        ):
            self.flag(node, "compares a device with a device name")
        self.generic_visit(node)

    def visit_Match(self, node: ast.Match) -> None:
        if not self.allow_device_strings and _is_device_like(node.subject):
            for case in node.cases:
                for pattern in ast.walk(case.pattern):
                    if isinstance(pattern, ast.MatchValue) and _is_device_literal(pattern.value):
                        self.flag(pattern.value, "matches a device against a device name")
        self.generic_visit(node)


def find_device_branches(source: str, path: str = "<snippet>", *, allow_device_strings: bool = False) -> list[Violation]:
    """Every device branch in ``source`` (see the module docstring for what counts)."""
    checker = _Checker(path, source, allow_device_strings)
    checker.visit(ast.parse(source, filename=path))
    return checker.found


def scan(roots: tuple[str, ...] = SCANNED) -> tuple[list[Path], list[Violation]]:
    files, found = [], []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO)
            files.append(rel)
            found += find_device_branches(
                path.read_text(encoding="utf-8"), str(rel), allow_device_strings=rel in DEVICE_STRINGS_ALLOWED
            )
    return files, found


def test_hal_and_speculative_have_no_device_branches() -> None:
    files, found = scan()
    assert Path("hal/registry.py") in files and Path("hal/kv_pool.py") in files
    assert not found, "device branches outside backends/:\n" + "\n".join(map(str, found))


POSITIVE = [
    "if is_npu():\n    pass",
    "from sglang.srt.utils import is_cuda\nuse = is_cuda()",
    "x = utils.is_npu()",
    "if _is_cuda_alike():\n    pass",
    "ok = platform.is_cpu()",
    "def is_npu():\n    return False",
    "if q.is_cuda:\n    pass",
    "if x.device.type == 'npu':\n    pass",
    "if 'cuda' != tensor.device.type:\n    pass",
    "ok = q.device.type in ('npu', 'cuda')",
    "if self.device_type == 'cuda':\n    pass",
    "if device == 'npu:0':\n    pass",
    "if pool_device == 'cuda':\n    pass",
    "if backend.name == 'npu':\n    pass",
    "if str(q.device).startswith('npu'):\n    pass",
    "if str(q.device) == 'cuda:1':\n    pass",
    "if dev == torch.device('cuda'):\n    pass",
    "match x.device.type:\n    case 'npu':\n        pass\n    case _:\n        pass",
    "torch.npu.synchronize()",
    "stream = torch.cuda.Stream()",
    "import torch as th\nth.cuda.empty_cache()",
    "flag = torch.backends.cuda.matmul.allow_tf32",
    "graph = torch.cuda.CUDAGraph()",
    "from torch import cuda",
    "from torch import npu, nn",
    "import torch.cuda",
    "from torch.npu import NPUGraph",
    "from torch.cuda.graphs import graph_pool_handle",
    "import torch_npu",
    "import triton.language as tl",
    "from triton import jit",
    "from torch_npu.contrib import transfer_to_npu",
    "mod = importlib.import_module('torch_npu')",
    "mod = __import__('triton')",
    "spec = importlib.util.find_spec('triton.language')",
    "npu = getattr(torch, 'npu')",
    "has = hasattr(torch, 'cuda')",
]

NEGATIVE = [
    "# is_npu() and torch.cuda in a comment\nx = 1",
    '"""torch.cuda.synchronize(); if device.type == "npu": is_cuda()"""',
    "message = 'install torch_npu and triton, or call torch.npu.synchronize()'",
    "if mode.is_decode():\n    pass",
    "layer = pool.is_swa_layer(0)",
    "capturing = is_capturing()",
    "be = hal.get_backend('npu')",
    "builtin = {'npu': 'hal.backends.npu:NpuBackend', 'cuda': 'hal.backends.cuda:CudaBackend'}",
    "if device_type == 'auto':\n    pass",
    "if x.dtype == torch.float32:\n    pass",
    "t = torch.zeros(3, device='cpu')",
    "y = x.to('cpu')",
    "if args.command == 'demo':\n    pass",
    "if label == 'cuda':\n    pass",  # not a device expression
    "self.cuda_graphs = {}\nn = self.npu_count",
    "import triton_helpers_local\nfrom tritonish import x",
    "from torch.nn import functional\nimport torch.nn as nn",
    "x = torch.empty(1).to(device)",
    "if device == other_device:\n    pass",
    "mod = importlib.import_module('hal.backends.npu')",
    "ok = getattr(module, 'npu', None)",
    "match mode:\n    case 'npu':\n        pass",
]


@pytest.mark.parametrize("source", POSITIVE)
def test_checker_flags_device_branches(source: str) -> None:
    found = find_device_branches(source)
    assert len(found) == 1, [str(v) for v in found]
    assert found[0].line >= 1 and found[0].code


@pytest.mark.parametrize("source", NEGATIVE)
def test_checker_ignores_device_neutral_code(source: str) -> None:
    assert find_device_branches(source) == []


def test_registry_may_compare_device_strings_but_not_import_runtimes() -> None:
    compare = "if device_type == 'npu':\n    hint = 'CANN'"
    assert find_device_branches(compare, allow_device_strings=True) == []
    assert len(find_device_branches(compare)) == 1
    assert len(find_device_branches("import torch_npu", allow_device_strings=True)) == 1
    assert len(find_device_branches("torch.cuda.synchronize()", allow_device_strings=True)) == 1


def test_violations_name_file_line_and_code() -> None:
    (v,) = find_device_branches("x = 1\nif q.device.type == 'npu':\n    pass", "speculative/worker.py")
    assert str(v) == "speculative/worker.py:2: compares a device with a device name: if q.device.type == 'npu':"
