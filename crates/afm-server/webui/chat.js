// Talking to the server: builds a streamed /v1/chat/completions request from a conversation
// and the settings, reads the SSE stream into plain events, cancels, and turns failures into
// sentences a user can act on.

import { authHeaders } from "./store.js";

// Settings fields are strings from the form; empty ones are left to the server's defaults.
function numberOrUndefined(text) {
  const t = String(text ?? "").trim();
  return t === "" ? undefined : Number(t);
}

// Messages sent as history. Answers with no text (failed, or stopped before the first token)
// are left out with the question that led to them, so the roles keep alternating and one
// refused request does not poison the rest of the conversation.
export function historyFor(messages, system) {
  const out = system.trim() ? [{ role: "system", content: system }] : [];
  for (let i = 0; i < messages.length; i++) {
    const m = messages[i];
    const next = messages[i + 1];
    if (m.role === "user" && next?.role === "assistant" && !next.content) continue;
    if (m.role === "assistant" && !m.content) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}

export function requestBody(model, messages, settings) {
  const body = {
    model,
    messages: historyFor(messages, settings.system || ""),
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const key of ["temperature", "top_p", "max_tokens"]) {
    const value = numberOrUndefined(settings[key]);
    if (value !== undefined) body[key] = value;
  }
  return body;
}

export class ServerError extends Error {}

// One sentence per failure kind; the server's own message (which names the field and the
// limit) is kept verbatim.
export function plainWords(status, message) {
  const detail = message ? `: ${message}` : ".";
  if (status === 401) return `The server needs an API key: enter it under Settings${detail}`;
  if (status === 400 || status === 422) return `The server refused the request${detail}`;
  if (status === 404) return `The server could not find what was asked for${detail}`;
  if (status === 413) return `The conversation is too large for the server${detail}`;
  if (status === 429 || status === 503) return `The server is busy; try again in a moment${detail}`;
  if (status >= 500) return `The server failed while answering${detail}`;
  return `The server answered with HTTP ${status}${detail}`;
}

async function errorOf(response) {
  const text = await response.text().catch(() => "");
  let message = text.trim().slice(0, 500);
  try {
    message = JSON.parse(text).error?.message ?? message;
  } catch {
    // not JSON: keep the text as it came
  }
  const err = new ServerError(plainWords(response.status, message));
  err.status = response.status;
  return err;
}

// Yields the `data:` payloads of an SSE body, one string per event.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

// Streams one answer. Yields { id } once, then { reasoning?, content? } deltas, then
// { finish } and { usage }. Throws ServerError for an error response or an error event.
export async function* streamChat(body, signal) {
  let response;
  try {
    response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json", ...authHeaders() },
      body: JSON.stringify(body),
      signal,
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ServerError(`Could not reach the server (${e.message}). Is afm still running?`);
  }
  if (!response.ok) throw await errorOf(response);
  let announced = false;
  for await (const data of sseData(response.body)) {
    if (data === "[DONE]") return;
    let chunk;
    try {
      chunk = JSON.parse(data);
    } catch {
      throw new ServerError(`The server sent something that is not JSON: ${data.slice(0, 200)}`);
    }
    if (chunk.error) throw new ServerError(plainWords(500, chunk.error.message));
    if (!announced && chunk.id) {
      announced = true;
      yield { id: chunk.id };
    }
    for (const choice of chunk.choices ?? []) {
      const d = choice.delta ?? {};
      if (d.reasoning_content || d.content) yield { reasoning: d.reasoning_content, content: d.content };
      if (choice.finish_reason) yield { finish: choice.finish_reason };
    }
    if (chunk.usage) yield { usage: chunk.usage };
  }
}

// Asks the server to stop request `id`; the stream then ends with finish_reason "cancelled".
export async function cancelOnServer(id) {
  const response = await fetch(`/v1/chat/completions/${encodeURIComponent(id)}/cancel`, {
    method: "POST",
    headers: authHeaders(),
  });
  return response.ok;
}

export async function fetchModelName() {
  const response = await fetch("/v1/models", { headers: authHeaders() });
  if (!response.ok) throw await errorOf(response);
  const list = await response.json();
  return list.data?.[0]?.id ?? "unknown model";
}
