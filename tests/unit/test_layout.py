"""The source tree shows the architecture: few top-level modules, and imports that run one way.

Each package may import only the packages declared below it in ``LAYERS`` (and itself, and
``errors``). The composition root ``train.py`` is a layer of its own, between the CLI and the
rest; the entry points (``__init__``, ``__main__``) may import anything.
Imports are read with ``ast``, including those inside functions, so a lazy import cannot hide an
upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "lmtune"
# Top to bottom: a package imports only packages that come after it in this list.
LAYERS = (
    "cli",
    "train",
    "tools",
    "testing",
    "training",
    "checkpoint",
    "objectives",
    "outputs",
    "model",
    "data",
    "parallel",
    "config",
)
ROOT_MODULES = {"__init__", "__main__", "errors", "train"}
TOP_MODULES_AT_MOST = 6


def _imported_packages(path: Path) -> set[str]:
    """The lmtune packages (or top-level modules) that ``path`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "lmtune" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_few_top_level_modules() -> None:
    modules = {p.stem for p in SRC.glob("*.py")}
    assert len(modules) <= TOP_MODULES_AT_MOST, sorted(modules)
    assert modules <= ROOT_MODULES, sorted(modules - ROOT_MODULES)


def test_every_package_is_declared() -> None:
    packages = {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert packages | {"train"} == set(LAYERS)


def test_imports_run_one_way() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        package = path.relative_to(SRC).parts[0].removesuffix(".py")
        if package not in rank:
            continue  # an entry point, or errors.py (which imports nothing of lmtune)
        for target in _imported_packages(path):
            if target == package or target in ("errors", "__version__"):
                continue
            if target not in rank or rank[target] < rank[package]:
                upward.append(f"{path.relative_to(SRC)} imports lmtune.{target}")
    assert not upward, "imports against the declared order:\n" + "\n".join(upward)


MAX_FUNCTION_LINES, MAX_PARAMETERS, MAX_MODULE_LINES, MAX_TRAIN_LINES = 80, 8, 500, 250


def test_functions_and_modules_stay_small() -> None:
    """No function over 80 lines or 8 parameters, no module over 500 lines, train.py one screenful
    of composition (250 lines)."""
    too_big = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(SRC))
        lines = len(text.splitlines())
        if lines > (MAX_TRAIN_LINES if name == "train.py" else MAX_MODULE_LINES):
            too_big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            args = node.args
            count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
            count -= bool(args.args) and args.args[0].arg in ("self", "cls")
            if length > MAX_FUNCTION_LINES or count > MAX_PARAMETERS:
                too_big.append(f"{name}:{node.lineno} {node.name}: {length} lines, {count} parameters")
    assert not too_big, "\n".join(too_big)
