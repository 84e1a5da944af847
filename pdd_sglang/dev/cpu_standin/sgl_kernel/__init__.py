"""Import-only stand-in for ``sgl_kernel`` on SGLang's CPU engine.

SGLang imports kernels by name at module level even on paths that never call them on CPU. This
module answers every such import (``sgl_kernel.X`` and ``from sgl_kernel.sub import Y``) with a
named placeholder; calling one raises ``NotImplementedError`` naming the kernel, so a CPU run that
reaches GPU code fails loudly instead of computing something wrong.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

__version__ = "0.0.0+pdd-cpu-standin"
PDD_CPU_STANDIN = True

if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
    # On a GPU machine a silently stubbed kernel would be a correctness bug; the real package
    # must be installed there (the GPU profile of scripts/setup_env.sh).
    raise ImportError(
        "sgl_kernel here is pdd-sglang's CPU import stand-in, which is only for "
        "SGLANG_USE_CPU_ENGINE=1. Install the GPU profile to get the real sgl_kernel."
    )


class KernelNotAvailableOnCpu(NotImplementedError):
    pass


class _Placeholder:
    """Stands for one kernel or class; any use other than import raises, naming it."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def _fail(self, *args, **kwargs):
        raise KernelNotAvailableOnCpu(
            f"{self._qualname} was called, but sgl_kernel is pdd-sglang's CPU import stand-in: "
            "this code path needs the real GPU kernel. Use a CPU-capable option "
            "(for example --attention-backend torch_native) or the GPU profile."
        )

    __call__ = _fail

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel CPU stand-in for {self._qualname}>"


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str):
        # Dunders must stay missing, or importlib and inspect take the module for something else.
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.modules[__name__].__class__ = _StandinModule
sys.meta_path.insert(0, _StandinFinder())
