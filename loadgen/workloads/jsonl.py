"""A user-supplied dataset: one JSON object per line, ``{"prompt": str | "messages": [...], "max_tokens": int}``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DatasetItem:
    prompt_text: str | None
    messages: tuple[dict, ...] | None
    max_tokens: int
    prompt_len: int  # token count (from the target's tokenizer, or an estimate)


def estimate_tokens(text: str) -> int:
    """About four characters per token for English text: used when no tokenizer is at hand."""
    return max(1, round(len(text) / 4))


def messages_text(messages: tuple[dict, ...]) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages)


def load_jsonl(path: str | Path, count_tokens: Callable[[str], int] = estimate_tokens) -> list[DatasetItem]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"dataset {path} does not exist")
    items = [
        _item(line, f"{path}:{n}", count_tokens) for n, line in enumerate(p.read_text().splitlines(), 1) if line.strip()
    ]
    if not items:
        raise ValueError(f"dataset {path} has no requests")
    return items


def _item(line: str, where: str, count_tokens: Callable[[str], int]) -> DatasetItem:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object with 'prompt' or 'messages' and 'max_tokens'")
    max_tokens = obj.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer")
    if isinstance(obj.get("prompt"), str) and obj["prompt"]:
        return DatasetItem(obj["prompt"], None, max_tokens, count_tokens(obj["prompt"]))
    msgs = obj.get("messages")
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs):
        messages = tuple(msgs)
        return DatasetItem(None, messages, max_tokens, count_tokens(messages_text(messages)))
    raise ValueError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list of {{role, content}}")
