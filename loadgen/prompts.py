"""Prompt token ids for a request spec: random ids (deterministic per request id), the user's
text through the target's tokenizer, and the session's history in front of a new turn."""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import numpy as np

from loadgen.workloads.spec import RequestSpec


class PromptBuilder:
    def __init__(self, vocab_size: int, seed: int, exclude_ids: Iterable[int] = (), tokenizer=None) -> None:
        excluded = np.fromiter((int(i) for i in exclude_ids if 0 <= int(i) < vocab_size), dtype=np.int64)
        self.allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), excluded)
        if self.allowed.size == 0:
            raise ValueError("every token id is excluded")
        self.seed = seed
        self.tokenizer = tokenizer

    def new_tokens(self, spec: RequestSpec) -> list[int]:
        """The tokens this request adds (the whole prompt for a single-turn request)."""
        if spec.prompt_text is not None and self.tokenizer is not None:
            return list(self.tokenizer.encode(spec.prompt_text))
        if spec.messages is not None and self.tokenizer is not None:
            from engine.llm import apply_chat_template

            return list(apply_chat_template(self.tokenizer, list(spec.messages)))
        rng = np.random.default_rng([self.seed, 2, zlib.crc32(spec.request_id.encode())])
        return self.allowed[rng.integers(0, self.allowed.size, size=spec.prompt_len)].tolist()

    def prompt(self, spec: RequestSpec, history: list[int] | None) -> list[int]:
        return (history or []) + self.new_tokens(spec)
