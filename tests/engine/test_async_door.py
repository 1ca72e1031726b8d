"""`AsyncLLM` as the only way into a running engine: requests with text and chat prompts
tokenized on the engine thread, checks, prompt-length-dependent parameters, token texts for
logprobs, stream closing, and the session door (subscribe, info, prefetch, release, export,
adopt, the pull decision)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from engine import LLM, AsyncLLM, ChatPrompt, EngineConfig, SamplingParams, TextPrompt
from engine.loader import load_tokenizer, resolve_model
from engine.prompts import apply_chat_template, encode_prompt
from engine.sessions import KVFormatError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CHAT = [{"role": "user", "content": "Name three rivers."}]


def _config(path, **kw) -> EngineConfig:
    base = dict(model=str(path), dtype="float32", num_blocks=48, max_model_len=256, max_num_seqs=4)
    return EngineConfig(**{**base, **kw})


def _run(config: EngineConfig, body):
    async def main():
        llm = AsyncLLM(config)
        await llm.start()
        try:
            return await body(llm)
        finally:
            await llm.shutdown()

    return asyncio.run(main())


async def _collect(stream) -> list:
    return [d async for d in stream]


@pytest.mark.timeout(300)
def test_prompts_are_tokenized_on_the_engine_thread(tiny_model_dir):
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(resolve_model(str(path)))  # this test's own copy, on this thread
    text_ids = tokenizer("The river flows").input_ids
    chat_ids = apply_chat_template(tokenizer, CHAT)
    offline = LLM(_config(path)).generate([chat_ids], GREEDY)[0]

    async def body(llm: AsyncLLM):
        assert llm.info.max_model_len == 256 and llm.info.dtype == "float32" and llm.info.kv_blocks == 48
        assert await llm.encode(TextPrompt("The river flows")) == text_ids
        assert await llm.encode(ChatPrompt(CHAT)) == chat_ids
        stream = await llm.add_request("chat", ChatPrompt(CHAT), GREEDY)
        deltas = await _collect(stream)
        text_stream = await llm.add_request("text", TextPrompt("The river flows"), GREEDY)
        await _collect(text_stream)
        return stream.num_prompt_tokens, text_stream.num_prompt_tokens, deltas, stream

    n_chat, n_text, deltas, stream = _run(_config(path), body)
    assert (n_chat, n_text) == (len(chat_ids), len(text_ids))
    assert [t for d in deltas for t in d.token_ids] == offline.token_ids
    assert "".join(d.text for d in deltas) == offline.text
    assert deltas[-1].finished and deltas[-1].metrics.num_prompt_tokens == len(chat_ids)
    assert all(d.token_texts is None for d in deltas)  # no logprobs asked for
    # The hand-off's stamps (the worker's stage spans): taken, queued, then stepped, in order.
    stamps = [stream.picked_ns, stream.queued_ns]
    for d in deltas:
        stamps += [d.step_started_ns, d.posted_ns]
    assert 0 < stamps[0] and stamps == sorted(stamps), stamps


@pytest.mark.timeout(300)
def test_params_from_the_prompt_length_check_and_refusals(tiny_model_dir):
    path = tiny_model_dir("llama")
    seen: list[int] = []

    def params_for(n_prompt: int) -> SamplingParams:
        seen.append(n_prompt)
        if n_prompt > 100:
            raise ValueError(f"too long: {n_prompt}")
        return SamplingParams(temperature=0, max_tokens=200 - n_prompt, ignore_eos=True)

    async def body(llm: AsyncLLM):
        checked = await llm.check(list(range(10, 60)), params_for)
        with pytest.raises(ValueError, match="too long: 150"):
            await llm.check(list(range(10, 160)), params_for)
        with pytest.raises(ValueError, match="context"):  # the engine's own validation, resumed tokens counted
            await llm.check(list(range(10, 60)), SamplingParams(max_tokens=8), resumed_output_ids=[5] * 220)
        with pytest.raises(ValueError, match="too long"):
            await llm.add_request("refused", list(range(10, 160)), params_for)
        with pytest.raises(ValueError, match="empty"):
            await llm.add_request("empty", [], GREEDY)
        nothing_added = llm.snapshot().num_unfinished == 0 and not await llm.call(lambda e: e.has_unfinished())
        deltas = await _collect(await llm.add_request("ok", list(range(10, 60)), params_for))
        return checked, nothing_added, deltas

    checked, nothing_added, deltas = _run(_config(path), body)
    assert checked.prompt_token_ids == list(range(10, 60)) and checked.params.max_tokens == 150
    assert seen[:2] == [50, 150] and nothing_added
    assert sum(len(d.token_ids) for d in deltas) == 150  # the parameters came from the prompt's length


@pytest.mark.timeout(300)
def test_token_texts_and_closing_a_stream_aborts(tiny_model_dir):
    path = tiny_model_dir("llama")
    tokenizer = load_tokenizer(resolve_model(str(path)))

    async def body(llm: AsyncLLM):
        with_lp = await _collect(
            await llm.add_request("lp", [11, 12, 13], SamplingParams(temperature=0, max_tokens=5, logprobs=True))
        )
        long = await llm.add_request("long", [11, 12, 13], SamplingParams(max_tokens=200, ignore_eos=True))
        first = await long.__anext__()
        long.close()  # leaves early: the abort follows the request to the engine thread
        after_close = [d async for d in long]  # a closed stream ends; it does not wait for deltas
        still_there = await llm.call(lambda e: e.has_unfinished())
        again = await llm.add_request("long", [11, 12, 13], GREEDY)  # the id is free again
        await _collect(again)
        return with_lp, first, after_close, still_there, llm.snapshot()

    with_lp, first, after_close, still_there, snap = _run(_config(path), body)
    for d in with_lp:
        assert d.token_texts == [tokenizer.decode([t]) for t in d.token_ids] and len(d.logprobs) == len(d.token_ids)
    assert first.token_ids and after_close == [] and not still_there
    assert snap.num_unfinished == 0 and snap.kv_blocks_used == 0  # the aborted request's KV was freed


def test_a_prompt_the_tokenizer_cannot_take_is_bad_input():
    class Refusing:
        chat_template = "{{ raise_exception('roles must alternate') }}"

        def apply_chat_template(self, *a, **kw):
            raise RuntimeError("roles must alternate")  # what jinja's TemplateError amounts to

    with pytest.raises(ValueError, match="could not be tokenized: roles must alternate"):
        encode_prompt(Refusing(), ChatPrompt(CHAT))
    assert encode_prompt(Refusing(), (1, 2, 3)) == [1, 2, 3]
    for text in (TextPrompt("hi"), ChatPrompt(CHAT)):  # a model without a tokenizer (dummy weights)
        with pytest.raises(ValueError, match="no tokenizer .*token ids"):
            encode_prompt(None, text)
    assert encode_prompt(None, [4, 5]) == [4, 5]


@pytest.mark.timeout(300)
def test_session_door(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    prompt = list(range(20, 60))  # 40 tokens + 8 generated, 47 with KV: 2 full blocks of 16 kept
    holder_dir, other_dir = tmp_path / "holder", tmp_path / "other"

    async def holder(llm: AsyncLLM):
        seen: asyncio.Queue = asyncio.Queue()
        assert await llm.sessions.subscribe(seen.put_nowait) == 0
        await _collect(await llm.add_request("t1", prompt, GREEDY, session_id="chat"))
        kept = await asyncio.wait_for(seen.get(), 60)  # the listener runs on this loop
        info = await llm.sessions.info("chat")
        prefetch = await llm.sessions.prefetch("chat")
        await llm.sessions.release("chat")
        unknown = await llm.sessions.prefetch("nobody")
        exported = await llm.sessions.export_path("chat")
        copy = tmp_path / "copy.kv"
        shutil.copy(exported, copy)
        pull = await llm.sessions.should_pull(32)
        await llm.sessions.record_pull(1 << 20, 0.01)
        return kept, info, prefetch, unknown, copy, pull, await llm.sessions.export_path("nobody")

    kept, info, prefetch, unknown, copy, pull, none = _run(_config(path, session_dir=str(holder_dir)), holder)
    assert kept.session_id == "chat" and kept.num_tokens == 32 and info.num_tokens == 32
    assert prefetch.found and prefetch.tier == "gpu" and not unknown.found
    assert isinstance(pull, bool) and none is None

    async def adopter(llm: AsyncLLM):
        seen: asyncio.Queue = asyncio.Queue()
        await llm.sessions.subscribe(seen.put_nowait)
        adopted = await llm.sessions.adopt_file(copy)
        bad = tmp_path / "bad.kv"
        bad.write_bytes(b"not a kv file" * 100)
        with pytest.raises(KVFormatError):
            await llm.sessions.adopt_file(bad)
        deltas = await _collect(await llm.add_request("t2", prompt + [7] * 12, GREEDY, session_id="chat"))
        return adopted, await asyncio.wait_for(seen.get(), 60), bad.exists(), deltas

    adopted, notified, bad_left, deltas = _run(_config(path, session_dir=str(other_dir)), adopter)
    assert adopted.session_id == "chat" and adopted.num_tokens == 32 and notified.session_id == "chat"
    assert not bad_left  # a refused file is deleted
    assert deltas[-1].metrics.num_cached_tokens == 32  # the adopted KV served the next turn
