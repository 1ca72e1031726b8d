"use strict";
// Tandem's chat page. Each conversation is a session (X-Session-Id), so the server keeps its KV
// cache between turns; while the user types, the page sends typing hints so the server can move
// that cache to the worker that will serve the next turn before the message lands.
// Plain DOM, no build step, nothing fetched from outside the gateway.

const HINT_INTERVAL_MS = 2000; // one hint per typing burst; the gateway debounces too

const $ = (id) => document.getElementById(id);
const els = {
  list: $("conversations"), messages: $("messages"), input: $("input"), send: $("send"),
  composer: $("composer"), model: $("model"), maxTokens: $("max-tokens"), temperature: $("temperature"),
  sessionId: $("session-id"), hintStatus: $("hint-status"), error: $("error"),
};
const conversations = [];
let current = null;

function newSessionId() {
  if (crypto.randomUUID) return crypto.randomUUID();
  // A plain-http page on a LAN address is not a secure context, so it has no randomUUID.
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = [...b].map((x) => x.toString(16).padStart(2, "0")).join("");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function showError(message, source = "") {
  els.error.textContent = message;
  els.error.hidden = !message;
  els.error.dataset.source = source;
}

function errorMessage(body, status) {
  const detail = body?.detail;
  return body?.error?.message || (typeof detail === "string" ? detail : `HTTP ${status}`);
}

function sessionPath(sessionId, tail) {
  return `/v1/sessions/${encodeURIComponent(sessionId)}/${tail}`;
}

// -- typing hints ------------------------------------------------------------------------------

/** A session's typing hints: over a WebSocket when one connects, else by POST. */
class HintChannel {
  constructor(sessionId) {
    this.sessionId = sessionId;
    this.lastSent = 0;
    this.socket = null;
    this.useHttp = false;
  }

  keystroke() {
    const now = Date.now();
    if (now - this.lastSent < HINT_INTERVAL_MS) return;
    this.lastSent = now;
    if (this.useHttp) this.post();
    else if (this.socket?.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify({ type: "keystroke" }));
    else if (!this.socket) this.connect(); // sends this burst's hint once open
  }

  /** The next keystroke starts a new burst (a message was just sent). */
  reset() {
    this.lastSent = 0;
  }

  connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}${sessionPath(this.sessionId, "events")}`);
    let opened = false;
    socket.onopen = () => {
      opened = true;
      socket.send(JSON.stringify({ type: "keystroke" }));
    };
    socket.onmessage = (e) => this.onReply(JSON.parse(e.data), "websocket");
    socket.onclose = () => {
      if (this.socket !== socket) return; // closed on purpose
      this.socket = null;
      if (!opened) { // no WebSocket endpoint, or a proxy that drops upgrades: POST from now on
        this.useHttp = true;
        this.post();
      }
    };
    this.socket = socket;
  }

  async post() {
    try {
      const r = await fetch(sessionPath(this.sessionId, "typing"), {
        method: "POST", headers: { "Content-Type": "application/json" }, body: "{}",
      });
      const body = await r.json().catch(() => null);
      if (!r.ok) throw new Error(errorMessage(body, r.status));
      this.onReply({ type: "hint", status: body.hint }, "http");
    } catch (err) {
      this.onReply({ type: "error", message: err.message }, "http");
    }
  }

  onReply(msg, via) {
    if (current?.sessionId !== this.sessionId) return;
    const ok = msg.type === "hint";
    els.hintStatus.textContent = ok ? `typing hint ${msg.status} (${via})` : `typing hint failed: ${msg.message}`;
    els.hintStatus.dataset.status = ok ? msg.status : "error";
    els.hintStatus.dataset.via = via;
  }

  close() {
    const socket = this.socket;
    this.socket = null;
    socket?.close();
  }
}

// -- conversations -----------------------------------------------------------------------------

function newConversation() {
  const sessionId = newSessionId();
  const conv = { sessionId, messages: [], busy: false, hints: new HintChannel(sessionId) };
  conv.view = el("div", "conversation");
  conv.item = el("li", "", "New conversation");
  conv.view.dataset.sessionId = conv.item.dataset.sessionId = sessionId;
  conv.item.addEventListener("click", () => select(conv));
  els.messages.append(conv.view);
  els.list.prepend(conv.item);
  conversations.push(conv);
  select(conv);
}

function select(conv) {
  if (current && current !== conv) current.hints.close();
  current = conv;
  for (const c of conversations) {
    c.view.hidden = c !== conv;
    c.item.classList.toggle("active", c === conv);
  }
  els.sessionId.textContent = conv.sessionId;
  els.hintStatus.textContent = "";
  delete els.hintStatus.dataset.status;
  delete els.hintStatus.dataset.via;
  els.send.disabled = conv.busy;
  els.input.focus();
}

function setBusy(conv, busy) {
  conv.busy = busy;
  conv.view.dataset.busy = busy;
  if (conv === current) els.send.disabled = busy;
}

function addMessage(conv, role, text) {
  const m = el("div", `message ${role}`);
  m.dataset.role = role;
  m.setAttribute("data-testid", "message");
  m.append(el("div", "content", text));
  conv.view.append(m);
  scrollDown(conv);
  return m;
}

function scrollDown(conv) {
  if (conv === current) els.messages.scrollTop = els.messages.scrollHeight;
}

function showUsage(bubble, usage) {
  const cached = usage.prompt_tokens_details?.cached_tokens;
  const line = el("div", "usage",
    `prompt ${usage.prompt_tokens} tokens (${cached ?? "?"} cached) · completion ${usage.completion_tokens}`);
  line.setAttribute("data-testid", "usage");
  line.dataset.promptTokens = usage.prompt_tokens;
  line.dataset.cachedTokens = cached ?? "";
  line.dataset.completionTokens = usage.completion_tokens;
  bubble.append(line);
}

// -- sending and streaming ---------------------------------------------------------------------

async function send() {
  const conv = current;
  const text = els.input.value.trim();
  if (!text || conv.busy) return;
  if (!els.model.value) return showError("no model is being served yet");
  els.input.value = "";
  showError("");
  conv.hints.reset();
  if (!conv.messages.length) conv.item.textContent = text.slice(0, 40);
  conv.messages.push({ role: "user", content: text });
  const question = addMessage(conv, "user", text);
  const bubble = addMessage(conv, "assistant", "");
  setBusy(conv, true);
  try {
    conv.messages.push({ role: "assistant", content: await streamAnswer(conv, bubble) });
  } catch (err) {
    conv.messages.pop(); // a failed turn is not part of the history sent next time
    question.classList.add("failed");
    bubble.append(el("div", "error", err.message));
    showError(err.message);
  } finally {
    setBusy(conv, false);
  }
}

function requestBody(conv) {
  const body = {
    model: els.model.value, messages: conv.messages, stream: true, stream_options: { include_usage: true },
  };
  const maxTokens = parseInt(els.maxTokens.value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  if (els.temperature.value !== "") body.temperature = Number(els.temperature.value);
  return body;
}

/** Streams one answer into `bubble`, token by token; returns its text. */
async function streamAnswer(conv, bubble) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-Session-Id": conv.sessionId },
    body: JSON.stringify(requestBody(conv)),
  });
  if (!response.ok) throw new Error(errorMessage(await response.json().catch(() => null), response.status));
  const content = bubble.querySelector(".content");
  let answer = "";
  for await (const chunk of sseEvents(response.body)) {
    if (chunk.error) throw new Error(chunk.error.message); // failed after the stream began
    const delta = chunk.choices?.[0]?.delta?.content;
    if (delta) {
      answer += delta;
      content.textContent = answer;
      scrollDown(conv);
    }
    if (chunk.usage) showUsage(bubble, chunk.usage);
  }
  return answer;
}

/** The JSON payloads of a server-sent event stream, up to `data: [DONE]`. */
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// -- models ------------------------------------------------------------------------------------

async function loadModels() {
  try {
    const r = await fetch("/v1/models");
    const body = await r.json().catch(() => null);
    if (!r.ok) throw new Error(errorMessage(body, r.status));
    const ids = body.data.map((m) => m.id);
    if (!ids.length) throw new Error("no model is being served yet");
    const chosen = els.model.value;
    els.model.replaceChildren(...ids.map((id) => el("option", "", id)));
    if (ids.includes(chosen)) els.model.value = chosen;
    if (els.error.dataset.source === "models") showError("");
  } catch (err) {
    showError(`models: ${err.message} (retrying)`, "models");
    setTimeout(loadModels, 3000);
  }
}

els.input.addEventListener("input", () => {
  if (els.input.value) current.hints.keystroke();
});
els.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
els.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
$("new-conversation").addEventListener("click", newConversation);
newConversation();
loadModels();
