"""The suite's own rules for a busy CI host (docs/testing.md, "Flake hunt"), checked on the test
code's syntax: what a reviewer would otherwise have to spot by eye in every new test.

- Every httpx call in a test names its timeout: httpx's default is 5 s, which a starved gateway
  or scheduler exceeds, and the test fails on the host's load instead of the code (16 calls did).
- No fixed sleep of a second or more: a test waits for the event it needs. Shorter sleeps are
  poll intervals; a pause that is itself the thing tested (a debounce window) is computed from
  the product's constant, never a bare number.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

TESTS = Path(__file__).parent
HTTPX_CALLS = {"get", "post", "put", "delete", "patch", "stream", "request", "Client", "AsyncClient"}


@functools.cache  # parsed once for the module's two scans
def _test_sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(TESTS.rglob("*.py"))]


def _httpx_calls_without_timeout(tree: ast.Module) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "httpx"
        and node.func.attr in HTTPX_CALLS
        and not any(k.arg == "timeout" for k in node.keywords)
    ]


def _fixed_sleeps(tree: ast.Module, at_least_s: float = 1.0) -> list[int]:
    def is_sleep(func: ast.expr) -> bool:
        return isinstance(func, ast.Attribute) and func.attr == "sleep" and isinstance(func.value, ast.Name)

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and is_sleep(node.func)
        and node.func.value.id in ("time", "asyncio")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, int | float)
        and node.args[0].value >= at_least_s
    ]


def test_every_httpx_call_in_the_tests_names_its_timeout():
    found = [
        f"{path.relative_to(TESTS)}:{line}"
        for path, tree in _test_sources()
        for line in _httpx_calls_without_timeout(tree)
    ]
    assert not found, f"httpx calls on its 5 s default timeout: {found}"


def test_no_test_sleeps_a_fixed_second_or_more():
    found = [f"{path.relative_to(TESTS)}:{line}" for path, tree in _test_sources() for line in _fixed_sleeps(tree)]
    assert not found, f"fixed sleeps (wait for the event instead): {found}"


def test_the_checks_find_what_they_look_for():
    """The two scans on code that breaks each rule, and on code that keeps it."""
    bad = ast.parse("import httpx, time\nhttpx.get(url)\nhttpx.post(url, json={})\ntime.sleep(2)\n")
    good = ast.parse("import httpx, time\nhttpx.get(url, timeout=60)\ntime.sleep(0.1)\ntime.sleep(DEBOUNCE_S)\n")
    assert _httpx_calls_without_timeout(bad) == [2, 3] and _fixed_sleeps(bad) == [4]
    assert _httpx_calls_without_timeout(good) == [] and _fixed_sleeps(good) == []
