"""The chat page end to end, in headless Chromium (Debian's `chromium`, driven by Playwright; no
browser download) against a real stack: the broker, scheduler, a worker on the default model,
the advisory service and the gateway, each its own process.

What a person does: type (the hint reaches the advisory topic and the advisory service places
the session), send, watch the answer stream in, ask a follow-up that reuses the kept KV (cached
tokens in the usage line), open a second conversation (a new session id). The page's text and
usage line are checked against the SSE stream the gateway sent.

The default model, not a tiny one: a tiny model decodes so fast that a whole answer can reach the
browser in one network read, and "streamed, token by token" could not be told from "one shot".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from contextlib import asynccontextmanager

import httpx
import pytest

from engine.config import EngineConfig
from services.gateway.settings import GatewaySettings
from shared.kafka import KafkaClient, fetch_decoded
from shared.schemas.sessions import SessionPlacement, TypingHint
from shared.settings import ServiceSettings
from shared.topics import Topics

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MAX_TOKENS = 24
BLOCK_SIZE = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "block_size")
DEBOUNCE_S = GatewaySettings.model_fields["typing_debounce_s"].default
UI_TIMEOUT_MS = 120_000  # a safety net: a starved browser, gateway or worker answers late, never wrongly

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (`make test` installs it)"),
]

# Records the answer's text length once per rendering task (chunks handled within one task count
# once), so several entries mean the DOM grew over several network reads: streamed, not one shot.
WATCH_STREAM_JS = """(sid) => {
  window.__watch?.disconnect();
  const view = document.querySelector(`.conversation[data-session-id="${sid}"]`);
  const seen = window.__streamed = [];
  let sameTask = false;
  window.__watch = new MutationObserver(() => {
    const contents = view.querySelectorAll(".message.assistant .content");
    const len = contents.length ? contents[contents.length - 1].textContent.length : 0;
    if (sameTask) { seen[seen.length - 1] = len; return; }
    seen.push(len);
    sameTask = true;
    setTimeout(() => { sameTask = false; }, 0);
  });
  window.__watch.observe(view, { childList: true, subtree: true, characterData: true });
}"""

# Keeps a copy of every chat response body, read alongside the page's own reader (a tee, so the
# page still gets each chunk as it arrives). CDP's own copy of a streamed body is not reliable.
COPY_STREAMS_JS = """(() => {
  const realFetch = window.fetch;
  window.__sse = [];
  window.fetch = async (...args) => {
    const response = await realFetch(...args);
    if (!String(args[0]).endsWith("/v1/chat/completions") || !response.body) return response;
    const [forPage, copy] = response.body.tee();
    const entry = { done: false, text: "" };
    window.__sse.push(entry);
    (async () => {
      const reader = copy.pipeThrough(new TextDecoderStream()).getReader();
      for (let r = await reader.read(); !r.done; r = await reader.read()) entry.text += r.value;
      entry.done = true;
    })();
    return new Response(forPage, { status: response.status, statusText: response.statusText, headers: response.headers });
  };
})();"""

# A network that drops WebSocket upgrades: every socket closes before it opens.
NO_WEBSOCKET_JS = """window.WebSocket = class {
  static OPEN = 1;
  constructor() {
    this.readyState = 0;
    setTimeout(() => { this.readyState = 3; this.onclose?.(new CloseEvent("close", { code: 1006 })); }, 10);
  }
  send() { throw new Error("not open"); }
  close() {}
};"""


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack()
    s.scheduler()
    s.spawn(
        "w0",
        "worker",
        "--model",
        "default",
        "--dtype",
        "bfloat16",
        "--kv-cache-gib",
        "0.25",
        "--num-threads",
        "1",
        "--worker-id",
        "w0",
    )
    s.spawn("advisory", "advisory")
    s.gateway()
    s.wait_workers(1)
    return s


class TopicReader:
    """A real Kafka consumer on one topic, from its end, keeping what it has seen."""

    def __init__(self, stack, topic: str, cls) -> None:
        self.kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-chat-page")
        self.topic, self.cls = topic, cls
        self.seen: list = []

    async def start(self) -> TopicReader:
        self.consumer = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(self.consumer, self.topic, from_end=True)
        return self

    async def poll(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.seen += await fetch_decoded(self.consumer, self.cls, timeout_ms=200)

    async def wait_for(self, match, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for m in self.seen if match(m)]
            if found:
                return found[0]
            self.seen += await fetch_decoded(self.consumer, self.cls, timeout_ms=200)
        raise AssertionError(f"no matching {self.cls.__name__} on {self.topic} within {timeout}s; saw {self.seen}")

    async def stop(self) -> None:
        await self.kafka.stop()


class ChatPage:
    """The page in one browser tab, with the steps a person takes."""

    def __init__(self, page) -> None:
        self.page = page
        self.errors: list[str] = []
        self.requests = 0
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))

    async def open(self, url: str) -> None:
        from playwright.async_api import expect

        await self.page.add_init_script(COPY_STREAMS_JS)
        await self.page.goto(url)
        await expect(self.page.locator("#model")).to_have_value("default", timeout=UI_TIMEOUT_MS)
        await self.page.fill("#max-tokens", str(MAX_TOKENS))
        await self.page.fill("#temperature", "0")  # greedy: the same answer every run

    async def session_id(self) -> str:
        return await self.page.text_content("#session-id")

    def view(self, sid: str):
        return self.page.locator(f'.conversation[data-session-id="{sid}"]')

    async def type(self, text: str) -> None:
        await self.page.locator("#input").press_sequentially(text, delay=15)

    async def send(self) -> dict:
        """Presses Enter; returns the chat request the page sent (headers, body, its number)."""
        async with self.page.expect_request("**/v1/chat/completions") as req:
            await self.page.locator("#input").press("Enter")
        r = await req.value
        self.requests += 1
        return {"headers": await r.all_headers(), "body": r.post_data_json, "index": self.requests - 1}

    async def answer(self, sid: str, turn: int, sent: dict) -> dict:
        """Waits for answer number `turn` (0-based) of a conversation; checks that the page shows
        exactly what the gateway streamed (text and usage); returns them."""
        from playwright.async_api import expect

        bubble = self.view(sid).locator(".message.assistant").nth(turn)
        usage = bubble.locator("[data-testid=usage]")
        await expect(usage).to_be_visible(timeout=UI_TIMEOUT_MS)
        await expect(self.view(sid)).to_have_attribute("data-busy", "false", timeout=UI_TIMEOUT_MS)
        shown = {
            "text": await bubble.locator(".content").text_content(),
            **{k: await usage.get_attribute(f"data-{k}-tokens") for k in ("prompt", "cached", "completion")},
        }
        raw = await (
            await self.page.wait_for_function("i => window.__sse[i]?.done && window.__sse[i].text", arg=sent["index"])
        ).json_value()
        streamed_text, streamed_usage = _sse_content(raw)
        assert shown["text"] == streamed_text
        assert shown["prompt"] == str(streamed_usage["prompt_tokens"])
        assert shown["completion"] == str(streamed_usage["completion_tokens"])
        assert shown["cached"] == str(streamed_usage["prompt_tokens_details"]["cached_tokens"])
        return shown


def _sse_content(raw: str) -> tuple[str, dict | None]:
    """The answer's text and the usage chunk of an SSE body."""
    text, usage = "", None
    for line in raw.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return text, usage


@asynccontextmanager
async def _readers(stack, *topics: tuple[str, type]):
    readers = [await TopicReader(stack, name, cls).start() for name, cls in topics]
    try:
        yield readers
    finally:
        for r in readers:
            await r.stop()


@asynccontextmanager
async def _chat_page(stack, *init_scripts: str):
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = await browser.new_page()
            for js in init_scripts:
                await page.add_init_script(js)
            chat = ChatPage(page)
            await chat.open(stack.url)
            yield chat
        finally:
            await browser.close()


def _assert_streamed(lengths: list[int]) -> None:
    grown = [n for n in lengths if n > 0]
    assert grown == sorted(grown), f"the answer's text shrank while streaming: {lengths}"
    assert len(set(grown)) >= 3, f"the answer appeared in fewer than 3 rendering steps (not streamed): {lengths}"


def test_type_send_stream_follow_up_and_new_conversation(stack):
    asyncio.run(_conversation(stack))


async def _conversation(stack) -> None:
    t = Topics(stack.prefix)
    async with (
        _readers(stack, (t.advisory.name, TypingHint), (t.sessions_placement.name, SessionPlacement)) as (
            hints,
            placements,
        ),
        _chat_page(stack) as chat,
    ):
        sid = await chat.session_id()
        question = "Tell me a story about the sea."
        hint1 = await _type_first_question(chat, hints, sid, question)
        first, body1 = await _first_turn(chat, sid, question)
        await _follow_up(chat, hints, placements, sid, hint1, first, body1)
        await _second_conversation(chat, hints, sid)
        assert chat.errors == []


async def _type_first_question(chat: ChatPage, hints: TopicReader, sid: str, question: str) -> TypingHint:
    """A hint over the WebSocket reaches the advisory topic; a burst of keystrokes is one frame
    per debounce interval (page) and one hint per interval (gateway)."""
    from playwright.async_api import expect

    frames: list[str] = []
    chat.page.on("websocket", lambda ws: ws.on("framesent", lambda payload: frames.append(payload)))
    started = time.monotonic()
    await chat.type(question)
    typing_s = time.monotonic() - started
    hint1 = await hints.wait_for(lambda h: h.session_id == sid)
    assert hint1.source == "websocket"
    await expect(chat.page.locator("#hint-status")).to_have_attribute("data-status", "sent")
    await hints.poll(0.3)
    # The page's throttle, bounded by the typing time this test recorded: one frame when the
    # socket opens, then at most one per interval. (It also asserted `< len(question)`, i.e.
    # that typing 30 keys took under 58 s of wall time: a bound on load, not on the page; on a
    # quiet host typing takes ~0.5 s, and the bound above is then exactly one frame.)
    assert 1 <= len(frames) <= 1 + typing_s // DEBOUNCE_S, (frames, typing_s)
    assert {json.loads(f)["type"] for f in frames} == {"keystroke"}
    burst = [h for h in hints.seen if h.session_id == sid and h.sent_at < hint1.sent_at + DEBOUNCE_S]
    assert burst == [hint1], hints.seen
    return hint1


async def _first_turn(chat: ChatPage, sid: str, question: str) -> tuple[dict, dict]:
    """The session header, the one-message history, usage asked for; the answer streams in."""
    await chat.page.evaluate(WATCH_STREAM_JS, sid)
    sent = await chat.send()
    assert sent["headers"]["x-session-id"] == sid
    body = sent["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": question}]
    first = await chat.answer(sid, 0, sent)
    _assert_streamed(await chat.page.evaluate("window.__streamed"))
    assert first["text"] and int(first["completion"]) > 0 and first["cached"] != ""
    return first, body


async def _follow_up(chat, hints, placements, sid: str, hint1: TypingHint, first: dict, body1: dict) -> None:
    """Typed after a pause (a new burst): the advisory service places the session, and the turn
    reuses the KV kept from turn 1 (at least its prompt's full blocks), shown in the usage line."""
    from playwright.async_api import expect

    await asyncio.sleep(max(0.0, hint1.sent_at + DEBOUNCE_S + 0.2 - time.time()))
    await chat.type("And then?")
    hint2 = await hints.wait_for(lambda h: h.session_id == sid and h.hint_id != hint1.hint_id)
    placed = await placements.wait_for(lambda p: p.hint_id == hint2.hint_id)
    assert placed.session_id == sid and placed.worker_id == "w0"
    await chat.page.evaluate(WATCH_STREAM_JS, sid)
    sent = await chat.send()
    assert sent["body"]["messages"] == [
        *body1["messages"],
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "And then?"},
    ]
    second = await chat.answer(sid, 1, sent)
    _assert_streamed(await chat.page.evaluate("window.__streamed"))
    turn1_prompt = int(first["prompt"])
    assert int(second["prompt"]) > turn1_prompt
    assert int(second["cached"]) >= turn1_prompt // BLOCK_SIZE * BLOCK_SIZE > 0, (first, second)
    await expect(chat.page.locator(".usage").nth(1)).to_contain_text(f"({second['cached']} cached)")


async def _second_conversation(chat: ChatPage, hints: TopicReader, sid: str) -> None:
    """A new session id and a fresh history; switching back shows the first one again."""
    from playwright.async_api import expect

    await chat.page.click("#new-conversation")
    sid2 = await chat.session_id()
    assert sid2 != sid and len(sid2) == 36
    await expect(chat.page.locator("#conversations li")).to_have_count(2)
    await chat.type("Hello there.")
    await hints.wait_for(lambda h: h.session_id == sid2)
    sent = await chat.send()
    assert sent["headers"]["x-session-id"] == sid2
    assert sent["body"]["messages"] == [{"role": "user", "content": "Hello there."}]
    await chat.answer(sid2, 0, sent)
    await chat.page.click(f'#conversations li[data-session-id="{sid}"]')
    await expect(chat.page.locator("#session-id")).to_have_text(sid)
    await expect(chat.view(sid).locator("[data-testid=message]")).to_have_count(4)
    await expect(chat.view(sid2)).to_be_hidden()


def test_hints_fall_back_to_post_and_errors_are_shown(stack):
    asyncio.run(_fallback_and_errors(stack))


async def _fallback_and_errors(stack) -> None:
    from playwright.async_api import expect

    async with (
        _readers(stack, (Topics(stack.prefix).advisory.name, TypingHint)) as (hints,),
        _chat_page(stack, NO_WEBSOCKET_JS) as chat,
    ):
        sid = await chat.session_id()
        await chat.type("Hi")
        hint = await hints.wait_for(lambda h: h.session_id == sid)
        assert hint.source == "http"
        await expect(chat.page.locator("#hint-status")).to_have_attribute("data-via", "http")

        # A prompt longer than the model's context: the OpenAI error's message is shown, and the
        # failed turn is left out of the history the next message sends.
        too_long = "word " * 9000  # the default model has 8192 positions
        await chat.page.fill("#input", too_long)
        await chat.send()
        expected = httpx.post(
            f"{stack.url}/v1/chat/completions",
            timeout=60,
            json={"model": "default", "messages": [{"role": "user", "content": too_long.strip()}], "stream": True},
        )
        assert expected.status_code == 400, expected.text
        message = expected.json()["error"]["message"]
        await expect(chat.page.locator("#error")).to_have_text(message, timeout=UI_TIMEOUT_MS)
        await expect(chat.view(sid).locator(".message.assistant .error")).to_have_text(message)

        await chat.type("Short one.")
        sent = await chat.send()
        assert sent["body"]["messages"] == [{"role": "user", "content": "Short one."}]
        await chat.answer(sid, 1, sent)
        await expect(chat.page.locator("#error")).to_be_hidden()
