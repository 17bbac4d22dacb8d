"""Placeholder for SGLang's CUDA kernel package, which has no CPU build.

SGLang imports names from ``sgl_kernel`` (and its submodules) at module load; on the CPU path none
of them is called, except the CPU ops of the speculative path, which ``sgl_kernel_cpu_standins``
stands in for. Every other name here is a placeholder that raises when called and appends its name
to the file named by ``HAL_SGL_KERNEL_CALLS``, so a test can assert nothing was ever called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types


class PlaceholderCalled(RuntimeError):
    pass


def _record(name: str) -> None:
    path = os.environ.get("HAL_SGL_KERNEL_CALLS")
    if path:
        with open(path, "a") as calls:
            calls.write(name + "\n")


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        _record(self._name)
        raise PlaceholderCalled(f"{self._name} is a placeholder: sgl_kernel has no CPU build")

    def __getattr__(self, attr: str) -> "_Placeholder":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel placeholder {self._name}>"


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        for name, op in _SUBMODULE_STANDINS.get(module.__name__, {}).items():
            setattr(module, name, op)


sys.meta_path.insert(0, _SubmoduleFinder())

# Stand-ins SGLang imports from a submodule (``from sgl_kernel.speculative import ...``).
from sgl_kernel_cpu_standins import reconstruct_indices_from_tree_mask  # noqa: E402

_SUBMODULE_STANDINS = {__name__ + ".speculative": {"reconstruct_indices_from_tree_mask": reconstruct_indices_from_tree_mask}}

# The CPU ops SGLang's speculative path calls: strict pure-torch stand-ins, not placeholders.
from sgl_kernel_cpu_standins import (  # noqa: E402,F401
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    rotate_input_ids_cpu,
    verify_tree_greedy_cpu,
)
sys.modules[__name__].__class__ = _PlaceholderModule
__version__ = "0.0.0+placeholder"
