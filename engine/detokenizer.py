"""Incremental detokenization with stop-string handling.

Decoding the whole output after every token is O(n^2) over a request. Instead we keep two
offsets into the token list (the approach of vLLM / TGI):

    tokens[prefix_offset:read_offset]  already emitted; decoded only as left context
    tokens[read_offset:]               not yet emitted

and per push decode just `tokens[prefix_offset:]`; the delta is what that window decodes to
beyond the context's own text. The context matters for tokenizers whose decode depends on
the left neighbour (SentencePiece drops a leading space at the start of a decode). A window
whose text ends in U+FFFD is held back: a byte-level BPE token may carry only part of a
multi-byte UTF-8 character, and the next token may complete it. `finish()` flushes whatever
is still held (then a trailing U+FFFD is genuine, as in a full decode).

Stop strings work on the emitted text: once it contains a stop string it is cut there, and
any tail that could still grow into a stop string is held back, so a client never sees text
that later has to be retracted.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# Tokens of prompt kept as left context for the first output tokens.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas for one request."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output

        # Only the prompt's tail is kept, so memory and work do not scale with the prompt.
        ctx = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        ctx_text = self._decode(ctx)
        if ctx_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: its bytes would merge with the output's
            # first bytes. Start from a clean slate instead.
            ctx, ctx_text = [], ""
        self._tokens: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._prefix_text = ctx_text  # decode(tokens[prefix_offset:read_offset])

        self._decoded = ""  # all text decoded from output tokens (before stop handling)
        self._emitted = 0  # chars of _decoded handed out so far
        self._final: str | None = None  # output text once stopped/finished
        self.stopped_by: str | None = None

    # -- public ---------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """Output text emitted so far (after a stop: the final, truncated text)."""
        return self._final if self._final is not None else self._decoded[: self._emitted]

    @property
    def finished(self) -> bool:
        return self._final is not None

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated tokens; return the text that may be shown now (maybe "")."""
        if self._final is not None or not token_ids:
            return ""
        self._tokens.extend(token_ids)
        return self._accept(self._decode_new(flush=False), final=False)

    def finish(self) -> str:
        """End of generation: return everything still held back (nothing if stopped)."""
        if self._final is not None:
            return ""
        return self._accept(self._decode_new(flush=True), final=True)

    # -- detokenization -------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, flush: bool) -> str:
        """Text of tokens past read_offset, or "" while it may end in a partial character."""
        if self._read_offset == len(self._tokens):
            return ""
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT) and not flush:
            return ""  # possibly an incomplete UTF-8 sequence: wait for the next token
        if new_text == self._prefix_text:
            # The new tokens decode to nothing (e.g. skipped special tokens): consume them
            # without moving the context window.
            self._read_offset = len(self._tokens)
            return ""
        if len(new_text) < len(self._prefix_text) or not new_text.startswith(self._prefix_text):
            # Decode is not an extension of the context (unusual tokenizers): keep the
            # window and try again with more tokens; finish() emits what it can.
            if not flush:
                return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        return delta

    # -- stop strings ---------------------------------------------------------------------

    def _accept(self, delta: str, final: bool) -> str:
        """Append decoded text, apply stop strings, return the part that is safe to emit."""
        start = len(self._decoded)
        self._decoded += delta
        if self._stop:
            hit = self._find_stop(start)
            if hit is not None:
                pos, s = hit
                end = pos + len(s) if self._include_stop else pos
                self.stopped_by = s
                return self._close(end)
        if final:
            return self._close(len(self._decoded))
        safe = len(self._decoded) - self._held_back()
        out = self._decoded[self._emitted : safe]
        self._emitted = max(self._emitted, safe)
        return out

    def _close(self, end: int) -> str:
        out = self._decoded[self._emitted : end]
        self._emitted = max(self._emitted, end)
        self._final = self._decoded[:end]
        return out

    def _find_stop(self, new_from: int) -> tuple[int, str] | None:
        """Earliest stop string occurrence ending in the new text (earlier text was checked).

        Only the last len(s) - 1 old characters can be part of a new match, so the search is
        O(new text + longest stop string)."""
        best: tuple[int, str] | None = None
        for s in self._stop:
            lo = max(0, new_from - len(s) + 1)
            pos = self._decoded.find(s, lo)
            if pos != -1 and (best is None or pos < best[0] or (pos == best[0] and len(s) > len(best[1]))):
                best = (pos, s)
        return best

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._decoded
        limit = len(text) - self._emitted
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, limit), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
