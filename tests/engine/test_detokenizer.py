"""Tests for engine.detokenizer against SmolLM2's real (byte-level BPE) tokenizer."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
HYPO = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(hf_default_tokenizer):
    return hf_default_tokenizer  # transformers' GGUF conversion, once per session (tests/conftest.py)


# Fragments that byte-level BPE splits mid-character, plus plain ASCII and special tokens.
FRAGMENTS = [
    "😀",
    "👩‍👩‍👧",
    "🇫🇷",
    "世界",
    "你好，",
    "日本語",
    "é",
    "naïve",
    "Ørsted",
    "ß",
    "ﬁ",
    "—",
    "…",
    "\u0301",
    " ",
    "\n",
    "  ",
    "\t",
    "hello",
    " world",
    "STOP",
    "<|im_end|>",
    "<|im_start|>",
    "ü",
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=12).map("".join)


def run(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Push `ids` in chunks of the given sizes (cycled), then finish; return all deltas."""
    deltas, i, c = [], 0, 0
    while i < len(ids):
        n = max(1, chunks[c % len(chunks)]) if chunks else 1
        deltas.append(detok.push(ids[i : i + n]))
        i, c = i + n, c + 1
    deltas.append(detok.finish())
    return deltas


def check_concat(tok, ids: list[int], chunks: list[int], skip: bool, prompt: list[int] = ()) -> None:
    expected = tok.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=skip)
    deltas = run(detok, ids, chunks)
    assert "".join(deltas) == expected
    assert detok.text == expected
    if FFFD not in expected:
        assert not any(FFFD in d for d in deltas), deltas


# ----------------------------------------------------------------------------- concatenation


@HYPO
@given(text=texts, chunks=st.lists(st.integers(1, 5), max_size=6), skip=st.booleans())
def test_text_roundtrip_any_chunking(tok, text, chunks, skip):
    ids = tok.encode(text)
    check_concat(tok, ids, [], skip)  # one token at a time
    check_concat(tok, ids, chunks, skip)


@HYPO
@given(
    ids=st.lists(st.integers(0, 49151), max_size=40), chunks=st.lists(st.integers(1, 4), max_size=6), skip=st.booleans()
)
def test_random_token_ids(tok, ids, chunks, skip):
    check_concat(tok, ids, [], skip)
    check_concat(tok, ids, chunks, skip)


@HYPO
@given(
    ids=st.lists(st.sampled_from([0, 1, 2, 216, 240, 178, 7906, 40303, 218, 28, 88]), max_size=30), skip=st.booleans()
)
def test_partial_bytes_and_specials_interleaved(tok, ids, skip):
    # A small alphabet of byte-fragment tokens and specials: many incomplete characters.
    check_concat(tok, ids, [], skip)


def test_prompt_context_is_not_emitted(tok):
    prompt = tok.encode("<|im_start|>user\nSay hi 世界<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode("Hi there 😀 — 你好!")
    for skip in (True, False):
        check_concat(tok, ids, [], skip, prompt=prompt)


def test_prompt_ending_mid_character(tok):
    # 40303 starts a 4-byte emoji that the prompt never completes.
    prompt = tok.encode("abc") + [40303]
    ids = tok.encode("hello 世界")
    check_concat(tok, ids, [], True, prompt=prompt)


def test_multibyte_char_held_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits it
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"
    assert detok.finish() == ""


def test_finish_flushes_incomplete_tail(tok):
    ids = tok.encode("ok 😀")[:-1]  # cut the emoji short
    detok = IncrementalDetokenizer(tok, [])
    out = "".join(detok.push([i]) for i in ids)
    assert FFFD not in out
    assert out + detok.finish() == tok.decode(ids)


def test_work_per_push_is_bounded(tok):
    """Every decode call sees a small window, however long the output gets (O(new tokens))."""
    sizes: list[int] = []

    class Spy:
        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode(" ".join(["The quick brown fox 😀 jumps over 世界 the lazy dog."] * 40))
    detok = IncrementalDetokenizer(Spy(), tok.encode("prompt " * 100))
    out = "".join(detok.push([i]) for i in ids) + detok.finish()
    assert out == tok.decode(ids)
    assert len(ids) > 500 and max(sizes) <= 10


def test_push_after_finish_is_ignored(tok):
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(tok.encode("a b")) == "a b"
    assert detok.finish() == ""
    assert detok.push(tok.encode(" c")) == ""
    assert detok.text == "a b"


# ----------------------------------------------------------------------------- stop strings


def run_stop(
    tok, text: str, stop: list[str], include: bool = False, chunks=(1,)
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    return run(detok, tok.encode(text), list(chunks)), detok


def test_stop_cuts_text(tok):
    deltas, detok = run_stop(tok, "Hello world. STOP and more text", ["STOP"])
    assert "".join(deltas) == "Hello world. "
    assert detok.text == "Hello world. "
    assert detok.stopped_by == "STOP"
    assert detok.finished


def test_stop_included(tok):
    deltas, detok = run_stop(tok, "Hello world. STOP and more text", ["STOP"], include=True)
    assert "".join(deltas) == "Hello world. STOP"
    assert detok.text == "Hello world. STOP"


def test_stop_split_across_tokens(tok):
    text, stop = "abc xyzzyplugh tail", "zzyplu"
    ids = tok.encode(text)
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds it
    deltas, detok = run_stop(tok, text, [stop])
    assert "".join(deltas) == "abc xy"
    assert detok.stopped_by == stop


def test_stop_prefix_held_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert detok.push(tok.encode("go ")) == "go "
    assert detok.push(tok.encode("ST")) == ""  # could be the start of STOP: held
    assert detok.push(tok.encode("ARK")) == "STARK"  # was not: released
    assert detok.push(tok.encode(" ST")) == " "
    assert detok.finish() == "ST"  # end of output: a held prefix is real text
    assert detok.stopped_by is None
    assert detok.text == "go STARK ST"


def test_earliest_stop_wins(tok):
    deltas, detok = run_stop(tok, "one two three four", ["four", "two"], chunks=(50,))
    assert "".join(deltas) == "one "
    assert detok.stopped_by == "two"


def test_stop_with_multibyte(tok):
    deltas, detok = run_stop(tok, "他说：世界和平。然后", ["世界"])
    assert "".join(deltas) == "他说："
    assert detok.stopped_by == "世界"


@HYPO
@given(text=texts, data=st.data(), include=st.booleans(), chunks=st.lists(st.integers(1, 4), max_size=5))
def test_stop_never_leaks(tok, text, data, include, chunks):
    """Emitted text is always a prefix of the final text, which ends at (or after) the stop."""
    full = tok.decode(tok.encode(text), skip_special_tokens=True)
    if len(full) < 2:
        return
    a = data.draw(st.integers(0, len(full) - 1))
    b = data.draw(st.integers(a + 1, min(len(full), a + 6)))
    stop = full[a:b]
    if FFFD in stop:
        return
    cut = full.find(stop)
    expected = full[: cut + len(stop)] if include else full[:cut]
    detok = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
    emitted = ""
    ids, i, c = tok.encode(text), 0, 0
    while i < len(ids) and not detok.finished:
        n = chunks[c % len(chunks)] if chunks else 1
        emitted += detok.push(ids[i : i + n])
        assert expected.startswith(emitted)  # nothing past the stop, nothing retracted
        i, c = i + n, c + 1
    emitted += detok.finish()
    assert emitted == expected == detok.text
    assert detok.stopped_by == stop


def test_random_stress_against_reference(tok):
    """Seeded stress: random mixes, random chunking, several stop strings."""
    rng = random.Random(1234)
    for _ in range(200):
        text = "".join(rng.choice(FRAGMENTS + ["a", "b", "ab", "ba"]) for _ in range(rng.randrange(1, 15)))
        stops = [rng.choice(["ab", "世界", "STOP", "😀", "zz", "\n\n"]) for _ in range(rng.randrange(0, 3))]
        full = tok.decode(tok.encode(text), skip_special_tokens=True)
        hits = [(full.find(s), -len(s)) for s in stops if s in full]
        expected = full[: min(hits)[0]] if hits else full
        deltas, detok = run_stop(tok, text, stops, chunks=[rng.randrange(1, 4) for _ in range(3)])
        assert "".join(deltas) == expected, (text, stops)
