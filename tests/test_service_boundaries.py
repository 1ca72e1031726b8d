"""Services own their code: no module under `services/<a>/` imports another service's package
(`services.<b>`, b != a), and nothing under `shared/` imports a service at all. What two services
both need lives in `shared/` (docs/services.md, "Code layout"). The check reads the source with
`ast`, so imports inside functions and relative imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE_PACKAGES = frozenset(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file())


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(source: str, module: str, is_package: bool) -> list[str]:
    """Every module `source` imports, as absolute names (`from services import gateway`: `services.gateway`)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if "." in base:
                found.append(base)
            else:  # `from services import gateway` imports a package by its alias
                found += [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
    return found


def boundary_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `module` that cross a service boundary."""
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 2 and parts[1] in SERVICE_PACKAGES:
        own = parts[1]
    elif parts[0] == "shared":
        own = None  # shared code may not depend on any service
    else:
        return []
    bad = []
    for name in _imported_modules(source, module, is_package):
        target = name.split(".")
        if target[0] == "services" and len(target) > 1 and target[1] in SERVICE_PACKAGES and target[1] != own:
            bad.append(name)
    return bad


@pytest.mark.parametrize(
    "module, source, crossed",
    [
        ("services.queue.items", "from services.gateway.responses import usage", True),
        ("services.queue.items", "import services.gateway.workers", True),
        ("services.queue.items", "from services import gateway", True),
        ("services.queue.items", "def f():\n    from ..gateway import app", True),
        ("shared.batchstore.db", "from services.queue.validation import BatchLine", True),
        ("services.queue.items", "from services.queue.validation import ENDPOINTS", False),
        ("services.queue.items", "from . import validation", False),
        ("services.queue.cli", "from services.runtime import run_service", False),
        ("services.cli", "from services.gateway import cli", False),  # the entry point lists every service
    ],
)
def test_the_check_sees_every_form_of_import(module, source, crossed):
    assert bool(boundary_violations(source, module)) == crossed


def test_no_service_imports_another_service_and_shared_imports_none():
    files = sorted((ROOT / "services").rglob("*.py")) + sorted((ROOT / "shared").rglob("*.py"))
    assert any(f.parent.name == "queue" for f in files) and any(f.parent.name == "gateway" for f in files)
    crossings = {
        str(f.relative_to(ROOT)): bad
        for f in files
        if (bad := boundary_violations(f.read_text(), _module_name(f), f.name == "__init__.py"))
    }
    assert not crossings, f"move what both services need into shared/: {crossings}"
