"""Running Megatron-Bridge's own configuration code on a CPU, as an oracle for the validator.

Megatron-Bridge 0.6's config and validation code (with real Megatron-Core 0.19 under it) runs without a
GPU once three things are in place (REFERENCE.md section 12):

- `transformer_engine` exists: every `import megatron.bridge` reaches an unguarded
  `import transformer_engine.pytorch`, and the real extension needs CUDA to build. `install_fake_te`
  puts a stand-in on `sys.meta_path` whose modules answer any attribute with a placeholder class, so
  both libraries import as on a TE machine; `set_te_version` sets the version Core's
  `is_te_min_version` reads (its cached `megatron.core.utils._te_version`).
- the GPU is described: `target_gpu` mocks `torch.cuda.is_available` and
  `torch.cuda.get_device_properties` (Bridge reads `major` and `name`) for a catalog GPU.
- `WORLD_SIZE` is set and `MEGATRON_CONFIG_LOCK_DIR` points somewhere temporary.

Nothing here is imported by the validator; it is for the differential test, its benchmark and
`--check_with_bridge`, in a Python 3.12 environment where Megatron-Bridge is installed.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator
from typing import Any

from mbridge_epoverlap.gpus import gpu_facts

FAKE_TE_FUSED_ADAM_KEYWORDS = ("master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "use_decoupled_grad")


class _Placeholder(type):
    """A class whose missing class attributes are more placeholder classes (te.common.recipe.DelayedScaling)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholder(name, (_Any,), {"__module__": cls.__module__})
        setattr(cls, name, value)
        return value


class _Any(metaclass=_Placeholder):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


_MODULE_BASE: list[type] = []


def _layer_base() -> type:
    """The base of the placeholders in `transformer_engine.pytorch`: a `torch.nn.Module`.

    Megatron-Bridge main imports ModelOpt in its `__init__`, and ModelOpt registers TE's layer classes
    (`te.pytorch.Linear`, ...) as modules, asserting that they subclass `nn.Module`.
    """
    if not _MODULE_BASE:
        import torch

        class _AnyModule(torch.nn.Module, metaclass=_Placeholder):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                torch.nn.Module.__init__(self)

        _MODULE_BASE.append(_AnyModule)
    return _MODULE_BASE[0]


def _fused_adam(params: Any = None, *, master_weight_dtype: Any = None, exp_avg_dtype: Any = None,
                exp_avg_sq_dtype: Any = None, use_decoupled_grad: bool = False, **kwargs: Any) -> None:
    """Stand-in for TE's FusedAdam: Core's OptimizerConfig inspects these keywords."""


class _FakeTransformerEngine(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, version: str) -> None:
        self.version = version

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def missing(name: str, _module: types.ModuleType = module) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            layer = _module.__name__.startswith("transformer_engine.pytorch") and name[:1].isupper()
            value = _Placeholder(name, (_layer_base() if layer else _Any,), {"__module__": _module.__name__})
            setattr(_module, name, value)
            return value

        module.__getattr__ = missing
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "transformer_engine":
            module.__version__ = self.version
        if module.__name__ == "transformer_engine.pytorch.optimizers":
            module.FusedAdam = _fused_adam


def install_fake_te(version: str = "2.12.0") -> None:
    """Make `import transformer_engine...` work (call before Megatron-Core or Megatron-Bridge is imported)."""
    if "megatron.core" in sys.modules:
        raise RuntimeError("install the fake transformer_engine before megatron.core is imported")
    if not any(isinstance(finder, _FakeTransformerEngine) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FakeTransformerEngine(version))
    os.environ.setdefault("WORLD_SIZE", "1")
    if "MEGATRON_CONFIG_LOCK_DIR" not in os.environ:  # Bridge's config loader locks here; removed at exit
        lock_dir = tempfile.mkdtemp(prefix="mbridge-lock-")
        atexit.register(shutil.rmtree, lock_dir, ignore_errors=True)
        os.environ["MEGATRON_CONFIG_LOCK_DIR"] = lock_dir


def set_te_version(version: str | None) -> None:
    """The Transformer Engine version Megatron-Core (and Bridge through it) checks against; None: not installed."""
    from megatron.core import utils
    from packaging.version import Version

    utils._te_version = Version(version or "0.0.0")  # Core caches the version in this module global
    sys.modules["transformer_engine"].__version__ = version or "0.0.0"


@contextlib.contextmanager
def target_gpu(gpu: str | None) -> Iterator[None]:
    """torch.cuda as on one GPU of the catalog family `gpu` (None: no GPU)."""
    import torch

    saved = torch.cuda.is_available, torch.cuda.get_device_properties
    core_config, dsa_check = _dsa_kernel_check()
    if gpu is None:
        torch.cuda.is_available = lambda: False
    else:
        facts = gpu_facts(gpu)
        major, minor = facts.compute_capability or (0, 0)
        props = types.SimpleNamespace(major=major, minor=minor, name=facts.device_name or f"NVIDIA {facts.name}")
        torch.cuda.is_available = lambda: True
        torch.cuda.get_device_properties = lambda *_args, **_kwargs: props
        if dsa_check is not None:
            # Fake: a GPU machine has the fused DSA kernel packages (flash_mla, cuDNN's DSA) that a CPU machine
            # cannot install; Core checks they import once it sees CUDA (GLM-5's recipes ask for them).
            setattr(core_config, DSA_KERNEL_CHECK, lambda _backend: None)
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.get_device_properties = saved
        if dsa_check is not None:
            setattr(core_config, DSA_KERNEL_CHECK, dsa_check)


DSA_KERNEL_CHECK = "_validate_dsa_kernel_backend_dependencies"


def _dsa_kernel_check() -> tuple[Any, Any]:
    """(Megatron-Core's transformer_config module, its fused-DSA-kernel import check), or (None, None) where Core
    has no such check (before 0.19) or is not imported."""
    module = sys.modules.get("megatron.core.transformer.transformer_config")
    check = vars(module).get(DSA_KERNEL_CHECK) if module is not None else None
    return (module, check) if check is not None else (None, None)


def bridge_available() -> bool:
    """Whether Megatron-Bridge is installed in this interpreter (found, not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        return False
