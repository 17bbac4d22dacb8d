"""The CPU backend's compiled kernel (``paged_attention.c``): built on first use with the machine's
C compiler into hal's cache, loaded as a Python extension module (``paged_attention_module.c``)
where the interpreter's headers are installed and through ctypes elsewhere, and held to
``hal.oracle`` like the torch kernel.

Why compiled, and why this way: a decode step's attention is a few microseconds of arithmetic,
and the pure-torch kernel spends about a hundred on op dispatch and index bookkeeping around it.
The C file includes no torch header, so it builds in seconds (7 s with GCC 12 at -O3) with any
C11 compiler, at first use rather than at install: ``pip install`` stays pure Python, and a machine with no
compiler (or ``HAL_CPU_NATIVE=0``) runs the pure-torch kernel, which serves every batch; why the
compiled one is not in use is ``native_status()``, which ``hal info`` prints. The extension module
takes a layer call's arguments as they are, where ctypes converts each by its declared type (about
a tenth of the cost per call, more once an engine's other work has left ctypes out of cache); both
expose the same functions. It is built with OpenMP where the compiler has it, and then splits a
large call across torch's own worker threads (the libgomp torch loaded), never threads of its own
beside them.

The build lands in ``$HAL_CACHE_DIR`` (default ``$XDG_CACHE_HOME/hal``, else ``~/.cache/hal``)
under a name hashing the sources, the flags, the compiler, the interpreter's ABI (for the module)
and the CPU's features, written to a temporary file and renamed into place, so processes building
at once (tensor-parallel ranks) never load a half-written library.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

_SOURCE = Path(__file__).with_name("paged_attention.c")
# The same functions as a Python extension module (it includes _SOURCE), and the name it registers.
_MODULE_SOURCE = Path(__file__).with_name("paged_attention_module.c")
_MODULE_NAME = "_hal_paged_attention"
# -fopenmp-simd: the source's simd pragmas (vectorised reductions) without an OpenMP runtime;
# -march=native: the library is built for, and cached per, the CPU it runs on.
_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=fast", "-march=native")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
# The loaded kernel: the extension module or the ctypes library, which expose the same functions
# (hal_attention_prepare, hal_attention_run, hal_attention_release, hal_paged_attention_tiles).
_library: Any = None
_status: str | None = None  # None: not tried yet
_tiles_of: tuple[Any, bool] = (None, False)  # (library, whether it runs prompts by tiles)


def cache_dir() -> Path:
    """Where built libraries are kept."""
    explicit = os.environ.get("HAL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hal"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _python_includes() -> list[str]:
    """The directories holding the interpreter's headers, ``Python.h`` first; an ``OSError`` where
    they are not installed (a Python without its development files)."""
    paths = sysconfig.get_paths()
    include = paths["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        raise OSError(f"no Python.h in {include} (the interpreter's development headers are not installed)")
    return list(dict.fromkeys([include, paths.get("platinclude") or include]))


def _build(compiler: str, flags: tuple[str, ...], *, module: bool = False) -> Path:
    """The library built from ``_SOURCE`` with ``flags`` (or the extension module, from
    ``_MODULE_SOURCE``, with the interpreter's headers), from hal's cache when built before."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    includes = [f"-I{path}" for path in _python_includes()] if module else []
    parts = [_SOURCE.read_bytes(), " ".join(flags).encode(), version.encode(), platform.machine().encode(),
             _cpu_features().encode()]
    if module:
        parts += [_MODULE_SOURCE.read_bytes(), " ".join(includes).encode(), platform.python_version().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = cache_dir() / (f"paged_attention_module-{key}{suffix}" if module else f"paged_attention-{key}.so")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        source = _MODULE_SOURCE if module else _SOURCE
        result = subprocess.run([compiler, *flags, *includes, str(source), "-o", str(built), "-lm"], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def load_module(path: Path) -> ModuleType:
    """The extension module built at ``path`` (``_build(..., module=True)``), loaded."""
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not loadable as an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_built(compiler: str, flags: tuple[str, ...]) -> tuple[Any, Path, str]:
    """The kernel built with ``flags``, its path and how it is called: the extension module where it
    builds and loads, else the ctypes library (an ``OSError`` when that does not build either)."""
    try:
        path = _build(compiler, flags, module=True)
        return load_module(path), path, "as a Python extension module"
    except (OSError, subprocess.SubprocessError, ImportError) as error:
        why = str(error).splitlines()[0] if str(error) else type(error).__name__
    path = _build(compiler, flags)
    return bind(ctypes.CDLL(str(path))), path, f"through ctypes (no extension module: {why})"


def _load() -> None:
    global _library, _status
    if os.environ.get("HAL_CPU_NATIVE", "1") == "0":
        _status = "off: HAL_CPU_NATIVE=0"
        return
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        _status = f"unavailable: no C compiler ({compiler!r} is not on PATH; set CC)"
        return
    threads = "torch's OpenMP threads"
    try:
        try:  # OpenMP: libgomp.so.1, which torch has loaded already, so the kernel shares torch's worker pool
            library, path, called = _load_built(compiler, (*_FLAGS, "-fopenmp"))
        except (OSError, subprocess.SubprocessError) as error:
            library, path, called = _load_built(compiler, _FLAGS)
            threads = f"one thread (without OpenMP: {str(error).splitlines()[0]})"
    except (OSError, subprocess.SubprocessError) as error:
        _status = f"unavailable: {error}"
        return
    _library, _status = library, f"in use: {path}, called {called}, on {threads}"


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """The built library with its functions' argument and result types set (ctypes converts each
    call's arguments by them)."""
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    library.hal_attention_prepare.argtypes = [i32, i32, i32, i32, i32, i32, ptr, i64, ptr, ptr, i32, ctypes.c_float, i32, i32, i32]
    library.hal_attention_prepare.restype = ptr
    library.hal_attention_run.argtypes = [ptr, ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i32,
                                          ptr, i64, i64, ptr, i64, i64]
    library.hal_attention_run.restype = i32
    library.hal_attention_release.argtypes = [ptr]
    library.hal_attention_release.restype = None
    library.hal_paged_attention_tiles.restype = i32
    return library


def native_status() -> str:
    """Whether the compiled kernel is in use (and the library's path), or why not; builds it when
    nothing has been tried in this process."""
    with _lock:
        if _status is None:
            _load()
    assert _status is not None
    return _status


def available() -> bool:
    """Whether ``paged_attention`` below can run (the library built and loaded)."""
    if _status is None:
        native_status()
    return _library is not None


def tiles_prompts(v_head_dim: int) -> bool:
    """Whether the library runs long prompts of this value head dim by tiles, 16 query rows at once
    (8 without AVX-512; built with the vector extensions, value rows a whole number of eight lanes),
    faster than torch's flash attention; else prompts are row by row, for short ones only."""
    global _tiles_of
    if not available() or v_head_dim % 8:
        return False
    if _tiles_of[0] is not _library:  # asked of the library once (a call per forward otherwise)
        _tiles_of = (_library, bool(_library.hal_paged_attention_tiles()))  # type: ignore[union-attr]
    return _tiles_of[1]


def reads_lengths(block_table: torch.Tensor, kv_lens: torch.Tensor, cu_q_lens: torch.Tensor) -> bool:
    """Whether the kernel reads these metadata tensors as they are: int32, the table's rows of unit
    stride (``build_metadata`` makes them so; a record an engine builds itself may not)."""
    return block_table.dtype == kv_lens.dtype == cu_q_lens.dtype == torch.int32 and block_table.stride(-1) == 1


def reads_rows(*tensors: torch.Tensor) -> bool:
    """Whether the kernel reads these tensors (queries, caches, new K/V rows) as they are: one dtype
    it knows, and a unit stride along each head dim (the other strides are passed in)."""
    dtype = tensors[0].dtype
    return dtype in _DTYPE_CODES and all(t.dtype == dtype and t.stride(-1) == 1 for t in tensors)


class LayerCaches:
    """One layer's K and V caches (``[pages + 1, page_size, Hkv, D]``, unit stride in D) and the
    arguments that name them to the library, worked out once."""

    __slots__ = ("k", "v", "arguments")

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.arguments = (k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3])


class PreparedAttention:
    """One kind of layer's compiled attention for one forward, prepared once (the batch's lengths
    and block table, the heads, dims, scale and window, how the work is split) and run per layer
    call with the layer's caches, the query, the new K/V rows and the output: what a layer call
    costs beyond the arithmetic is one call into the library. The caller checked the arguments
    (``validate_attention_call``, ``pool.slots_for_forward``) and that the kernel reads them as they
    are (``reads_rows``, ``reads_lengths``); the metadata tensors are held here for as long as the
    preparation lives."""

    __slots__ = ("_handle", "_run", "_release", "_held", "_out_shape", "_out_dtype", "_dtype")

    def __init__(
        self,
        block_table: torch.Tensor,  # [B, max_pages] int32
        kv_lens: torch.Tensor,  # [B] int32
        cu_q_lens: torch.Tensor,  # [B + 1] int32
        *,
        dtype: torch.dtype,
        page_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        scaling: float,
        sliding_window: int | None,
    ) -> None:
        assert _library is not None, "PreparedAttention made without available()"
        assert dtype in _DTYPE_CODES and reads_lengths(block_table, kv_lens, cu_q_lens)
        # fp32 and bf16 rows are written by the kernel; fp16 ones converted from fp32 afterwards
        self._out_dtype = dtype if dtype != torch.float16 else torch.float32
        self._dtype = dtype
        self._out_shape = (num_q_heads, v_head_dim)
        kv_lens, cu_q_lens = kv_lens.contiguous(), cu_q_lens.contiguous()
        self._held = (block_table, kv_lens, cu_q_lens)  # the library keeps pointers into them
        handle = _library.hal_attention_prepare(
            _DTYPE_CODES[dtype], page_size, num_q_heads, num_kv_heads, head_dim, v_head_dim,
            block_table.data_ptr(), block_table.stride(0), kv_lens.data_ptr(), cu_q_lens.data_ptr(), kv_lens.shape[0],
            scaling, -1 if sliding_window is None else sliding_window, _DTYPE_CODES[self._out_dtype], torch.get_num_threads(),
        )
        if not handle:
            raise MemoryError("hal's compiled CPU attention could not allocate its plan of the call")
        self._handle = handle
        self._run = _library.hal_attention_run
        self._release = _library.hal_attention_release  # held: module globals may be gone when the last one is freed

    def __del__(self) -> None:
        # made once per kind of layer per forward: a plain __del__ costs less than a finalizer
        handle = getattr(self, "_handle", None)
        if handle:
            self._release(handle)

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, Dk]
        caches: LayerCaches,
        sinks: torch.Tensor | None = None,  # [Hq]
        write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # (slots [N] int64, k [N, Hkv, Dk], v [N, Hkv, Dv])
        out: torch.Tensor | None = None,  # [T, Hq, Dv] contiguous, q's dtype
    ) -> torch.Tensor:
        """``hal.oracle.paged_oracle``'s result for ``q`` over the layer's ``caches``, in ``q``'s dtype,
        written into ``out`` when given (and returned); with ``write``, first ``k_cache[slot] = k[i]``
        and ``v_cache[slot] = v[i]`` for each ``slots[i]`` (int64, contiguous: ``pool.slots_for_forward``'s)."""
        into = out if out is not None and out.dtype is self._out_dtype else None  # fp16 goes through fp32
        result = into if into is not None else torch.empty((q.shape[0], *self._out_shape), dtype=self._out_dtype)
        sink_row = None if sinks is None else sinks.to(torch.float32).contiguous()  # held until the call returns
        if write is None:
            new_rows: tuple[int | None, ...] = (None, 0, None, 0, 0, None, 0, 0)
        else:
            slots, k_new, v_new = write
            k_strides, v_strides = k_new.stride(), v_new.stride()
            new_rows = (slots.data_ptr(), slots.shape[0], k_new.data_ptr(), k_strides[0], k_strides[1], v_new.data_ptr(),
                        v_strides[0], v_strides[1])
        q_strides = q.stride()
        status = self._run(self._handle, q.data_ptr(), q_strides[0], q_strides[1], result.data_ptr(), *caches.arguments,
                           None if sink_row is None else sink_row.data_ptr(), *new_rows)
        if status != 0:
            raise MemoryError("hal's compiled CPU attention could not allocate its scratch rows")
        if result is into:
            return result
        if out is not None:
            return out.copy_(result)
        return result if self._out_dtype is self._dtype else result.to(self._dtype)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [pages + 1, page_size, Hkv, Dk]
    v_cache: torch.Tensor,  # [pages + 1, page_size, Hkv, Dv]
    block_table: torch.Tensor,  # [B, max_pages] int32
    kv_lens: torch.Tensor,  # [B] int32
    cu_q_lens: torch.Tensor,  # [B + 1] int32
    *,
    scaling: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,  # [Hq]
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # (slots [N] int64, k [N, Hkv, Dk], v [N, Hkv, Dv])
) -> torch.Tensor:
    """``hal.oracle.paged_oracle``'s result (chains only, no tree mask) from the compiled kernel in
    one call (a ``PreparedAttention`` prepared and run once), in ``q``'s dtype; with ``write``,
    first ``k_cache[slot] = k[i]`` and ``v_cache[slot] = v[i]`` for each ``slots[i]`` (slot: page *
    page_size + offset). The caller checked the arguments and that the kernel reads them as they
    are (``reads_rows``, ``reads_lengths``)."""
    assert reads_rows(q, k_cache, v_cache, *(write or ())[1:])
    _, page_size, hkv, dk = k_cache.shape
    prepared = PreparedAttention(block_table, kv_lens, cu_q_lens, dtype=q.dtype, page_size=page_size, num_q_heads=q.shape[1],
                                 num_kv_heads=hkv, head_dim=dk, v_head_dim=v_cache.shape[-1], scaling=scaling,
                                 sliding_window=sliding_window)
    if write is not None:
        write = (write[0].contiguous(), write[1], write[2])
    return prepared(q, LayerCaches(k_cache, v_cache), sinks, write)
