// The chat page: conversation list, messages, composer, settings and the Stop button. State
// lives in `state` and in localStorage (store.js); the DOM is redrawn from it. Only the answer
// being streamed is updated in place, at most once per animation frame.

import { renderMarkdown } from "./markdown.js";
import * as store from "./store.js";
import { cancelOnServer, fetchModelName, requestBody, ServerError, streamChat } from "./chat.js";
import { startMetricsPanel } from "./metrics.js";

const $ = (id) => document.getElementById(id);
const ui = {
  conversations: $("conversations"),
  newChat: $("new-chat"),
  modelName: $("model-name"),
  settingsToggle: $("settings-toggle"),
  settings: $("settings"),
  messages: $("messages"),
  emptyHint: $("empty-hint"),
  notice: $("notice"),
  composer: $("composer"),
  input: $("input"),
  send: $("send"),
  stop: $("stop"),
};

const state = {
  conversations: store.loadConversations(),
  currentId: store.loadCurrentId(),
  settings: store.loadSettings(),
  model: undefined,
  // The answer being streamed: { conv, message, controller, id, started, firstAt, view }.
  active: null,
};

// ---- small DOM helpers

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function showNotice(text) {
  ui.notice.hidden = !text;
  ui.notice.textContent = text || "";
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId) ?? null;
}

function persist() {
  showNotice(store.saveConversations(state.conversations) || store.saveCurrentId(state.currentId));
}

// While streaming, save at most every 2 s so a reload keeps most of a long answer.
let lastSave = 0;
function persistSoon() {
  if (performance.now() - lastSave > 2000) {
    lastSave = performance.now();
    persist();
  }
}

// ---- conversation list

function renderConversationList() {
  const items = [...state.conversations].sort((a, b) => b.updated - a.updated).map((conv) => {
    const li = el("li");
    li.classList.toggle("current", conv.id === state.currentId);
    li.classList.toggle("streaming", state.active?.conv === conv);
    const open = el("button", "open", conv.title);
    open.type = "button";
    open.title = conv.title;
    open.addEventListener("click", () => selectConversation(conv.id));
    const del = el("button", "delete", "×");
    del.type = "button";
    del.title = "Delete conversation";
    del.setAttribute("aria-label", `Delete conversation “${conv.title}”`);
    del.addEventListener("click", () => deleteConversation(conv.id));
    li.append(open, del);
    return li;
  });
  ui.conversations.replaceChildren(...items);
}

function selectConversation(id) {
  state.currentId = id;
  persist();
  renderAll();
}

function deleteConversation(id) {
  if (state.active?.conv.id === id) stop();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = state.conversations[0]?.id ?? null;
  persist();
  renderAll();
}

// ---- messages

function messageState(m) {
  if (m.error) return "error";
  if (state.active?.message === m) return "streaming";
  return m.stopped ? "stopped" : "done";
}

function statsText(m) {
  const parts = [];
  const s = m.stats;
  if (s?.tokens !== undefined) parts.push(`${s.tokens} tokens`);
  if (s?.tps) parts.push(`${s.tps.toFixed(1)} tok/s`);
  if (s?.ttft !== undefined) parts.push(`TTFT ${s.ttft.toFixed(2)} s`);
  if (s?.cached) parts.push(`${s.cached} prompt tokens cached`);
  if (m.stopped) parts.push("stopped");
  else if (m.finish === "length") parts.push("cut at max tokens");
  return parts.join(" · ");
}

function messageView(m) {
  const root = el("article", `message ${m.role}`);
  if (m.role === "user") {
    root.append(el("div", "content plain", m.content));
    return { root };
  }
  const reasoning = el("details", "reasoning");
  const summary = el("summary", "", "Reasoning");
  const reasoningBody = el("div", "reasoning-body markdown");
  reasoning.append(summary, reasoningBody);
  const view = {
    root,
    reasoning,
    reasoningBody,
    content: el("div", "content markdown"),
    error: el("p", "error"),
    meta: el("div", "meta"),
    collapsed: false,
  };
  root.append(reasoning, view.content, view.error, view.meta);
  updateView(view, m);
  return view;
}

function updateView(view, m) {
  if (!view.meta) return;
  const phase = messageState(m);
  view.root.dataset.state = phase;
  view.reasoning.hidden = !m.reasoning;
  if (m.reasoning) {
    view.reasoningBody.innerHTML = renderMarkdown(m.reasoning);
    // Open while the model thinks; fold once the answer starts (the user may reopen it).
    if (phase === "streaming" && !m.content && !view.collapsed) view.reasoning.open = true;
    if (m.content && !view.collapsed) {
      view.reasoning.open = false;
      view.collapsed = true;
    }
  }
  view.content.innerHTML = renderMarkdown(m.content);
  view.content.hidden = !m.content && phase !== "streaming";
  view.error.hidden = !m.error;
  view.error.textContent = m.error ?? "";
  view.meta.textContent = phase === "streaming" && !m.content && !m.reasoning ? "waiting for the first token…" : statsText(m);
}

function renderMessages() {
  const conv = current();
  const messages = conv?.messages ?? [];
  const views = messages.map((m) => {
    const view = messageView(m);
    if (state.active?.message === m) state.active.view = view;
    return view.root;
  });
  ui.messages.replaceChildren(...(views.length ? views : [ui.emptyHint]));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function renderAll() {
  renderConversationList();
  renderMessages();
}

// Redraws the streamed answer on the next frame; many deltas per frame cost one render.
let frameQueued = false;
function scheduleRender() {
  if (frameQueued) return;
  frameQueued = true;
  requestAnimationFrame(() => {
    frameQueued = false;
    const active = state.active;
    if (!active?.view || !active.view.root.isConnected) return;
    const box = ui.messages;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    updateView(active.view, active.message);
    if (atBottom) box.scrollTop = box.scrollHeight;
  });
}

// ---- sending and stopping

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.stop.disabled = false;
}

async function send(text) {
  if (state.active || !text.trim()) return;
  let conv = current();
  if (!conv) {
    conv = store.newConversation();
    state.conversations.unshift(conv);
    state.currentId = conv.id;
  }
  if (!conv.messages.some((m) => m.role === "user")) conv.title = store.titleFrom(text);
  conv.messages.push({ role: "user", content: text });
  // `pending` is saved with the partial answer: a reload mid-stream shows it as stopped.
  const message = { role: "assistant", content: "", reasoning: "", pending: true };
  const body = requestBody(state.model, conv.messages, state.settings);
  conv.messages.push(message);
  conv.updated = Date.now();

  const active = { conv, message, controller: new AbortController(), id: null, started: performance.now(), firstAt: null };
  state.active = active;
  setBusy(true);
  persist();
  renderAll();
  try {
    for await (const event of streamChat(body, active.controller.signal)) {
      if (event.id) active.id = event.id;
      if (event.reasoning || event.content) {
        active.firstAt ??= performance.now();
        message.reasoning += event.reasoning ?? "";
        message.content += event.content ?? "";
        scheduleRender();
        persistSoon();
      }
      if (event.finish) {
        message.finish = event.finish;
        if (event.finish === "cancelled") message.stopped = true;
      }
      if (event.usage) {
        message.stats = {
          tokens: event.usage.completion_tokens,
          tps: event.usage.completion_tokens_per_second,
          cached: event.usage.prompt_tokens_details?.cached_tokens,
        };
      }
    }
  } catch (e) {
    if (e.name === "AbortError") message.stopped = true;
    else message.error = e instanceof ServerError ? e.message : `The page failed while reading the answer: ${e.message}`;
  } finally {
    // TTFT is measured here, in the browser: request sent → first token shown.
    if (active.firstAt !== null) message.stats = { ...message.stats, ttft: (active.firstAt - active.started) / 1000 };
    delete message.pending;
    state.active = null;
    setBusy(false);
    persist();
    renderConversationList();
    if (active.view?.root.isConnected) updateView(active.view, message);
  }
}

// Stop: ask the server to cancel (it then ends the stream, with usage), and abort the fetch
// if the stream has not ended a second later — or at once if the request has no id yet.
async function stop() {
  const active = state.active;
  if (!active || active.stopping) return;
  active.stopping = true;
  active.message.stopped = true;
  ui.stop.disabled = true;
  const abort = () => {
    if (state.active === active) active.controller.abort();
  };
  if (!active.id) return abort();
  try {
    await cancelOnServer(active.id);
  } catch {
    // unreachable server: the abort below still ends the request on our side
  }
  setTimeout(abort, 1000);
}

// ---- settings

function loadSettingsForm() {
  for (const [name, value] of Object.entries(state.settings)) {
    const field = ui.settings.elements.namedItem(name);
    if (field) field.value = value;
  }
}

ui.settings.addEventListener("input", (e) => {
  if (!e.target.name) return;
  state.settings[e.target.name] = e.target.value;
  showNotice(store.saveSettings(state.settings));
  if (e.target.name === "api_key") showModel();
});
ui.settings.addEventListener("submit", (e) => e.preventDefault());

ui.settingsToggle.addEventListener("click", () => {
  ui.settings.hidden = !ui.settings.hidden;
  ui.settingsToggle.setAttribute("aria-expanded", String(!ui.settings.hidden));
});

// ---- composer and buttons

ui.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  if (state.active) return;
  const text = ui.input.value;
  if (!text.trim()) return;
  ui.input.value = "";
  send(text);
});

ui.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    ui.composer.requestSubmit();
  }
});

ui.stop.addEventListener("click", stop);

ui.newChat.addEventListener("click", () => {
  const conv = store.newConversation();
  state.conversations.unshift(conv);
  state.currentId = conv.id;
  persist();
  renderAll();
  ui.input.focus();
});

ui.messages.addEventListener("click", async (e) => {
  const button = e.target.closest(".copy-code");
  if (!button) return;
  const code = button.closest(".code-block").querySelector("code").textContent;
  try {
    await navigator.clipboard.writeText(code);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed"; // clipboard needs https or localhost
  }
  setTimeout(() => (button.textContent = "Copy"), 1500);
});

// Another tab changed the conversations: take its list, unless this tab is streaming (its
// own save at the end wins then).
window.addEventListener("storage", (e) => {
  if (e.key !== "afm.conversations" || state.active) return;
  state.conversations = store.loadConversations();
  if (!current()) state.currentId = state.conversations[0]?.id ?? null;
  renderAll();
});

// ---- start

async function showModel() {
  try {
    state.model = await fetchModelName();
    ui.modelName.textContent = state.model;
    ui.modelName.classList.remove("offline");
  } catch (e) {
    const keyNeeded = e instanceof ServerError && e.status === 401;
    ui.modelName.textContent = keyNeeded ? "API key needed (Settings)" : "server unreachable";
    ui.modelName.classList.add("offline");
    if (!keyNeeded) setTimeout(showModel, 5000);
  }
}

for (const m of state.conversations.flatMap((c) => c.messages)) {
  if (m.pending) {
    delete m.pending;
    m.stopped = true;
  }
}
if (!current()) state.currentId = state.conversations[0]?.id ?? null;
loadSettingsForm();
renderAll();
showModel();
startMetricsPanel($("server-panel"));
