"""Per-layer code reads no device value on the host, and the decoders read the device back once per
step: one read-back for a greedy step (its tokens) and one for an MTP iteration (accept lengths,
tokens and drafts packed together). A host read of a device tensor waits for every queued kernel,
so one in a layer's code stalls the device once per layer.

The static check reads the AST of the per-layer functions below and flags ``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()`` and ``int()`` / ``bool()`` / ``float()`` of anything but
a constant or a plain name (Python numbers passed in are plain names; a tensor reduced to a scalar
is a call, an attribute or a subscript). Per-forward code (metadata building, attention plans)
works on host copies by design and is not in the list.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

import hal

REPO = Path(__file__).resolve().parents[2]
EVERY_FUNCTION = None
# module -> the functions that run once per layer (None: all of them)
PER_LAYER: dict[str, set[str] | None] = {
    "hal/attention.py": EVERY_FUNCTION,
    "hal/validation.py": EVERY_FUNCTION,
    "hal/kv_pool.py": {"set_kv_for_forward", "_write_rows", "copy_rows", "_wide_rows", "translate_loc", "_validate",
                       "k_buffer", "v_buffer", "is_swa_layer", "_check_layer"},
    "backends/cpu/attention.py": EVERY_FUNCTION,
    "backends/cpu/paged_attention.py": {"paged_attention", "_attend_group", "_gather_pages", "_per_kv_head_matmul", "take"},
    "backends/cpu/kv_pool.py": EVERY_FUNCTION,
    "backends/cuda/attention.py": EVERY_FUNCTION,
    "backends/cuda/kv_pool.py": EVERY_FUNCTION,
    "backends/cuda/triton_attention.py": EVERY_FUNCTION,
    "backends/npu/attention.py": {"check_supported", "fia_arguments", "_attend"},
    "backends/npu/kv_pool.py": EVERY_FUNCTION,
    "speculative/model.py": {"forward"},
    "speculative/layers.py": {"forward", "target_hidden", "mtp_hidden", "logits"},
    "speculative/mimo.py": {"forward", "route", "_grouped_mm"},
    "speculative/engine.py": {"__call__"},
}
READ_BACKS = {"item", "tolist", "cpu", "numpy"}
SCALAR_CASTS = {"int", "bool", "float"}


def host_reads(source: str, functions: set[str] | None) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or (functions is not None and fn.name not in functions):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in READ_BACKS:
                found.append((node.lineno, f"{fn.name}: {ast.unparse(node)}"))
            elif isinstance(f, ast.Name) and f.id in SCALAR_CASTS and node.args:
                if not isinstance(node.args[0], (ast.Constant, ast.Name)):
                    found.append((node.lineno, f"{fn.name}: {ast.unparse(node)}"))
    return found


@pytest.mark.parametrize("module", sorted(PER_LAYER))
def test_per_layer_code_reads_no_device_value(module: str) -> None:
    source = (REPO / module).read_text()
    functions = PER_LAYER[module]
    if functions is not None:
        defined = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
        assert functions <= defined, f"{module}: listed functions not found: {sorted(functions - defined)}"
    assert host_reads(source, functions) == []


@pytest.mark.parametrize(
    "snippet",
    ["x.item()", "x.tolist()", "y = x.cpu()", "int(x.max())", "bool((a > b).any())", "float(t[0])", "int(self.n.sum())"],
)
def test_the_checker_flags_each_kind_of_read(snippet: str) -> None:
    source = f"def forward(x, a, b, t, y=None):\n    {snippet}\n"
    assert len(host_reads(source, {"forward"})) == 1
    assert host_reads(source, {"other"}) == []
    assert host_reads("def forward(n, w):\n    return int(n) + float('-inf') + bool(w)\n", None) == []


class ReadCounter:
    """Counts ``.tolist()`` / ``.item()`` / ``.cpu()`` / scalar conversions of tensors made from the
    decoders' own code (``speculative/``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        root = str(REPO / "speculative")
        for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            original = getattr(torch.Tensor, name)

            def counting(tensor, *args, _original=original, _name=name, **kwargs):  # type: ignore[no-untyped-def]
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(root):
                    self.calls.append(f"{_name} in {Path(caller).name}:{sys._getframe(1).f_lineno}")
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counting)


def test_greedy_reads_the_device_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from hal.speculative import GreedyDecoder
    from hal.speculative.model import TinyConfig, TinyMiMo

    decoder = GreedyDecoder(TinyMiMo(TinyConfig(num_layers=3, num_mtp_layers=1)), hal.get_backend("cpu"), max_batch_size=3, max_seq_len=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 7]
    counter = ReadCounter(monkeypatch)
    result = decoder.generate(prompts, [6, 3, 9])
    assert len(counter.calls) == result.target_forwards, counter.calls  # prefill + one per decode step


def test_mtp_reads_the_device_once_per_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    from hal.speculative import MultiLayerEagleWorker
    from hal.speculative.model import TinyConfig, TinyMiMo

    worker = MultiLayerEagleWorker(TinyMiMo(TinyConfig(num_layers=3, num_mtp_layers=2)), hal.get_backend("cpu"), num_steps=2, max_batch_size=3,
                                   max_seq_len=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 7]
    counter = ReadCounter(monkeypatch)
    result = worker.generate(prompts, [6, 3, 9])
    assert len(counter.calls) == result.target_forwards, counter.calls  # prefill + one per verify iteration
