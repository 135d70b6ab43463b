"""SGLang 0.5.23's torch forms of the DeepSeek-V4.1 layers, loadable on CPU: independent oracles.

SGLang serves DeepSeek-V4.1 on GPUs; next to most of its kernels it keeps a torch form, the path it
takes off CUDA (its RMSNorm, the Engram hash and gate, the sqrtsoftplus router, the mHC mixes), and
its test kits hold pure-torch references (the attention with sinks). Other people wrote them from
the same model, so they check the engine against something other than the engine's own reading.

SGLang cannot be imported here: its package imports CUDA-only code, and many of its modules run
device probes (`is_hip()`, `get_parallel()`) or decorate kernels (`@triton.jit`) at their top. So
scripts/fetch-reference unzips its wheel into .cache/reference/sglang-0.5.23/ and this module reads
single top-level definitions out of one file (`sglang_functions`): the file is parsed, only the
definitions asked for are executed (compiled with the file's own name, so a traceback points into
SGLang's lines), in a fresh namespace that holds

- the file's imports of the standard library, torch and numpy, imported for real;
- every other name the file imports (`sglang.*`, triton, msgspec, relative imports) as a stub that
  raises `StubbedKernelError` when it is called or used as a type, so a torch form that secretly
  reaches a kernel fails loudly instead of answering something else;
- `overrides`, names the caller supplies (a module constant such as a head size, a stable top-k).

Nothing is put into sys.modules or sys.meta_path: an `import sglang` anywhere stays an ImportError.
A definition that reads another top-level name of its file needs that name asked for too (or given
in `overrides`); module-level statements that are not asked for never run.
"""

from __future__ import annotations
import __future__

import ast
import copy
import functools
import importlib
import sys
import types
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, NoReturn

from tests.support.deepinfer_reference import StubbedKernelError, _Unavailable, fetched

ROOT = Path(__file__).resolve().parents[2]
SGLANG_DIR = ROOT / ".cache" / "reference" / "sglang-0.5.23"

# Imported for real when a file imports them; everything else is a stub.
_REAL_TOP_LEVEL = frozenset({"torch", "numpy"}) | frozenset(sys.stdlib_module_names)


def sglang_present() -> bool:
    """Whether the SGLang tree is unzipped already (nothing is fetched)."""
    return (SGLANG_DIR / "sglang" / "srt").is_dir()


def sglang_root() -> Path:
    """The unzipped SGLang 0.5.23 wheel (its `sglang/` package is below it), fetched if missing."""
    return fetched("SGLang 0.5.23", SGLANG_DIR, sglang_present, "sglang")


class _SglangStub(_Unavailable):
    """A name a SGLang file imports from outside torch, numpy and the standard library."""

    def _fail(self) -> NoReturn:
        raise StubbedKernelError(f"{self._name} is a stub: SGLang's modules and kernels are not imported here")

    def __getattr__(self, attr: str) -> _SglangStub:
        if attr.startswith("__") or attr == "_name":
            raise AttributeError(attr)
        return _SglangStub(f"{self._name}.{attr}")


def _real(module: str) -> bool:
    return module.partition(".")[0] in _REAL_TOP_LEVEL


def _bind_import(node: ast.Import | ast.ImportFrom, namespace: dict[str, Any]) -> None:
    """Bind the names one import statement of the file binds: real modules or stubs."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if _real(alias.name):
                module = importlib.import_module(alias.name)
                if alias.asname is None:  # `import a.b` binds `a`
                    namespace[alias.name.partition(".")[0]] = importlib.import_module(alias.name.partition(".")[0])
                else:
                    namespace[alias.asname] = module
            else:
                bound = alias.asname or alias.name.partition(".")[0]
                namespace[bound] = _SglangStub(alias.name if alias.asname else bound)
        return
    if node.module == "__future__":
        return
    source = "." * node.level + (node.module or "")
    real = node.level == 0 and node.module is not None and _real(node.module)
    module = importlib.import_module(node.module) if real else None
    for alias in node.names:
        if alias.name == "*":
            raise ValueError(f"`from {source} import *` cannot be bound by name")
        bound = alias.asname or alias.name
        if module is not None:
            try:
                namespace[bound] = getattr(module, alias.name)
            except AttributeError:
                namespace[bound] = importlib.import_module(f"{node.module}.{alias.name}")
        else:
            namespace[bound] = _SglangStub(f"{source}.{alias.name}")


def _defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [target.id for target in node.targets if isinstance(target, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


@functools.cache
def _parsed(path: Path) -> tuple[ast.Module, int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    flags = 0
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
    return tree, flags


def sglang_functions(
    relpath: str,
    *names: str,
    overrides: Mapping[str, Any] | None = None,
    undecorated: Collection[str] = (),
) -> types.SimpleNamespace:
    """The top-level definitions `names` (functions, classes, simple assignments) of the SGLang file
    `relpath` (relative to the `sglang/` package, e.g. "srt/layers/engram.py"), executed in file
    order in one fresh namespace; see the module docstring. The definitions named in `undecorated`
    are executed without their decorators: for those that only compile (`@torch.compile(...)`, whose
    arguments call SGLang's device probes), never for one that changes what the function computes.
    Raises KeyError for a name the file does not define at its top level."""
    path = sglang_root() / "sglang" / relpath
    tree, flags = _parsed(path)
    namespace: dict[str, Any] = {
        "__name__": f"sglang_reference:{relpath}",
        "__file__": str(path),
        "__builtins__": __builtins__,
    }
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            _bind_import(node, namespace)
    namespace.update(overrides or {})
    wanted = set(names)
    chosen = [node for node in tree.body if wanted & set(_defined_names(node))]
    missing = wanted - {name for node in chosen for name in _defined_names(node)}
    if missing:
        raise KeyError(f"{relpath} defines no top-level {sorted(missing)}")
    for node in chosen:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in undecorated:
            node = copy.copy(node)
            node.decorator_list = []
        module = ast.Module(body=[node], type_ignores=[])
        exec(compile(module, str(path), "exec", flags=flags, dont_inherit=True), namespace)
    return types.SimpleNamespace(**{name: namespace[name] for name in names})
