"""Random-token prompts: the synthetic workload shared by our benchmark and the baselines.

Pure Python + NumPy on purpose: this module is imported from the vLLM virtualenv too (with
``PYTHONPATH`` set to the repository root), so it must not import torch or the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def random_token_prompts(
    num_prompts: int,
    input_len: tuple[int, int],
    vocab_size: int,
    seed: int,
    exclude_ids: Iterable[int] = (),
) -> list[list[int]]:
    """Return ``num_prompts`` prompts of random token ids.

    Each prompt's length is drawn uniformly from ``[lo, hi]`` (both inclusive) and each token
    uniformly from ``range(vocab_size)`` minus ``exclude_ids`` (special tokens such as BOS/EOS).
    The result depends only on the arguments: the same seed gives the same prompts in any
    process or virtualenv.
    """
    lo, hi = int(input_len[0]), int(input_len[1])
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if lo < 1 or hi < lo:
        raise ValueError(f"input_len must satisfy 1 <= lo <= hi, got {(lo, hi)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    excluded = {int(t) for t in exclude_ids if 0 <= int(t) < vocab_size}
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.fromiter(excluded, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError("every token id is excluded")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=num_prompts)
    return [allowed[rng.integers(0, allowed.size, size=int(n))].tolist() for n in lengths]


def special_token_ids(tokenizer, extra: Iterable[int | None] = ()) -> list[int]:
    """Ids a random prompt must not contain: the tokenizer's special tokens (BOS/EOS/PAD/chat
    markers) plus ``extra``. Duck-typed over Hugging Face tokenizers, so ours and vLLM's (built
    from the same tokenizer files) give the same list."""
    ids: set[int] = set()
    ids.update(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or ()) if i is not None)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            ids.add(v)
    ids.update(int(i) for i in extra if i is not None)
    return sorted(ids)


def warmup_prompt(prompts: Sequence[Sequence[int]], length: int = 16) -> list[int]:
    """A `length`-token prompt for a benchmark's untimed warm-up that is not in the workload and
    shares no prefix with any of its prompts: one token id repeated, taken from the workload
    (so it is a valid, non-special id) and unequal to every prompt's first token.

    Why: the benches used to warm up on `prompts[0][:16]`, which left prompt 0's first block in
    every prefix cache (ours, vLLM's, llama.cpp's token-level prompt cache), so the timed run
    began with a 16-token hit nobody asked for. A prompt differing at its first token can seed
    no cache entry any workload prompt reuses, in any of the three engines."""
    firsts = {p[0] for p in prompts if p}
    token = next((t for p in prompts for t in p if t not in firsts), None)
    if token is None:  # every token of the workload starts some prompt: any other id will do
        token = next(t for t in range(max(firsts, default=0) + 2) if t not in firsts)
    return [int(token)] * length
