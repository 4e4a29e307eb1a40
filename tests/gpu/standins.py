# SPDX-License-Identifier: Apache-2.0
"""Import stand-ins for what the GPU bundle does not carry.

The bundle carries vLLM's Python sources only, not its compiled libraries
(``vllm._C_stable_libtorch`` and the other ``*.abi3.so``), and none of the
large optional packages its import chain names (flash-attn, flashinfer, the
serving frontends, the grammar backends). :class:`StandInFinder` sits last on
``sys.meta_path``, so anything the device really has is imported as usual;
only a module under one of :data:`STAND_IN_PREFIXES` that no other finder
found gets a stand-in. Every stand-in is logged on stderr when it is
imported and when one of its names is first used, so a run says what was
not real. A name read from a stand-in is a class (``X | None`` annotations
work, and so do objects built from them at import); calling such an object
raises :class:`StandInCalled`, so a check that ran a stand-in instead of
real code fails, never passes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

# Compiled vLLM libraries (no *.so travels) and packages the device image
# lacks (its list: /work/.library/device/KINDS.md); pure-Python packages the
# import chain needs travel as wheels instead (eval/gpu_bundle.py, WHEELS).
STAND_IN_PREFIXES = (
    "vllm._C",
    "vllm._C_stable_libtorch",
    "vllm._moe_C",
    "vllm._moe_C_stable_libtorch",
    "vllm._flashmla_C",
    "vllm._flashmla_extension_C",
    "vllm._flashkda_C",
    "vllm._deepselect_C",
    "vllm._qutlass_C",
    "vllm._rocm_C",
    "vllm.cumem_allocator",
    "vllm.fs_io_C",
    "vllm.spinloop",
    "vllm.vllm_flash_attn._vllm_fa2_C",
    "vllm.vllm_flash_attn._vllm_fa3_C",
    "vllm.third_party.deep_gemm._C_extension",
    "anthropic",
    "compressed_tensors",
    "cuda.tile",
    "cudnn",
    "cutlass",
    "deep_ep",
    "deep_gemm",
    "depyf",
    "fastapi",
    "fastsafetensors",
    "flashinfer",
    "gguf",
    "humming",
    "ijson",
    "instanttensor",
    "lark",
    "llguidance",
    "lmformatenforcer",
    "mcp",
    "mistral_common",
    "model_hosting_container_standards",
    "nvtx",
    "openai",
    "openai_harmony",
    "orjson",
    "outlines_core",
    "prometheus_fastapi_instrumentator",
    "pythonjsonlogger",
    "quack",
    "starlette",
    "tilelang",
    "tokenspeed_mla",
    "tvm_ffi",
    "uvicorn",
    "watchfiles",
    "xgrammar",
)


class StandInCalled(RuntimeError):
    """Code that a check relies on ran a stand-in instead of the real thing."""


def _log(message: str) -> None:
    print(f"[k3-sppp stand-in] {message}", file=sys.stderr, flush=True)


class _StandInType(type):
    """Classes whose attributes are stand-ins too (``flashinfer.A.B``)."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in_class(f"{cls.__qualname__}.{name}", cls.__module__)

    def __getitem__(cls, item: object) -> type:
        return cls  # Generic-style subscripts in annotations.


class _StandIn(metaclass=_StandInType):
    @classmethod
    def __get_pydantic_core_schema__(cls, source: object, handler: object):
        """Pydantic models that name a stand-in type accept anything there."""
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __init__(self, *args: object, **kwargs: object) -> None:
        # Module-level objects (xgrammar formats, say) are built at import;
        # logged, so a run says that one was made.
        _log(f"instance {type(self).__module__}.{type(self).__qualname__}")

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(type(self), name)

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise StandInCalled(
            f"{type(self).__module__}.{type(self).__qualname__} was called: it "
            "is an import stand-in (not in the GPU bundle), not the real code"
        )


_USED: set[str] = set()


def _stand_in_class(qualname: str, module: str) -> type:
    full = f"{module}.{qualname}"
    if full not in _USED:
        _USED.add(full)
        _log(f"name {full}")
    return _StandInType(
        qualname.rpartition(".")[2], (_StandIn,), {"__module__": module}
    )


class StandInModule(types.ModuleType):
    """A module whose every public name is a stand-in class."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stand_in_class(name, self.__name__)
        setattr(self, name, value)
        return value


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds stand-ins for the modules under ``prefixes``; put it last."""

    def __init__(self, prefixes: tuple[str, ...] = STAND_IN_PREFIXES) -> None:
        self.prefixes = prefixes
        self.used: list[str] = []

    def covers(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.prefixes)

    def find_spec(self, fullname, path=None, target=None):
        if not self.covers(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> StandInModule:
        module = StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0+k3-sppp-stand-in"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self.used.append(module.__name__)
        _log(f"module {module.__name__}")


def install() -> StandInFinder:
    """Append the finder to ``sys.meta_path`` (once) and return it."""
    for finder in sys.meta_path:
        if isinstance(finder, StandInFinder):
            return finder
    finder = StandInFinder()
    sys.meta_path.append(finder)
    return finder


def stand_in_op_probes() -> list[str]:
    """vLLM asks its compiled library at import whether kernels are
    supported (``cutlass_scaled_mm_supports_block_fp8``, ...); without the
    library those probes answer False, logged when asked."""
    from vllm import _custom_ops as ops

    def probe(name: str):
        def answer(*args: object, **kwargs: object) -> bool:
            _log(f"op probe vllm._custom_ops.{name} answered False")
            return False

        return answer

    names = [n for n in dir(ops) if "supports" in n or n.endswith("_supported")]
    for name in names:
        setattr(ops, name, probe(name))
    return names


# Activation ops the layers look up when built on CUDA (``SiluAndMul`` and
# siblings bind ``torch.ops._C.<op>`` in ``__init__``); the test bed runs
# ``custom_ops=["none"]``, so only ``forward_native`` runs and these never
# should: calling one raises :class:`StandInCalled`.
ACTIVATION_OPS = ("silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul")
_LIBRARIES: list[object] = []


def stand_in_activation_ops() -> list[str]:
    """Register :data:`ACTIVATION_OPS` in the ``_C`` namespace, logged."""
    import torch

    if _LIBRARIES:
        return list(ACTIVATION_OPS)
    library = torch.library.Library("_C", "FRAGMENT")
    for name in ACTIVATION_OPS:
        library.define(f"{name}(Tensor(a!) out, Tensor input) -> ()")

        def called(out, input, _name=name):
            raise StandInCalled(f"torch.ops._C.{_name} is a stand-in op")

        library.impl(name, called, "CompositeExplicitAutograd")
        _log(f"op torch.ops._C.{name} (raises if called)")
    _LIBRARIES.append(library)
    return list(ACTIVATION_OPS)
