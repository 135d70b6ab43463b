"""Dependencies point down: services use the engine and common code, never one another.

The first check reads every module of every top-level package (with `ast`: nothing is
imported, so it sees imports inside functions and under TYPE_CHECKING too, and the module
names given to importlib.import_module) and holds each first-party import against ALLOWED.
An import that crosses a boundary fails here, not in a deployment (a cache host without
torch, a gateway image without the model code), and a new edge needs a row that says why.

The second (tests/integration/test_import_boundaries.py) imports a service's modules in a fresh
interpreter and lists what came along: what a module imports in turn, third-party packages included.

The third holds every third-party import of the installed packages against what `pip install
deepmesh` installs (the Dockerfile's install: no extras), read from the distributions' own
metadata: a library that only the test extra brought along fails here, not in the image.

The fourth holds engine.LLMEngine against what the workers' base class asks of it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "common",
    "engine",
    "cache_svc",
    "gateway",
    "tokenizer_svc",
    "encoder_svc",
    "prefill_svc",
    "decode_svc",
    "deepmesh",
)
EVERYTHING = tuple(f"{package}.*" for package in PACKAGES)

# package -> the first-party modules outside itself it may import: a module by its name, or a
# package and every module in it by "package.*" ("engine" alone: what engine/__init__.py exports).
# As strict as the code allows.
ALLOWED: dict[str, tuple[str, ...]] = {
    # contracts every service shares: it depends on no service and no engine, so that each of
    # them can take it along
    "common": (),
    # torch-side code shared by prefill and decode: the block size, the key and retention rules
    # and the data it exchanges with a KV store (through its PrefixStore Protocol), metrics and
    # spans. Never the wire messages, the bus, the database or a service: it runs embedded in
    # any of them, and on hosts with none of them
    "engine": (
        "common.blocks",
        "common.cache_entries",
        "common.images",
        "common.metrics",
        "common.prefixes",
        "common.retention",
        "common.tracing",
    ),
    # bytes and metadata only: runs where no model can, so nothing of the engine; the engine
    # side reaches it through engine.prefix_store.PrefixStore, which it satisfies by shape
    "cache_svc": ("common.*",),
    # HTTP in, Kafka out: talks to the other services through messages only
    "gateway": ("common.*",),
    # messages in and out; the engine's config readers alone (engine.families picks V4's or V4.1's),
    # to read a checkpoint's family, context length and end tokens when a codec is built for it
    # (Codec.for_model, inside the function)
    "tokenizer_svc": ("common.*", "engine.config", "engine.families"),
    # consume, run the engine through its public API (its package's exports) and its connector
    # to any KV store, produce: no cache_svc, the store is handed in by whoever wires the mesh
    # images in, rows to the KV cache, the job on to prefill: the engine's vision tower and
    # image rows through its public API, the store handed in like prefill's
    "encoder_svc": ("common.*", "engine", "engine.prefix_store"),
    "prefill_svc": ("common.*", "engine", "engine.prefix_connector", "engine.prefix_store"),
    "decode_svc": ("common.*", "engine", "engine.prefix_connector", "engine.prefix_store"),
    # wires everything together: the CLI and the embedded mesh pick the concrete stores
    "deepmesh": EVERYTHING,
    # measure any part, some with the test suite's fault injection
    "benchmarks": (*EVERYTHING, "tests.*"),
    # test any part, and the routing simulation, whose replica model its benchmark's numbers rest on
    "tests": (*EVERYTHING, "benchmarks.routing_sim"),
    # tools run beside the project, against a running server (scripts/compat: the benchmark and
    # evaluation clients in an environment of their own): they import none of it
    "scripts": (),
}


def top_level_packages() -> set[str]:
    """Every top-level directory with Python in it: each needs a row."""
    return {
        path.name
        for path in ROOT.iterdir()
        if path.is_dir() and not path.name.startswith(".") and next(path.rglob("*.py"), None) is not None
    }


def module_of(name: str) -> str:
    """The module an imported name is: `common.metrics` for `from common import metrics`."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:end])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts[:end])
    return name


def imports_of(path: Path) -> list[tuple[int, str]]:
    return imports_in(path.read_text(), path.relative_to(ROOT).with_suffix("").parts[:-1])


def imports_in(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, module) of every import in a module of `package`: statements anywhere in it,
    relative ones resolved, and string literals given to import_module."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            base = base if node.level else node.module or ""
            found += [(node.lineno, module_of(f"{base}.{alias.name}")) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def allowed(package: str, module: str) -> bool:
    for name in ALLOWED[package]:
        if name.endswith(".*"):
            if module == name[:-2] or module.startswith(name[:-1]):
                return True
        elif module == name:
            return True
    return False


def test_every_package_has_a_row():
    assert top_level_packages() <= set(ALLOWED), "a new top-level package: give it a row in ALLOWED"


def imports_in_packages(packages: Iterable[str]) -> Iterator[tuple[str, str, str]]:
    """(package, `path:line`, module) of every import in every module of these packages."""
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in imports_of(path):
                yield package, f"{path.relative_to(ROOT)}:{line}", module


def test_every_first_party_import_is_in_the_table():
    first_party = set(ALLOWED)
    crossing = []
    for package, where, module in imports_in_packages(sorted(top_level_packages() & first_party)):
        top = module.split(".")[0]
        if top in first_party and top != package and not allowed(package, module):
            crossing.append(f"{where} imports {module}")
    assert crossing == [], "imports outside ALLOWED:\n" + "\n".join(crossing)


def test_the_table_catches_a_forbidden_import():
    """The check itself: each kind of import the table forbids is found, and refused."""
    probe = (
        "import importlib\n"
        "from common.messages import Envelope\n"
        "from . import llm_engine\n"
        "def later():\n"
        "    import cache_svc.store\n"
        "    from common import bus\n"
        "    return importlib.import_module('gateway.app')\n"
    )
    found = {name for _, name in imports_in(probe, ("engine",))} - {"importlib", "engine.llm_engine"}  # its own
    assert found == {"common.messages", "cache_svc.store", "common.bus", "gateway.app"}
    assert [name for name in sorted(found) if allowed("engine", name)] == []
    assert allowed("engine", "common.prefixes") and not allowed("engine", "common")
    assert allowed("prefill_svc", "engine") and not allowed("prefill_svc", "engine.llm_engine")
    assert allowed("prefill_svc", "common.worker") and not allowed("prefill_svc", "cache_svc.client")
    assert not allowed("cache_svc", "engine") and not allowed("common", "common_extra")


def installed_packages() -> list[str]:
    """The packages `pip install deepmesh` installs (pyproject.toml's `packages.find`)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(p.removesuffix("*") for p in patterns)


def runtime_distributions(project: str = "deepmesh") -> set[str]:
    """Every distribution that installing `project` without extras brings: its requirements and
    theirs, each with the extras asked of it (`psycopg[binary]`), markers evaluated here."""
    wanted: list[tuple[str, frozenset[str]]] = [(project, frozenset())]
    found: set[tuple[str, frozenset[str]]] = set()
    while wanted:
        name, extras = wanted.pop()
        if (name, extras) in found:
            continue
        found.add((name, extras))
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in extras | {""}):
                wanted.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return {name for name, _ in found} - {project}


def third_party_imports(packages: list[str]) -> dict[str, list[str]]:
    """Top-level module -> where it is imported, for every import outside the standard library and
    the project in `packages`' modules (inside functions too: a command's lazy import is as needed)."""
    first_party = set(ALLOWED)
    found: dict[str, list[str]] = {}
    for _, where, module in imports_in_packages(packages):
        top = module.split(".")[0]
        if top not in sys.stdlib_module_names and top not in first_party and top != "__future__":
            found.setdefault(top, []).append(where)
    return found


def test_every_third_party_import_is_installed_without_extras():
    """`pip install .` (the Dockerfile's) must bring every library the services import: the test
    extra (transformers, httpx, ...) is on every developer's machine and in no image. A module
    that several distributions provide (opentelemetry) needs one of them."""
    runtime = runtime_distributions()
    provided = importlib.metadata.packages_distributions()
    packages = installed_packages()
    assert set(packages) <= set(PACKAGES), "a package installed but not checked: add it to PACKAGES"
    missing = [
        f"{module} ({', '.join(provided.get(module, ['no distribution']))}), imported at {', '.join(where[:3])}"
        for module, where in sorted(third_party_imports(packages).items())
        if not {canonicalize_name(d) for d in provided.get(module, [])} & runtime
    ]
    assert missing == [], "imported, but not installed by pyproject.toml's dependencies:\n" + "\n".join(missing)


def test_the_runtime_set_leaves_the_test_extra_out():
    """The check itself: the closure follows requirements and their extras, and no test-only one."""
    runtime = runtime_distributions()
    assert {"torch", "fastapi", "starlette", "psycopg", "psycopg-binary", "kafka-python"} <= runtime
    assert not {"transformers", "pytest", "openai", "schemathesis"} & runtime
    probe = third_party_imports(["tests"])
    assert "pytest" in probe and "common" not in probe and "json" not in probe


def test_the_engine_has_what_its_workers_ask_of_it():
    """LLMEngine and PrefixConnector have every call of the Protocols common.worker.EngineWorker
    types them by (StageEngine, StateSaver), taking their parameters (names, order, defaults):
    common names no engine code, so nothing else checks it."""
    from common.worker import StageEngine, StateSaver
    from engine import LLMEngine
    from engine.prefix_connector import PrefixConnector

    for protocol, implementation in ((StageEngine, LLMEngine), (StateSaver, PrefixConnector)):
        for name, wanted in inspect.getmembers(protocol, inspect.isfunction):
            if name.startswith("_"):
                continue
            where = f"{implementation.__name__}.{name}"
            assert hasattr(implementation, name), f"no {where}"
            wanted_parameters = list(inspect.signature(wanted).parameters.values())
            given = list(inspect.signature(getattr(implementation, name)).parameters.values())
            assert [(p.name, p.default) for p in given[: len(wanted_parameters)]] == [
                (p.name, p.default) for p in wanted_parameters
            ], where
            assert all(p.default is not inspect.Parameter.empty for p in given[len(wanted_parameters) :]), where
