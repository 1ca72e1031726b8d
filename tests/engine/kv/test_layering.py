"""engine/kv is below the scheduler, the sessions and the engine: no KV module imports them at
run time (type hints only, under TYPE_CHECKING), so they cannot form an import cycle with it."""

from __future__ import annotations

import ast
from pathlib import Path

import engine.kv

KV_DIR = Path(engine.kv.__file__).parent
ABOVE = ("engine.scheduling", "engine.sessions", "engine.engine", "engine.runner", "engine.llm", "engine.async_llm")


def _runtime_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            hidden.update(id(n) for child in node.body for n in ast.walk(child))
    names = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_kv_modules_do_not_import_the_layers_above_at_run_time():
    offenders = {
        path.name: sorted(m for m in _runtime_imports(path) if m == "engine" or m.startswith(ABOVE))
        for path in sorted(KV_DIR.glob("*.py"))
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
