"""The CPU backend's compiled kernel (``hal.backends.cpu.native``) against hal's oracle (float64),
through ``CpuAttention`` on pools whose unwritten rows hold NaN and inf; which batches it takes,
and what serves when it cannot be built."""

from __future__ import annotations

import ast
import contextlib
import ctypes
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_cpu_attention import EXPENSIVE, assert_close, run_cpu_kernel

from hal.backends.cpu import CpuBackend, native
from hal.backends.cpu import attention as cpu_attention
from hal.backends.cpu.attention import NATIVE_MAX_QUERY_ROWS, NATIVE_MAX_ROW_KEY_PAIRS
from hal.metadata import build_metadata
from hal.oracle import paged_oracle
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec

M = ForwardMode


@contextlib.contextmanager
def recorded_native_calls() -> Iterator[list[int]]:
    """The compiled kernel's calls (their query rows), recorded; the library must have built here."""
    assert native.available(), native.native_status()
    calls: list[int] = []
    original = native.PreparedAttention.__call__

    def recorded(self, q, *args, **kwargs):
        calls.append(q.shape[0])
        return original(self, q, *args, **kwargs)

    native.PreparedAttention.__call__ = recorded
    try:
        yield calls
    finally:
        native.PreparedAttention.__call__ = original


@pytest.fixture
def native_calls() -> Iterator[list[int]]:
    with recorded_native_calls() as calls:
        yield calls


@st.composite
def native_cases(draw: st.DrawFn):
    """Chains in every mode: prompts of up to 40 tokens (below NATIVE_MAX_ROW_KEY_PAIRS), and
    verify and draft blocks of up to 6 rows per request."""
    mode = draw(st.sampled_from([M.EXTEND, M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2]))
    ps = draw(st.sampled_from([1, 2, 4, 16]))
    b = draw(st.integers(1, 4))
    if mode is M.EXTEND:
        kv = draw(st.lists(st.integers(1, 40), min_size=b, max_size=b))
        q = [draw(st.integers(0, n)) for n in kv]
    else:
        q_len = 1 if mode is M.DECODE else draw(st.integers(2, 6))
        kv = draw(st.lists(st.integers(q_len, 40 + q_len), min_size=b, max_size=b))
        q = [q_len] * b
    window = draw(st.one_of(st.none(), st.integers(0, 6)))
    hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    layer = LayerSpec(
        layer_id=draw(st.integers(0, 1)), num_q_heads=hkv * group, num_kv_heads=hkv, head_dim=draw(st.sampled_from([4, 8, 32])),
        v_head_dim=draw(st.sampled_from([4, 12, 32])), scaling=draw(st.floats(0.05, 1.0)), sliding_window=window,
        has_sinks=draw(st.booleans()),
    )
    return dict(mode=mode, layer=layer, kv_lens=kv, q_lens=q, page_size=ps,
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), seed=draw(st.integers(0, 2**31 - 1)),
                hybrid=window is not None and draw(st.booleans()), save_kv_cache=draw(st.booleans()))


@EXPENSIVE
@given(case=native_cases())
def test_the_compiled_kernel_matches_the_oracle(case) -> None:
    with recorded_native_calls() as native_calls:
        out, expect = run_cpu_kernel(**case)
    assert_close(out, expect, case["dtype"])
    assert native_calls == [sum(case["q_lens"])]


@pytest.mark.parametrize("mode, q_len", [(M.DECODE, 1), (M.TARGET_VERIFY, 4), (M.DRAFT_EXTEND_V2, NATIVE_MAX_QUERY_ROWS)])
@pytest.mark.parametrize("window, sinks, hybrid", [(None, False, False), (None, True, False), (3, False, False), (3, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size, v_dim", [(1, 8), (4, 12), (16, 8)])
def test_every_feature_and_dtype_matches_the_oracle(mode, q_len, window, sinks, hybrid, dtype, page_size, v_dim, native_calls) -> None:
    layer = LayerSpec(1, 8, 2, 8, v_dim, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)  # 4:1 GQA
    out, expect = run_cpu_kernel(mode, layer, [q_len + 18, q_len + 3, q_len], [q_len] * 3, page_size=page_size, dtype=dtype,
                                 seed=page_size * 7 + q_len, hybrid=hybrid)
    assert_close(out, expect, dtype)
    assert native_calls == [3 * q_len]


@pytest.mark.parametrize("qk_dim, v_dim", [(32, 32), (64, 64), (128, 128), (192, 128), (256, 256), (192, 192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_dims_it_is_built_for_match_the_oracle(qk_dim, v_dim, dtype, native_calls) -> None:
    """The head dims the kernel has loops of known length for (common models', MiMo-V2-Flash's
    192/128), and one it has not: decode and verify, a window with sinks, and 2:1 GQA."""
    for mode, q_len, window, sinks in ((M.DECODE, 1, None, False), (M.TARGET_VERIFY, 4, 5, True)):
        layer = LayerSpec(0, 4, 2, qk_dim, v_dim, scaling=qk_dim**-0.5, sliding_window=window, has_sinks=sinks)
        out, expect = run_cpu_kernel(mode, layer, [q_len + 21, q_len + 2], [q_len] * 2, page_size=16, dtype=dtype, seed=qk_dim + q_len)
        assert_close(out, expect, dtype)
    assert native_calls == [2, 8]


def test_prompts_of_any_length_take_it_by_tiles_and_draft_trees_go_to_the_torch_kernel(native_calls, monkeypatch) -> None:
    """Where the library runs prompts by tiles (value rows of 8) it takes every chain; with value
    rows it cannot tile (12) only decode-sized batches and short prompts; draft trees never."""
    assert native.tiles_prompts(8) and not native.tiles_prompts(12)
    rows = NATIVE_MAX_QUERY_ROWS + 1  # past the rows of a decode-sized batch, within the pairs of a short prompt
    assert rows * (rows + 5) <= NATIVE_MAX_ROW_KEY_PAIRS
    monkeypatch.setattr(cpu_attention, "NATIVE_MAX_ROW_KEY_PAIRS", rows * (rows + 5) - 1)  # the prompt is past both bounds
    for v_dim, takes in ((8, True), (12, False)):
        layer = LayerSpec(1, 4, 2, 8, v_dim, scaling=8**-0.5)
        out, expect = run_cpu_kernel(M.EXTEND, layer, [rows + 5, 3], [rows, 1], page_size=4, dtype=torch.float32, seed=1)
        assert_close(out, expect, torch.float32)
        assert native_calls == ([rows + 1] if takes else [])
        native_calls.clear()
    monkeypatch.setattr(cpu_attention, "NATIVE_MAX_ROW_KEY_PAIRS", NATIVE_MAX_ROW_KEY_PAIRS)  # a short prompt again: row by row
    out, expect = run_cpu_kernel(M.EXTEND, LayerSpec(1, 4, 2, 8, 12, scaling=8**-0.5), [rows + 5, 3], [rows, 1], page_size=4,
                                 dtype=torch.float32, seed=1)
    assert_close(out, expect, torch.float32)
    out, expect = run_cpu_kernel(M.TARGET_VERIFY, LayerSpec(1, 4, 2, 8, 8, scaling=8**-0.5), [9, 4], [4, 4], page_size=4,
                                 dtype=torch.float32, seed=2, tree_parents=[[-1, 0, 0, 1], [-1, 0, 1, 1]])
    assert_close(out, expect, torch.float32)
    assert native_calls == [rows + 1]


@pytest.mark.parametrize("group", [1, 3, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size, window, sinks", [(1, None, False), (16, 70, True), (16, None, True), (3, 130, False)])
def test_long_prompts_by_tiles_match_the_oracle(group, dtype, page_size, window, sinks, native_calls) -> None:
    """Prompts long enough for several items and key blocks (tiles of 8 rows, blocks of 64 keys,
    items of 256 rows): fresh and after a cached prefix, beside a decode row; GQA groups that fill
    a tile with one token, part of one, or spread it over tokens; windows that end inside a block;
    on pools whose unwritten rows are NaN and inf."""
    layer = LayerSpec(0, 2 * group, 2, 32, 16, scaling=32**-0.5, sliding_window=window, has_sinks=sinks)
    q_lens = [300 // group + 7, 150, 1]
    kv_lens = [q_lens[0], 150 + 61, 90]
    out, expect = run_cpu_kernel(M.EXTEND, layer, kv_lens, q_lens, page_size=page_size, dtype=dtype, seed=group * 31 + page_size)
    assert_close(out, expect, dtype)
    assert native_calls == [sum(q_lens)]


def test_what_it_cannot_read_as_it_is_goes_to_the_torch_kernel(native_calls) -> None:
    """A query whose head dim is strided, and a record with int64 lengths (an engine's own, not
    ``build_metadata``'s): the torch kernel serves both, with the oracle's output."""
    backend = CpuBackend()
    pool = backend.create_kv_pool(KVPoolSpec(1, 64, 4, 2, 8, 8, torch.float32))
    kernel = backend.create_attention(pool)
    layer = LayerSpec(0, 4, 2, 8, 8, 8**-0.5)
    gen = torch.Generator().manual_seed(4)
    pool.k_buffer(0).copy_(torch.randn(pool.k_buffer(0).shape, generator=gen))
    pool.v_buffer(0).copy_(torch.randn(pool.v_buffer(0).shape, generator=gen))
    md = build_metadata(M.DECODE, kv_lens=[6, 3], q_lens=[1, 1], page_table=[[2, 1], [3]], out_cache_loc=[5, 14], pool=pool)
    wide_md = attrs.evolve(md, kv_lens=md.kv_lens.long(), q_lens=md.q_lens.long(), cu_q_lens=md.cu_q_lens.long())
    k, v = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
    strided_q = torch.randn(2, 4, 16, generator=gen)[..., ::2]
    for q, metadata in ((strided_q, md), (strided_q.contiguous(), wide_md)):
        out = kernel.forward(q, k, v, layer, kernel.plan(metadata))
        expect = paged_oracle(q, pool.k_buffer(0), pool.v_buffer(0), md.block_table, md.kv_lens, md.cu_q_lens, scaling=layer.scaling)
        torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)
    assert native_calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size, hybrid", [(1, False), (4, True), (16, False)])
def test_the_compiled_kernel_writes_the_new_rows_where_set_kv_does(dtype, page_size, hybrid, native_calls) -> None:
    """The forward's K/V, written by the compiled kernel as it attends (a verify block of 3 rows per
    request, across a page boundary where pages are small): every sub-pool buffer bit for bit what
    ``set_kv`` leaves, on a hybrid pool translated into the SWA sub-pool (``pool.slots_for_forward``)."""
    from hal.spec import SWAPoolSpec

    swa = SWAPoolSpec((0,), 16 * page_size, 2, 8, 12) if hybrid else None
    spec = KVPoolSpec(2, 16 * page_size, page_size, 2, 8, 12, dtype, swa)
    backend = CpuBackend()
    pools = [backend.create_kv_pool(spec) for _ in range(2)]
    gen = torch.Generator().manual_seed(page_size)
    if hybrid:
        swa_pages = torch.randperm(16, generator=gen) + 1
        for pool in pools:
            pool.map_swa_pages(torch.arange(1, 17), swa_pages)
    table = [[3, 5, 2, 6, 7, 8, 9, 10], [4, 11, 12, 13, 14, 15, 16, 1]]
    kv_lens = [3 * page_size + 1, 2 * page_size + 2]
    loc = [table[b][p // page_size] * page_size + p % page_size for b, n in enumerate(kv_lens) for p in range(n - 3, n)]
    for layer_id in (0, 1):
        layer = LayerSpec(layer_id, 4, 2, 8, 12, 8**-0.5, sliding_window=3 if hybrid and layer_id == 0 else None)
        q, k, v = (torch.randn(6, h, d, generator=gen).to(dtype) for h, d in ((4, 8), (2, 8), (2, 12)))
        kernel = backend.create_attention(pools[0])
        md = build_metadata(M.TARGET_VERIFY, kv_lens=kv_lens, q_lens=[3, 3], page_table=table, out_cache_loc=loc, pool=pools[0])
        kernel.forward(q, k, v, layer, kernel.plan(md))
        pools[1].set_kv(layer_id, torch.tensor(loc), k, v)
    assert native_calls == [6, 6]
    for (k_a, v_a), (k_b, v_b) in zip(pools[0].sub_pool_buffers().values(), pools[1].sub_pool_buffers().values()):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


def test_a_query_that_needs_gradients_goes_to_the_torch_kernel(native_calls) -> None:
    backend = CpuBackend()
    pool = backend.create_kv_pool(KVPoolSpec(1, 64, 4, 2, 8, 8, torch.float32))
    kernel = backend.create_attention(pool)
    layer = LayerSpec(0, 4, 2, 8, 8, 8**-0.5)
    md = build_metadata(M.EXTEND, kv_lens=[5], q_lens=[5], page_table=[[1, 2]], out_cache_loc=list(range(4, 9)), pool=pool)
    q = torch.randn(5, 4, 8, requires_grad=True)
    out = kernel.forward(q, torch.randn(5, 2, 8), torch.randn(5, 2, 8), layer, kernel.plan(md))
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    assert native_calls == []
    with torch.no_grad():
        kernel.forward(q, torch.randn(5, 2, 8), torch.randn(5, 2, 8), layer, kernel.plan(md))
    assert native_calls == [5]


@pytest.mark.parametrize("poisoned", ["key", "value"])
def test_a_nan_key_reaches_only_the_rows_that_see_it(poisoned, native_calls) -> None:
    """A verify block whose second row's key (or value) is NaN: row 0 is finite and the oracle's,
    every later row NaN; and a NaN key outside a row's window (or past it) never reaches it. The
    block's 5 rows x 2 query heads go by tiles, whose rows see different keys."""
    backend = CpuBackend()
    pool = backend.create_kv_pool(KVPoolSpec(1, 128, 16, 2, 32, 32, torch.float32))
    kernel = backend.create_attention(pool)
    gen = torch.Generator().manual_seed(1)
    for window in (None, 2):
        layer = LayerSpec(0, 4, 2, 32, 32, 32**-0.5, sliding_window=window)
        md = build_metadata(M.TARGET_VERIFY, kv_lens=[11], q_lens=[5], page_table=[[1, 2, 3]], out_cache_loc=list(range(22, 27)),
                            pool=pool)
        pool.k_buffer(0)[1, :6] = torch.randn(6, 2, 32, generator=gen)
        pool.v_buffer(0)[1, :6] = torch.randn(6, 2, 32, generator=gen)
        q, k, v = (torch.randn(5, h, 32, generator=gen) for h in (4, 2, 2))
        (k if poisoned == "key" else v)[1] = float("nan")
        out = kernel.forward(q, k, v, layer, kernel.plan(md))
        # the rows that do not see it read the oracle's result on caches where it is 0 (whatever it
        # is, they do not see it; the oracle weighs every value, a 0 weight times NaN included)
        clean = [torch.nan_to_num(buffer, nan=0.0) for buffer in (pool.k_buffer(0), pool.v_buffer(0))]
        expect = paged_oracle(q, *clean, md.block_table, md.kv_lens, md.cu_q_lens, scaling=layer.scaling, sliding_window=window)
        # the NaN key sits at position 7: rows at 6..10 see it from row 1 on, and on a window of 2 rows 1-3 only
        sees = [False, True, True, True, True] if window is None else [False, True, True, True, False]
        assert [bool(out[r].isnan().all()) for r in range(5)] == sees
        unseen = [r for r in range(5) if not sees[r]]
        torch.testing.assert_close(out[unseen].double(), expect[unseen], atol=1e-5, rtol=1e-5)
    assert len(native_calls) == 2


@pytest.mark.parametrize("threads", [1, 2])
def test_long_contexts_with_a_window_and_sinks_match_the_oracle(threads, monkeypatch) -> None:
    """Requests of 700 to 1536 keys, read on pages of 16 in a shuffled order, a window of 1000 keys,
    sinks, 4:1 GQA at head dim 128: the kernel called directly, as the CPU kernel calls it, on one
    thread and split across two of torch's threads (each with its own scratch rows)."""
    assert native.available(), native.native_status()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 400, 16, 2, 128, generator=gen).unbind(0)
    table = (torch.randperm(399, generator=gen)[:384] + 1).view(4, 96).to(torch.int32)
    kv_lens = torch.tensor([1500, 1200, 1536, 700], dtype=torch.int32)
    cu_q_lens = torch.tensor([0, 1, 3, 4, 6], dtype=torch.int32)
    q = torch.randn(6, 8, 128, generator=gen)
    sinks = torch.randn(8, generator=gen)
    out = native.paged_attention(q, k_cache, v_cache, table, kv_lens, cu_q_lens, scaling=0.09, sliding_window=1000, sinks=sinks)
    expect = paged_oracle(q, k_cache, v_cache, table, kv_lens, cu_q_lens, scaling=0.09, sliding_window=1000, sinks=sinks)
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)


FALLBACK_SCRIPT = """
import torch
from hal.backends.cpu import native
from hal.backends.cpu.attention import CpuAttention
from hal.metadata import build_metadata
from hal.oracle import paged_oracle
from hal.registry import get_backend
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec

backend = get_backend("cpu")
pool = backend.create_kv_pool(KVPoolSpec(1, 64, 4, 2, 8, 8, torch.float32))
kernel = backend.create_attention(pool)
layer = LayerSpec(0, 4, 2, 8, 8, 8**-0.5)
md = build_metadata(ForwardMode.DECODE, kv_lens=[6], q_lens=[1], page_table=[[2, 1]], out_cache_loc=[5], pool=pool)
pool.k_buffer(0).normal_(), pool.v_buffer(0).normal_()
q, k, v = torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
out = kernel.forward(q, k, v, layer, kernel.plan(md))
expect = paged_oracle(q, pool.k_buffer(0), pool.v_buffer(0), md.block_table, md.kv_lens, md.cu_q_lens, scaling=layer.scaling)
torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)
print(native.available())
print(backend.probe().reason)
"""


@pytest.mark.parametrize("environment, reason", [
    ({"HAL_CPU_NATIVE": "0"}, "off: HAL_CPU_NATIVE=0"),
    ({"CC": "no-such-compiler"}, "unavailable: no C compiler ('no-such-compiler' is not on PATH; set CC)"),
    ({"CC": "false"}, "unavailable: false failed (1)"),
    ({}, "in use: "),
])
def test_without_the_library_the_torch_kernel_serves_and_says_why(environment, reason, tmp_path) -> None:
    """In a fresh process with its own cache: an off switch, no compiler and a failing build each
    leave the torch kernel serving (the oracle's output) and ``probe`` naming why; a build lands
    in ``HAL_CACHE_DIR``."""
    env = {**os.environ, "HAL_CACHE_DIR": str(tmp_path), **environment}
    run = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    available, probe = run.stdout.strip().splitlines()
    assert available == str(not environment)
    assert probe.startswith(f"torch; compiled attention {reason}")
    assert [p.suffix for p in tmp_path.iterdir()] == ([".so"] if not environment else [])


NO_HEADERS_SCRIPT = """
import sysconfig
paths = sysconfig.get_paths()
sysconfig.get_paths = lambda: {**paths, "include": "/nonexistent-include", "platinclude": "/nonexistent-include"}
""" + FALLBACK_SCRIPT + """
print(native.native_status())
"""


def test_without_the_interpreters_headers_the_library_is_called_through_ctypes(tmp_path) -> None:
    """A Python without its development headers (stood in for by an include directory that does not
    exist): the kernel builds as a plain library, is called through ctypes, says why, and matches
    the oracle."""
    env = {**os.environ, "HAL_CACHE_DIR": str(tmp_path)}
    env.pop("HAL_CPU_NATIVE", None)
    run = subprocess.run([sys.executable, "-c", NO_HEADERS_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    available, _, status = run.stdout.strip().splitlines()
    assert available == "True"
    assert "called through ctypes (no extension module: no Python.h in /nonexistent-include" in status, status
    assert [p.name.startswith("paged_attention-") for p in tmp_path.iterdir()] == [True]


def _both_bindings() -> tuple[object, object]:
    """(the extension module, the ctypes library) of the loaded kernel's build: the one loaded and
    the same source and flags built the other way, from this process's cache."""
    assert native.available(), native.native_status()
    loaded = native._library
    compiler = os.environ.get("CC") or "cc"
    flags = (*native._FLAGS, "-fopenmp") if "on torch's OpenMP threads" in native.native_status() else native._FLAGS
    if isinstance(loaded, ctypes.CDLL):
        try:
            return native.load_module(native._build(compiler, flags, module=True)), loaded
        except (OSError, ImportError) as error:
            pytest.skip(f"no extension module on this interpreter: {error}")
    return loaded, native.bind(ctypes.CDLL(str(native._build(compiler, flags))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_extension_module_and_the_ctypes_library_compute_the_same_bits(dtype, monkeypatch, native_calls) -> None:
    """One source, two ways of calling it: decode rows, a prompt by tiles and a verify block, with a
    window and sinks, come out bit for bit the same through either, and match the oracle."""
    bindings = _both_bindings()
    layer = LayerSpec(0, 6, 2, 32, 24, scaling=32**-0.5, sliding_window=9, has_sinks=True)
    cases = [(M.DECODE, [40, 7, 90], [1, 1, 1]), (M.EXTEND, [70, 33], [70, 5]), (M.TARGET_VERIFY, [20, 41], [4, 4])]
    for i, (mode, kv_lens, q_lens) in enumerate(cases):
        results = []
        for library in bindings:
            monkeypatch.setattr(native, "_library", library)
            out, expect = run_cpu_kernel(mode, layer, kv_lens, q_lens, page_size=4, dtype=dtype, seed=11 + i)
            assert_close(out, expect, dtype)
            results.append(out)
        assert torch.equal(results[0], results[1]), mode
    assert len(native_calls) == 2 * len(cases)


def test_the_extension_module_refuses_arguments_of_the_wrong_kind_by_position() -> None:
    """What ctypes' declared types would refuse, the module refuses too, with the argument's place:
    a wrong count, a float for an int, a str for an address, an int past a C int; nothing is run."""
    module, _ = _both_bindings()
    prepare_args = [0, 4, 2, 1, 8, 8, 0, 1, 0, 0, 0, 1.0, -1, 0, 1]
    with pytest.raises(TypeError, match="takes 15 arguments, got 14"):
        module.hal_attention_prepare(*prepare_args[:-1])
    with pytest.raises(TypeError, match="argument 1: expected an int, got float"):
        module.hal_attention_prepare(0, 4.0, *prepare_args[2:])
    with pytest.raises(TypeError, match="argument 6: expected an int address or None, got str"):
        module.hal_attention_prepare(*prepare_args[:6], "0x10", *prepare_args[7:])
    with pytest.raises(OverflowError, match="argument 10: 4294967296 does not fit a C int"):
        module.hal_attention_prepare(*prepare_args[:10], 2**32, *prepare_args[11:])
    with pytest.raises(TypeError, match="takes 22 arguments, got 3"):
        module.hal_attention_run(0, 0, 0)
    assert module.hal_paged_attention_tiles() in (0, 8, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sinks_in_the_models_dtype_match_the_oracle(dtype, native_calls) -> None:
    """Engines hand sinks in the model's dtype: the kernel reads an fp32 copy of them, kept alive
    while it runs (freed early, its memory is reused by the next allocation and the sinks are noise)."""
    backend = CpuBackend()
    pool = backend.create_kv_pool(KVPoolSpec(1, 256, 16, 2, 32, 32, dtype))
    kernel = backend.create_attention(pool)
    layer = LayerSpec(0, 8, 2, 32, 32, 32**-0.5, has_sinks=True)
    gen = torch.Generator().manual_seed(5)
    pool.k_buffer(0).copy_(torch.randn(pool.k_buffer(0).shape, generator=gen))
    pool.v_buffer(0).copy_(torch.randn(pool.v_buffer(0).shape, generator=gen))
    sinks = (torch.randn(8, generator=gen) * 3).to(dtype)
    md = build_metadata(M.DECODE, kv_lens=[40, 9, 70], q_lens=[1, 1, 1], page_table=[[3, 1, 7], [2], [4, 5, 6, 8, 9]],
                        out_cache_loc=[7 * 16 + 7, 2 * 16 + 8, 9 * 16 + 5], pool=pool)
    q, k, v = (torch.randn(3, h, 32, generator=gen).to(dtype) for h in (8, 2, 2))
    for _ in range(3):  # allocations between calls, as in a model
        out = kernel.forward(q, k, v, layer, kernel.plan(md), sinks=sinks)
        expect = paged_oracle(q, pool.k_buffer(0), pool.v_buffer(0), md.block_table, md.kv_lens, md.cu_q_lens,
                              scaling=layer.scaling, sinks=sinks)
        assert_close(out, expect, dtype)
    assert native_calls == [3, 3, 3]


SHARED_POOL_SCRIPT = """
import torch
from hal.backends.cpu import native
print(native.native_status())
print(sorted({line.split()[-1] for line in open("/proc/self/maps") if "gomp" in line}))
print(torch.__file__)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mapped libraries from /proc")
def test_with_openmp_the_kernel_uses_torchs_libgomp_not_a_second_runtime() -> None:
    run = subprocess.run([sys.executable, "-c", SHARED_POOL_SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    status, libraries, torch_file = run.stdout.strip().splitlines()
    if "torch's OpenMP threads" not in status:
        pytest.skip(f"built without OpenMP here: {status}")
    gomp = ast.literal_eval(libraries)
    assert len(gomp) == 1 and gomp[0].startswith(os.path.dirname(torch_file)), gomp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode, q_lens", [(M.DECODE, [1, 1]), (M.EXTEND, [9, 20])])
def test_out_gets_the_result_in_every_dtype(dtype, mode, q_lens, native_calls) -> None:
    """``out`` receives what the call returns without it (the compiled kernel writes fp32 and bf16
    rows there itself; fp16 goes through fp32), decode rows and prompts alike."""
    kv_lens = [30, 20]
    results = []
    for with_out in (False, True):
        backend = CpuBackend()
        pool = backend.create_kv_pool(KVPoolSpec(1, 128, 16, 2, 32, 32, dtype))
        kernel = backend.create_attention(pool)
        layer = LayerSpec(0, 8, 2, 32, 32, 32**-0.5)
        loc = [p for n, q, base in zip(kv_lens, q_lens, (16, 64)) for p in range(base + n - q, base + n)]
        md = build_metadata(mode, kv_lens=kv_lens, q_lens=q_lens, page_table=[[1, 2], [4, 5]], out_cache_loc=loc, pool=pool)
        torch.manual_seed(7)
        pool.k_buffer(0).normal_(), pool.v_buffer(0).normal_()
        q, k, v = (torch.randn(sum(q_lens), heads, 32, generator=torch.Generator().manual_seed(seed)).to(dtype)
                   for heads, seed in ((8, 1), (2, 2), (2, 3)))
        out = torch.empty(sum(q_lens), 8, 32, dtype=dtype) if with_out else None
        result = kernel.forward(q, k, v, layer, kernel.plan(md), out=out)
        assert out is None or result is out
        results.append(result)
    assert torch.equal(results[0], results[1])
    assert native_calls == [sum(q_lens)] * 2


def _avx512() -> bool:
    with open("/proc/cpuinfo") as info:
        return " avx512f" in next((line for line in info if line.startswith("flags")), "")


# x86 builds for CPUs with fewer features than this one: without AVX-512 (tiles of 8 rows, fp16 read
# by 8-lane F16C conversions), and without F16C either (fp16 converted one element at a time).
_X86_BUILDS = {"native": (), "no-avx512": ("-mno-avx512f",), "no-avx512-no-f16c": ("-mno-avx512f", "-mno-f16c")}
_x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"),
                               reason="x86 builds: an x86 CPU whose features /proc/cpuinfo lists")


@pytest.fixture(scope="module")
def x86_builds(tmp_path_factory) -> Path:
    """A cache of this module's own for the x86 builds: each is built once for all its tests."""
    return tmp_path_factory.mktemp("x86-builds")


def _x86_build(build: str, cache: Path, monkeypatch):
    """The library built with the named build's flags (or taken from ``cache``, where it is kept)."""
    monkeypatch.setenv("HAL_CACHE_DIR", str(cache))
    compiler = os.environ.get("CC") or "cc"
    return native.bind(ctypes.CDLL(str(native._build(compiler, (*native._FLAGS, "-fopenmp", *_X86_BUILDS[build])))))


@_x86_only
@pytest.mark.parametrize("build", list(_X86_BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tiles_of_sixteen_rows_and_of_eight_match_the_oracle(build, dtype, x86_builds, monkeypatch, native_calls) -> None:
    """The library's tiles hold 16 query rows where the CPU has AVX-512 and 8 where it has not (a
    build with -mno-avx512f stands in for such a CPU here): both hold prompts, a verify block and
    GQA groups of 1, 3 and 8 to the oracle, value rows of 24 (a 16-column and an 8-column part) too."""
    library = _x86_build(build, x86_builds, monkeypatch)
    assert library.hal_paged_attention_tiles() == (16 if _avx512() and build == "native" else 8)
    monkeypatch.setattr(native, "_library", library)
    for i, group in enumerate((1, 3, 8)):
        layer = LayerSpec(0, 2 * group, 2, 16, 24, scaling=16**-0.5, sliding_window=40 if group == 3 else None, has_sinks=group == 8)
        q_lens, kv_lens = [70, 5, 1], [70, 61, 33]
        out, expect = run_cpu_kernel(M.EXTEND, layer, kv_lens, q_lens, page_size=4, dtype=dtype, seed=5 + i)
        assert_close(out, expect, dtype)
    assert native_calls == [sum(q_lens)] * 3


@_x86_only
@pytest.mark.parametrize("build", list(_X86_BUILDS))
def test_every_fp16_value_is_read_as_torch_reads_it(build, x86_builds, monkeypatch) -> None:
    """All 65536 fp16 bit patterns (subnormals, infinities and NaNs among them) as value rows, each
    request seeing one key: its output row is its value row (a weight of exactly 1), so the
    library's fp32 result equals torch's fp16 -> fp32 conversion element for element, in rows of 41
    (the 16-, 8- and 1-lane conversions all used where the build has them)."""
    library = _x86_build(build, x86_builds, monkeypatch)
    monkeypatch.setattr(native, "_library", library)
    width = 41
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = torch.cat([values, torch.zeros((-values.numel()) % width, dtype=torch.float16)]).view(-1, 1, 1, width)
    batch = values.shape[0]
    v_cache = torch.cat([torch.zeros(1, 1, 1, width, dtype=torch.float16), values])  # page 0 unused
    k_cache = torch.zeros_like(v_cache)
    table = torch.arange(1, batch + 1, dtype=torch.int32).view(batch, 1)
    ones, cu = torch.ones(batch, dtype=torch.int32), torch.arange(batch + 1, dtype=torch.int32)
    prepared = native.PreparedAttention(table, ones, cu, dtype=torch.float16, page_size=1, num_q_heads=1, num_kv_heads=1,
                                        head_dim=width, v_head_dim=width, scaling=1.0, sliding_window=None)
    out = torch.empty(batch, 1, width, dtype=torch.float32)
    prepared(torch.zeros(batch, 1, width, dtype=torch.float16), native.LayerCaches(k_cache, v_cache), out=out)
    torch.testing.assert_close(out, values.view(batch, 1, width).float(), rtol=0, atol=0, equal_nan=True)


def test_without_vector_extensions_the_library_runs_prompts_row_by_row(tmp_path, monkeypatch, native_calls) -> None:
    """A compiler without GCC's vector extensions (GCC before 12), stood in for by HAL_NO_LANES:
    the library builds without tiles, says so, and takes a prompt within the row-by-row bounds,
    matching the oracle."""
    monkeypatch.setenv("HAL_CACHE_DIR", str(tmp_path))
    compiler = os.environ.get("CC") or "cc"
    try:
        path = native._build(compiler, (*native._FLAGS, "-fopenmp", "-DHAL_NO_LANES"))
    except OSError:  # a compiler without OpenMP
        path = native._build(compiler, (*native._FLAGS, "-DHAL_NO_LANES"))
    monkeypatch.setattr(native, "_library", native.bind(ctypes.CDLL(str(path))))
    assert not native.tiles_prompts(8)
    layer = LayerSpec(1, 4, 2, 8, 8, scaling=8**-0.5, sliding_window=3, has_sinks=True)
    assert 20 > NATIVE_MAX_QUERY_ROWS and 20 * 30 + 12 * 12 <= NATIVE_MAX_ROW_KEY_PAIRS
    out, expect = run_cpu_kernel(M.EXTEND, layer, [30, 12], [20, 12], page_size=4, dtype=torch.bfloat16, seed=3)
    assert_close(out, expect, torch.bfloat16)
    assert native_calls == [32]
