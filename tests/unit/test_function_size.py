"""No function of the listed packages is longer than MAX_LINES: a function that long does several
things, and each of them is easier to read, test and change on its own.

A function's length runs from its `def` line (decorators not counted) to its last line, nested
functions and classes counted in their parent's length.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 150
PACKAGES = ["gateway", "engine"]


def function_lengths(path: Path) -> Iterator[tuple[str, int, int]]:
    """Each function of the file (methods and nested ones too): its qualified name, its first line
    and its length in lines."""
    tree = ast.parse(path.read_text(), filename=str(path))

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child.lineno, child.end_lineno - child.lineno + 1
            elif isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
            yield from visit(child, f"{name}." if name != prefix else prefix)

    yield from visit(tree, "")


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_longer_than_the_limit(package):
    assert sources(package), f"no Python files under {package}/"
    too_long = [
        f"{path.relative_to(ROOT)}:{line} {name}: {length} lines"
        for path in sources(package)
        for name, line, length in function_lengths(path)
        if length > MAX_LINES
    ]
    assert not too_long, f"functions over {MAX_LINES} lines:\n" + "\n".join(too_long)


def test_the_check_counts_nested_functions_in_their_parent(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(5))
    source = tmp_path / "sample.py"
    source.write_text(f"class Outer:\n    def method(self):\n        def inner():\n            pass\n{body}\n")
    lengths = {name: length for name, _, length in function_lengths(source)}
    assert lengths == {"Outer.method": 8, "Outer.method.inner": 2}
