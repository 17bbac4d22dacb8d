"""The CUDA backend's registry behaviour, availability probe, emulation switch and bundle.

Checks that depend on process state (whether triton was imported, whether emulation is
installed) run in a fresh interpreter, so test order cannot hide them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hal
from hal.backends.cuda import CudaBackend
from hal.backends.cuda.attention import CudaAttention
from hal.backends.cuda.kv_pool import CudaKVPool
from hal.graph import EagerGraph
from hal.protocols import AttentionKernel, Backend, Graph, KVPool
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec
from hal.metadata import build_metadata

ROOT = Path(__file__).resolve().parents[3]


def _python(code: str, *, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env or {})
    cmd = [sys.executable, *(args or ("-c", code))]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120)


def test_get_backend_cuda_without_a_gpu_says_what_is_missing_and_imports_no_triton() -> None:
    code = """
import sys
import hal, hal.backends.cuda
hal.list_backends()
try:
    hal.get_backend("cuda")
except hal.BackendUnavailableError as exc:
    print("ERROR:", exc)
print("triton imported:", "triton" in sys.modules)
"""
    # Hide any GPU, so the case is the same on every machine.
    proc = _python(code, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    missing = "built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
    assert "ERROR: backend 'cuda' is not available: " in proc.stdout and missing in proc.stdout, proc.stdout
    assert "triton imported: False" in proc.stdout


def test_emulation_refuses_when_triton_was_imported_without_the_interpreter() -> None:
    code = """
import triton, hal
try:
    hal.get_backend("cuda", emulate=True)
except hal.BackendUnavailableError as exc:
    print("ERROR:", exc)
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "cuda emulation must start before triton is imported" in proc.stdout, proc.stdout
    assert "TRITON_INTERPRET=1" in proc.stdout


def test_emulation_is_explicit_and_sets_the_interpreter_before_triton_loads() -> None:
    code = """
import os, sys, hal
be = hal.get_backend("cuda", emulate=True)
print("env:", os.environ.get("TRITON_INTERPRET"), "triton before first call:", "triton" in sys.modules)
from hal.tools.testing import AttentionCase, run_attention_case
from hal.spec import ForwardMode, LayerSpec
r = run_attention_case(be, AttentionCase(ForwardMode.DECODE, LayerSpec(0, 2, 1, 16, 16, scaling=0.25), (5,), (1,)))
import triton.knobs
print("passed:", r.passed, "interpreting:", triton.knobs.runtime.interpret)
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "env: 1 triton before first call: False" in proc.stdout, proc.stdout
    assert "passed: True interpreting: True" in proc.stdout, proc.stdout


def test_probe_names_every_missing_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    a = CudaBackend.probe()
    assert not a.available and not CudaBackend.is_available()
    assert "torch.version.cuda is None" in a.reason and "triton is not installed" in a.reason

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    a = CudaBackend.probe()
    assert not a.available and a.reason == "no CUDA device is visible (torch.cuda.device_count() == 0); triton is not installed"
    assert a.versions["cuda"] == "12.4"


def test_emulated_bundle_implements_the_protocols() -> None:
    be = hal.get_backend("cuda", emulate=True)
    assert isinstance(be, CudaBackend) and isinstance(be, Backend)
    assert (be.name, be.device_type, be.collective_backend) == ("cuda", "cuda", "nccl")
    assert be.emulated and be.device == torch.device("cpu")
    assert "Triton interpreter" in be.probe_emulation().reason and not be.probe().available  # emulation is the instance's
    pool = be.create_kv_pool(KVPoolSpec(2, 32, 16, 1, 16, 8))
    assert isinstance(pool, CudaKVPool) and isinstance(pool, KVPool)
    attn = be.create_attention(pool)
    assert isinstance(attn, CudaAttention) and isinstance(attn, AttentionKernel)
    layer = LayerSpec(1, 2, 1, 16, 8, scaling=0.25)
    md = build_metadata(ForwardMode.DECODE, kv_lens=[3], q_lens=[1], page_table=[[2]], out_cache_loc=[34], pool=pool)
    assert attn.updatable_params(md, layer) == {}
    # No CUDA runtime under emulation: graphs are honest eager graphs, with no memory pool.
    graph = be.create_graph()
    assert isinstance(graph, EagerGraph) and isinstance(graph, Graph)
    assert be.graph_memory_pool() is None
    be.synchronize()


def test_cuda_check_fails_clearly_without_a_gpu() -> None:
    proc = _python("", args=(str(ROOT / "benchmarks" / "cuda_check.py"),), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cuda_check needs an NVIDIA GPU" in proc.stderr and "backend 'cuda' is not available" in proc.stderr
