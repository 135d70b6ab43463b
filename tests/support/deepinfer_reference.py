"""DeepInfer 0.1.0's plain-torch references, importable on CPU: independent oracles for the engine.

DeepInfer serves the DeepSeek-V4 family on GPUs. Next to each of its TileLang kernels it keeps a
plain-torch twin, `<kernel>_ref`, that its own tests hold the kernel against; its Engram metadata
(the compressed vocabulary, the hash tables' primes and multipliers) is plain Python. Those are
written by other people from the same model, so a test that compares the engine with them checks
the engine against something other than the engine's own reading of the model.

DeepInfer cannot be pip-installed here: it needs Python >= 3.12, and CUDA to build. So
scripts/fetch-reference unpacks its source distribution into .cache/reference/, and this module
imports single files of that tree: the modules of `deepinfer/model_executor/layers/tilelang_ops/`
(`tilelang_op`) and `deepinfer/model_executor/models/v4_modules/engram_metadata.py`
(`engram_metadata`). Those files import CUDA-only packages and the kernel dispatcher at their top,
for their kernel functions; here every such name is a stub that raises `StubbedKernelError` when it
is called (or used in `isinstance`), so a reference that secretly needs a kernel fails loudly
instead of answering something else. `deepinfer` and its subpackages are bare packages that hold
only the files asked for: DeepInfer's own `__init__.py` files (which set process-wide environment
variables and probe the accelerator) never run.

The DeepInfer files import one another by their `deepinfer.*` names, so while one is imported those
names, and the stubs' finder for the CUDA-only packages, are in `sys.modules` and `sys.meta_path`.
Only then: afterwards both are as they were, and an `import deepinfer` or `import tilelang`
anywhere else (in deepmesh's packages above all) fails as it does in production. The modules
imported are kept here and put back for the next import. A reference that imports a `deepinfer`
module inside its body, when called, therefore fails too (none of the `*_ref` functions does).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FETCH_SCRIPT = ROOT / "scripts" / "fetch-reference"
REFERENCE_DIR = ROOT / ".cache" / "reference" / "deepinfer-0.1.0"

# The packages DeepInfer's kernels come from: CUDA-only, never installed next to deepmesh.
CUDA_ONLY = (
    "tilelang",
    "tile_kernels",
    "deep_gemm",
    "flash_mla",
    "flash_attn",
    "deep_ep",
    "deep_select",
    "deep_cluster",
)

OPS_PACKAGE = "deepinfer.model_executor.layers.tilelang_ops"
V4_MODULES_PACKAGE = "deepinfer.model_executor.models.v4_modules"
VISION_PACKAGE = "deepinfer.model_executor.models.vision_encoder"


class ReferenceUnavailableError(RuntimeError):
    """The DeepInfer tree is not in .cache/reference/ and scripts/fetch-reference could not fetch it."""


class StubbedKernelError(RuntimeError):
    """A DeepInfer reference reached a CUDA kernel or a native type, which this machine does not have."""


def reference_present() -> bool:
    """Whether the DeepInfer tree is unpacked already (nothing is fetched)."""
    return (REFERENCE_DIR / "deepinfer").is_dir()


# for tests that use the references: skipped only where the tree is missing and nothing asks for it
# (`make test` sets DEEPMESH_REQUIRE_REFERENCE after fetching it, so there they fail instead)
requires_reference = pytest.mark.skipif(
    not reference_present() and not os.environ.get("DEEPMESH_REQUIRE_REFERENCE"),
    reason=f"no DeepInfer reference in {REFERENCE_DIR}: run scripts/fetch-reference "
    "(set DEEPMESH_REQUIRE_REFERENCE=1 to fail instead)",
)


@functools.cache
def _fetch(*args: str) -> subprocess.CompletedProcess[str]:
    """scripts/fetch-reference with these arguments, run at most once a process whatever it answers."""
    return subprocess.run([str(FETCH_SCRIPT), *args], capture_output=True, text=True, check=False)


def fetched(name: str, directory: Path, present: Callable[[], bool], *args: str) -> Path:
    """`directory`, where `present()` finds the reference `name` unpacked: fetched first by
    `scripts/fetch-reference ARGS` if it is missing (a fresh clone)."""
    if not present():
        result = _fetch(*args)
        if result.returncode != 0 or not present():
            command = " ".join([str(FETCH_SCRIPT), *args])
            raise ReferenceUnavailableError(
                f"the {name} reference is not in {directory} and `{command}` failed "
                f"(exit {result.returncode}): {result.stderr.strip() or result.stdout.strip() or 'no output'}"
            )
    return directory


def deepinfer_root() -> Path:
    """The unpacked DeepInfer 0.1.0 source tree, fetched first if it is missing (a fresh clone)."""
    return fetched("DeepInfer 0.1.0", REFERENCE_DIR, reference_present)


class _Unavailable:
    """A name from a stubbed module: raises when called or used as a type, its attributes likewise."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self) -> NoReturn:
        raise StubbedKernelError(f"{self._name} is a stub: DeepInfer's CUDA kernels and native types do not exist here")

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        self._fail()

    def __instancecheck__(self, instance: object) -> NoReturn:
        self._fail()

    def __subclasscheck__(self, subclass: type) -> NoReturn:
        self._fail()

    def __getattr__(self, attr: str) -> _Unavailable:
        if attr.startswith("__") or attr == "_name":
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __or__(self, other: object) -> _Unavailable:
        return self  # `A | B` in an annotation evaluated when its function is defined

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    """A module every public name of which is an `_Unavailable`."""

    def __getattr__(self, attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")

    def __repr__(self) -> str:
        return f"<stub module {self.__name__}>"


class _CudaOnlyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the CUDA-only packages, and every module in them, as `_StubModule`s; nothing else."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in CUDA_ONLY:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _package(name: str, path: Path | None = None) -> types.ModuleType:
    """A package without an `__init__.py` run: submodules come from `path`, or only from sys.modules."""
    module = types.ModuleType(name)
    module.__path__ = [str(path)] if path is not None else []
    return module


def _skeleton(root: Path) -> dict[str, types.ModuleType]:
    """The `deepinfer` packages the reference files import, as bare packages with what they read."""
    source = root / "deepinfer"
    deepinfer = _package("deepinfer")
    # the CUDA platform's values: the references are what its kernels are held against
    deepinfer.PLATFORM = types.SimpleNamespace(
        is_gpu=True, is_npu=False, fp8_sf_type=torch.int32, tilelang_ops_backend="cuda"
    )
    ops = _StubModule(f"{OPS_PACKAGE}.ops")  # the kernel dispatcher: every `ops.<kernel>_tl` raises
    modules = {
        "deepinfer": deepinfer,
        "deepinfer.model_executor": _package("deepinfer.model_executor"),
        "deepinfer.model_executor.layers": _package("deepinfer.model_executor.layers"),
        OPS_PACKAGE: _package(OPS_PACKAGE, source / "model_executor" / "layers" / "tilelang_ops"),
        ops.__name__: ops,
        # pybind types of deepinfer._C, read by the sampling modules
        "deepinfer.model_executor.sampling_inputs": _StubModule("deepinfer.model_executor.sampling_inputs"),
        "deepinfer.model_executor.models": _package("deepinfer.model_executor.models"),
        V4_MODULES_PACKAGE: _package(V4_MODULES_PACKAGE, source / "model_executor" / "models" / "v4_modules"),
        VISION_PACKAGE: _package(VISION_PACKAGE, source / "model_executor" / "models" / "vision_encoder"),
        # the image preprocessing (plain Python: PIL, numpy) and the checkpoint's tensor names
        "deepinfer.ve": _package("deepinfer.ve", source / "ve"),
        "deepinfer.ve.processor": _package("deepinfer.ve.processor", source / "ve" / "processor"),
        "deepinfer.hugging_face": _package("deepinfer.hugging_face", source / "hugging_face"),
    }
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


def _import_file(name: str, path: Path) -> types.ModuleType:
    """The module at `path` imported as `name`, a submodule of a package that has no path to find it."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    return module


@functools.cache
def _pytest_for_deepinfer() -> types.ModuleType:
    """pytest as the DeepInfer files see it. They hold their own tests, under marks (`benchmark`)
    that this project does not register, and --strict-markers fails the import of such a module
    inside a pytest run. So their `pytest.mark` is a generator bound to no configuration."""
    module = types.ModuleType("pytest")
    module.__dict__.update(vars(pytest))
    module.mark = pytest.MarkGenerator(_ispytest=True)
    return module


_lock = threading.Lock()
_loaded: dict[str, types.ModuleType] = {}


def _ours(name: str) -> bool:
    top = name.partition(".")[0]
    return top == "deepinfer" or top in CUDA_ONLY


@contextlib.contextmanager
def _importable() -> Iterator[None]:
    """`deepinfer.*` and the stubs in sys.modules, and the CUDA-only finder on sys.meta_path, for
    the duration; then sys.modules and sys.meta_path as they were, and what was imported kept."""
    with _lock:
        root = deepinfer_root()
        shadowed = {name: module for name, module in sys.modules.items() if _ours(name)}
        for name in shadowed:
            del sys.modules[name]
        finder = _CudaOnlyFinder()
        sys.meta_path.insert(0, finder)
        sys.modules["pytest"] = _pytest_for_deepinfer()
        try:
            if "deepinfer.testing" in _loaded:  # the skeleton is whole
                sys.modules.update(_loaded)
            else:
                _loaded.clear()
                sys.modules.update(_skeleton(root))
                # two plain-Python modules of the package root: AttrDict (the configs) and assert_close
                deepinfer = sys.modules["deepinfer"]
                deepinfer.AttrDict = _import_file("deepinfer.attrdict", root / "deepinfer" / "attrdict.py").AttrDict
                _import_file("deepinfer.testing", root / "deepinfer" / "testing.py")
                # read by the ViT's module (a decorator's timer) and by the image processor
                _import_file("deepinfer.timer", root / "deepinfer" / "timer.py")
                _import_file("deepinfer.multimodal_tokens", root / "deepinfer" / "multimodal_tokens.py")
            yield
        finally:
            sys.meta_path.remove(finder)
            sys.modules["pytest"] = pytest
            for name in [name for name in sys.modules if _ours(name)]:
                _loaded[name] = sys.modules.pop(name)
            sys.modules.update(shadowed)


def _import(name: str) -> types.ModuleType:
    with _importable():
        return importlib.import_module(name)


def tilelang_op(name: str) -> types.ModuleType:
    """`deepinfer.model_executor.layers.tilelang_ops.<name>`, e.g. `tilelang_op("compress")`."""
    return _import(f"{OPS_PACKAGE}.{name}")


def engram_metadata() -> types.ModuleType:
    """`deepinfer.model_executor.models.v4_modules.engram_metadata`: CompressedVocabulary and
    EngramLayout run; NgramHashMapping stops at its last line, `tile_kernels...make_offsets`."""
    return _import(f"{V4_MODULES_PACKAGE}.engram_metadata")


def vision_module(name: str) -> types.ModuleType:
    """`deepinfer.model_executor.models.vision_encoder.<name>`: `vit` (the ViT, whose kernels are
    stubs) or `mlp_projector` (the aligner)."""
    return _import(f"{VISION_PACKAGE}.{name}")


def image_processor() -> types.ModuleType:
    """`deepinfer.ve.processor.image_processor`: the image's layout (grid, token types, patch positions)."""
    return _import("deepinfer.ve.processor.image_processor")


def checkpoint_names() -> types.ModuleType:
    """`deepinfer.hugging_face.names`: checkpoint tensor names to DeepInfer's module names."""
    return _import("deepinfer.hugging_face.names")
