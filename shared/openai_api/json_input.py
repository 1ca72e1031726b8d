"""JSON from clients (request bodies, WebSocket frames, batch input lines), parsed with bounds.

Python's `json.loads` recurses once per nesting level: `[[[[...]]]]` a few hundred thousand deep
(well under a 4 MiB body) raises `RecursionError`, which is no `ValueError`, so a handler that
catches bad JSON answered it with a 500, and the queue service's validation failed the same way
on every tick. `pydantic_core.from_json` stops at a fixed depth with a `ValueError` instead, and
rejects the non-JSON `NaN`/`Infinity` that `json.loads` lets through.
"""

from __future__ import annotations

from typing import Any

import pydantic_core


def loads(raw: bytes | str) -> Any:
    """The JSON value in `raw`. Raises ValueError (saying what is wrong) for anything that is not
    strict JSON, nested too deeply included."""
    return pydantic_core.from_json(raw, allow_inf_nan=False)
