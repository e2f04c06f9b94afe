// afm's built-in chat page in headless Debian Chromium against a live afm server on SmolLM2:
// a streamed answer, Stop cancelling on the server, history across a reload, a server error in
// plain words, the reasoning block and Markdown, and the /metrics panel. Screenshots go to
// tests/webui/artifacts/, with the server's log.
//
//   node chat.test.js        (env: AFM_BIN, AFM_MODEL, CHROMIUM override the defaults)

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { chromium } from "playwright-core";

const HERE = import.meta.dirname;
const ROOT = path.resolve(HERE, "../..");
const AFM = process.env.AFM_BIN ?? path.join(ROOT, "target/release/afm");
const MODEL = process.env.AFM_MODEL ?? path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
const CHROMIUM = process.env.CHROMIUM ?? "/usr/bin/chromium";
const ARTIFACTS = path.join(HERE, "artifacts");
const CHROMIUM_FLAGS = [
  "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync",
];
// Generous: the tiny model is fast, but the test machine is shared with compilers.
const ANSWER_TIMEOUT = 180_000;

// ---- the server

function freePort() {
  return new Promise((resolve, reject) => {
    const probe = net.createServer().listen(0, "127.0.0.1", () => {
      const { port } = probe.address();
      probe.close(() => resolve(port));
    });
    probe.on("error", reject);
  });
}

async function startServer(extraArgs = [], logName = "server.log") {
  const port = await freePort();
  const log = fs.createWriteStream(path.join(ARTIFACTS, logName));
  const args = ["serve", "-m", MODEL, "-p", String(port), "-v", ...extraArgs];
  const child = spawn(AFM, args, { stdio: ["ignore", "pipe", "pipe"] });
  const server = { base: `http://127.0.0.1:${port}`, child, output: "", exited: null };
  for (const stream of [child.stdout, child.stderr]) {
    stream.on("data", (d) => {
      server.output += d;
      log.write(d);
    });
  }
  child.on("exit", (code, signal) => (server.exited = signal ?? code));
  const deadline = Date.now() + 180_000;
  while (Date.now() < deadline) {
    if (server.exited !== null) throw new Error(`afm exited (${server.exited}) before serving:\n${server.output}`);
    try {
      if ((await fetch(`${server.base}/health`)).ok) return server;
    } catch {
      // not listening yet
    }
    await sleep(250);
  }
  child.kill("SIGKILL");
  throw new Error(`afm did not answer /health within 180 s:\n${server.output}`);
}

async function stopServer(server) {
  if (server.exited !== null) return;
  server.child.kill("SIGINT"); // afm shuts down gracefully on Ctrl-C
  for (let i = 0; i < 30 && server.exited === null; i++) await sleep(100);
  if (server.exited === null) server.child.kill("SIGKILL");
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- page helpers

async function setSetting(page, name, value) {
  if (await page.locator("#settings").isHidden()) await page.click("#settings-toggle");
  await page.fill(`#settings [name="${name}"]`, String(value));
}

async function closeSettings(page) {
  if (await page.locator("#settings").isVisible()) await page.click("#settings-toggle");
}

async function send(page, text) {
  await page.fill("#input", text);
  await page.press("#input", "Enter");
}

// Waits until the newest answer is in one of `states` (streaming, done, stopped, error).
async function waitForAnswer(page, states, timeout = ANSWER_TIMEOUT) {
  await page.waitForFunction(
    (wanted) => {
      const answer = [...document.querySelectorAll("article.assistant")].pop();
      return answer && wanted.includes(answer.dataset.state);
    },
    states,
    { timeout },
  );
  return page.locator("article.assistant").last();
}

// Waits (past one 2 s poll) until the server panel shows `value` for `metric`.
async function waitForPanel(page, metric, value) {
  await page.waitForFunction(
    ([name, wanted]) => document.querySelector(`#server-panel [data-metric="${name}"] dd`)?.textContent === wanted,
    [metric, value],
    { timeout: 6000 },
  ).catch(async () => {
    const shown = await page.locator("#server-panel").textContent();
    throw new Error(`the server panel never showed ${metric} = ${value}: ${shown}`);
  });
}

async function transcript(page) {
  return page.$$eval("article.message", (nodes) =>
    nodes.map((n) => `${n.classList.contains("user") ? "user" : "assistant"}: ${n.querySelector(".content").textContent}`));
}

async function metrics(base) {
  const resp = await fetch(`${base}/metrics`).catch(() => null);
  if (!resp?.ok) return null;
  const values = new Map();
  for (const line of (await resp.text()).split("\n")) {
    const m = line.match(/^([\w:]+)(\{[^}]*\})?\s+(\S+)/);
    if (m) values.set(m[1], (values.get(m[1]) ?? 0) + Number(m[3]));
  }
  return values;
}

// ---- the tests, in order: later ones use the conversation the earlier ones built

const tests = [];
const test = (name, fn) => tests.push({ name, fn });

test("page loads from the server alone and shows the model name", async ({ page, server, requests }) => {
  const models = await (await fetch(`${server.base}/v1/models`)).json();
  await page.goto(server.base + "/");
  await page.waitForFunction((id) => document.querySelector("#model-name").textContent === id, models.data[0].id);
  const foreign = requests.filter((url) => !url.startsWith(server.base + "/") && !url.startsWith("data:"));
  assert.deepEqual(foreign, [], "the page fetched something from outside the server");
});

test("a message gets a streamed answer with tokens/s and TTFT", async ({ page }) => {
  await setSetting(page, "max_tokens", 80);
  await closeSettings(page);
  // Record the answer's length at every DOM change: a streamed answer grows in steps.
  await page.evaluate(() => {
    window.lengthsSeen = [];
    new MutationObserver(() => {
      const answer = [...document.querySelectorAll("article.assistant")].pop();
      if (answer?.dataset.state === "streaming") window.lengthsSeen.push(answer.querySelector(".content").textContent.length);
    }).observe(document.querySelector("#messages"), { childList: true, subtree: true, characterData: true });
  });
  await send(page, "Write a short poem about the sea.");
  await waitForAnswer(page, ["streaming"], 10_000);
  const answer = await waitForAnswer(page, ["done"]);
  const text = await answer.locator(".content").textContent();
  assert.ok(text.trim().length > 10, `answer too short: ${JSON.stringify(text)}`);
  const lengths = new Set((await page.evaluate(() => window.lengthsSeen)).filter((n) => n > 0));
  assert.ok(lengths.size >= 2, `the answer appeared in ${lengths.size} step(s), not streamed`);
  const meta = await answer.locator(".meta").textContent();
  assert.match(meta, /^\d+ tokens · [\d.]+ tok\/s · TTFT [\d.]+ s/, meta);
  await page.screenshot({ path: path.join(ARTIFACTS, "1-streamed-answer.png") });
});

test("Stop cancels the request on the server and the next request works", async ({ page, server }) => {
  await setSetting(page, "max_tokens", 4000);
  await setSetting(page, "temperature", 0); // greedy SmolLM2 runs on far past the Stop
  await page.screenshot({ path: path.join(ARTIFACTS, "2a-settings.png") });
  await closeSettings(page);
  await send(page, "Write a very long story about a dragon.");
  await page.waitForFunction(() => {
    const answer = [...document.querySelectorAll("article.assistant")].pop();
    return answer.dataset.state === "streaming" && answer.querySelector(".content").textContent.length > 150;
  }, null, { timeout: ANSWER_TIMEOUT });
  const live = (await metrics(server.base))?.has("afm:num_requests_running");
  if (live) await waitForPanel(page, "afm:num_requests_running", "1"); // the panel sees the request
  await page.screenshot({ path: path.join(ARTIFACTS, "2b-streaming.png") });
  const cancelled = page.waitForResponse((r) => /\/v1\/chat\/completions\/[^/]+\/cancel$/.test(r.url()));
  await page.click("#stop");
  const cancel = await cancelled;
  assert.equal(cancel.status(), 200, "POST …/cancel failed");
  assert.equal((await cancel.json()).cancelled, true);
  const answer = await waitForAnswer(page, ["stopped"], 10_000);

  // The answer stops growing, and the usage chunk the server sent at the end counts far fewer
  // tokens than max_tokens: the server ended the generation, not just the page.
  const before = await answer.locator(".content").textContent();
  await sleep(1500);
  assert.equal(await answer.locator(".content").textContent(), before, "text kept arriving after Stop");
  const meta = await answer.locator(".meta").textContent();
  assert.match(meta, /stopped/, meta);
  const tokens = Number(meta.match(/^(\d+) tokens/)?.[1]);
  assert.ok(tokens > 0 && tokens < 4000, `usage after Stop: ${meta}`);
  const id = cancel.url().match(/completions\/([^/]+)\/cancel$/)[1];
  assert.match(server.output, new RegExp(`POST /v1/chat/completions/${id}/cancel 200`), "server log has no cancel");
  if (live) await waitForPanel(page, "afm:num_requests_running", "0"); // the server let it go
  await page.screenshot({ path: path.join(ARTIFACTS, "2c-stopped.png") });

  await setSetting(page, "max_tokens", 40);
  await closeSettings(page);
  await send(page, "Say hello.");
  const next = await waitForAnswer(page, ["done"]);
  assert.ok((await next.locator(".content").textContent()).trim().length > 0, "empty answer after Stop");
});

test("conversations survive a reload; new and delete work", async ({ page }) => {
  const before = await transcript(page);
  assert.equal(before.length, 6);
  await page.reload();
  await page.waitForSelector("article.message");
  assert.deepEqual(await transcript(page), before);
  const titles = await page.locator("#conversations li .open").allTextContents();
  assert.deepEqual(titles, ["Write a short poem about the sea."]);
  assert.equal(await page.inputValue('#settings [name="max_tokens"]'), "40", "settings were not kept");
  await page.screenshot({ path: path.join(ARTIFACTS, "3-after-reload.png") });

  await page.click("#new-chat");
  assert.equal(await page.locator("#conversations li").count(), 2);
  assert.equal(await page.locator("article.message").count(), 0);
  await page.click("#conversations li.current .delete");
  assert.equal(await page.locator("#conversations li").count(), 1);
  assert.deepEqual(await transcript(page), before, "deleting the new chat changed the old one");
});

test("a server error is shown in plain words", async ({ page, server }) => {
  await page.click("#new-chat");
  await setSetting(page, "max_tokens", 0);
  await closeSettings(page);
  // The server's own words for this mistake, asked directly.
  const direct = await fetch(`${server.base}/v1/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ messages: [{ role: "user", content: "hi" }], max_tokens: 0 }),
  });
  assert.equal(direct.status, 400);
  const { error } = await direct.json();
  await send(page, "hi");
  const answer = await waitForAnswer(page, ["error"], 20_000);
  const shown = await answer.locator(".error").textContent();
  assert.equal(shown, `The server refused the request: ${error.message}`);
  assert.ok(await answer.locator(".error").isVisible());
  await page.screenshot({ path: path.join(ARTIFACTS, "4-error.png") });

  // The failed turn is not resent: the next question gets an answer.
  await setSetting(page, "max_tokens", 30);
  await closeSettings(page);
  await send(page, "Hello!");
  await waitForAnswer(page, ["done"]);
});

// SmolLM2 does not reason, so this one answer is a recorded-style stream from the route.
test("reasoning is a collapsible block; Markdown and code render, HTML stays text", async ({ page }) => {
  const chunk = (delta, extra = {}) =>
    `data: ${JSON.stringify({ id: "chatcmpl-stub", object: "chat.completion.chunk", choices: [{ index: 0, delta, finish_reason: null }], ...extra })}\n\n`;
  const answer = "## Plan\n\nUse **Rust**:\n\n```rust\nfn main() {\n    println!(\"<b>hi</b>\");\n}\n```\n\n- one\n- two <img src=x onerror=\"window.pwned=1\">";
  const body = [
    chunk({ role: "assistant", content: "" }),
    chunk({ reasoning_content: "The user wants code. " }),
    chunk({ reasoning_content: "Keep it short." }),
    ...answer.match(/[\s\S]{1,12}/g).map((piece) => chunk({ content: piece })),
    `data: ${JSON.stringify({ id: "chatcmpl-stub", choices: [], usage: { completion_tokens: 42, completion_tokens_per_second: 99.5, prompt_tokens_details: { cached_tokens: 0 } } })}\n\n`,
    "data: [DONE]\n\n",
  ].join("");
  await page.route("**/v1/chat/completions", (route) =>
    route.fulfill({ status: 200, contentType: "text/event-stream", body }), { times: 1 });
  await page.click("#new-chat");
  await send(page, "Show me Rust.");
  const done = await waitForAnswer(page, ["done"], 20_000);
  const reasoning = done.locator("details.reasoning");
  assert.ok(await reasoning.isVisible());
  assert.equal(await reasoning.evaluate((d) => d.open), false, "reasoning should fold once the answer starts");
  await reasoning.locator("summary").click();
  assert.equal(await done.locator(".reasoning-body").textContent(), "The user wants code. Keep it short.");
  assert.equal(await done.locator("h2").textContent(), "Plan");
  assert.equal(await done.locator("strong").textContent(), "Rust");
  assert.equal(await done.locator("pre code.language-rust").textContent(), 'fn main() {\n    println!("<b>hi</b>");\n}');
  assert.equal(await done.locator(".content img, .content b").count(), 0, "model HTML became markup");
  assert.match(await done.locator(".content li").last().textContent(), /<img src=x/);
  assert.equal(await page.evaluate(() => window.pwned), undefined);
  assert.match(await done.locator(".meta").textContent(), /^42 tokens · 99\.5 tok\/s · TTFT/);
  await page.screenshot({ path: path.join(ARTIFACTS, "5-reasoning-markdown.png") });
});

test("the server panel shows /metrics, or says it is unavailable", async ({ page, server }) => {
  const m = await metrics(server.base);
  if (m) {
    await page.waitForFunction(() => document.querySelector(".metrics-status").textContent === "live", null, { timeout: 5000 });
    const labels = await page.locator("#server-panel dt").allTextContents();
    assert.deepEqual(labels, ["Running", "Waiting", "Prefix-cache hits"]);
    const running = await page.locator('#server-panel [data-metric="afm:num_requests_running"] dd').textContent();
    assert.match(running, /^\d+$/);
    // A server without /metrics (older afm, or a proxy in front) gets a plain note instead.
    await page.route("**/metrics", (route) => route.fulfill({ status: 404, body: "{}" }));
    await page.waitForFunction(() => document.querySelector(".metrics-status").textContent === "metrics unavailable",
      null, { timeout: 5000 });
    await page.screenshot({ path: path.join(ARTIFACTS, "6b-metrics-unavailable.png") });
    await page.unroute("**/metrics");
    await page.waitForFunction(() => document.querySelector(".metrics-status").textContent === "live", null, { timeout: 5000 });
  } else {
    await page.waitForFunction(() => document.querySelector(".metrics-status").textContent === "metrics unavailable",
      null, { timeout: 5000 });
  }
  await page.locator("#conversations li .open").last().click();
  await page.screenshot({ path: path.join(ARTIFACTS, "6-panel.png") });
});

test("a reload mid-answer keeps the partial answer as stopped; the server drops the request", async ({ page, server }) => {
  await page.click("#new-chat");
  await setSetting(page, "max_tokens", 4000);
  await closeSettings(page);
  await send(page, "Write a very long story about a dragon.");
  await page.waitForFunction(() => {
    const answer = [...document.querySelectorAll("article.assistant")].pop();
    return answer.dataset.state === "streaming" && answer.querySelector(".content").textContent.length > 100;
  }, null, { timeout: ANSWER_TIMEOUT });
  await sleep(2500); // past one periodic save
  await page.reload();
  const answer = await waitForAnswer(page, ["stopped"], 10_000);
  assert.ok((await answer.locator(".content").textContent()).length > 100, "the partial answer was lost");
  // Closing the connection is a cancel too: the engine stops computing it.
  if ((await metrics(server.base))?.has("afm:num_requests_running")) {
    await waitForPanel(page, "afm:num_requests_running", "0");
  }
  await page.screenshot({ path: path.join(ARTIFACTS, "7-reloaded-mid-answer.png") });
});

test("with --api-key the page asks for the key, then works once it is entered in Settings", async ({ page }) => {
  const key = "webui-test-key";
  const guarded = await startServer(["--api-key", key], "server-api-key.log");
  try {
    assert.equal((await fetch(`${guarded.base}/v1/models`)).status, 401);
    await page.goto(guarded.base + "/"); // another origin: its own, empty localStorage
    await page.waitForFunction(() => document.querySelector("#model-name").textContent === "API key needed (Settings)");
    await setSetting(page, "max_tokens", 20);
    await setSetting(page, "api_key", key);
    const stored = await page.evaluate(() => JSON.parse(localStorage.getItem("afm.settings")).api_key);
    assert.equal(stored, key, "the key is not kept in localStorage");
    await closeSettings(page);
    await page.waitForFunction(() => !document.querySelector("#model-name").classList.contains("offline"));
    await send(page, "Say hello.");
    const answer = await waitForAnswer(page, ["done", "error"]);
    assert.equal(await answer.getAttribute("data-state"), "done", await answer.textContent());
    await waitForPanel(page, "afm:num_requests_running", "0");
    await page.screenshot({ path: path.join(ARTIFACTS, "9-api-key.png") });
  } finally {
    await stopServer(guarded);
  }
});

// ---- runner

async function runTests(context, server) {
  const page = context.pages()[0] ?? (await context.newPage());
  const requests = [];
  const pageErrors = [];
  page.on("request", (r) => requests.push(r.url()));
  page.on("pageerror", (e) => pageErrors.push(e.message));
  let failed = 0;
  for (const [i, { name, fn }] of tests.entries()) {
    const started = Date.now();
    try {
      await fn({ page, server, requests });
      console.log(`ok   ${name} (${((Date.now() - started) / 1000).toFixed(1)} s)`);
    } catch (e) {
      failed++;
      console.log(`FAIL ${name}\n     ${String(e.stack ?? e).replace(/\n/g, "\n     ")}`);
      await page.screenshot({ path: path.join(ARTIFACTS, `failed-${i + 1}.png`) }).catch(() => {});
    }
  }
  if (pageErrors.length) {
    failed++;
    console.log(`FAIL the page threw: ${pageErrors.join(" | ")}`);
  }
  return failed;
}

async function main() {
  fs.rmSync(ARTIFACTS, { recursive: true, force: true }); // no stale screenshots from an earlier run
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  assert.ok(fs.existsSync(AFM), `no afm binary at ${AFM} (cargo build --release -p afm)`);
  assert.ok(fs.existsSync(MODEL), `no model at ${MODEL} (bash scripts/fetch_models.sh smollm2)`);
  const server = await startServer();
  const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), "afm-webui-"));
  let context = null;
  let failed;
  try {
    context = await chromium.launchPersistentContext(userDataDir, {
      executablePath: CHROMIUM,
      headless: true,
      args: CHROMIUM_FLAGS,
      viewport: { width: 1280, height: 820 },
    });
    failed = await runTests(context, server);
  } finally {
    // Whatever happened, leave no server or browser behind.
    await context?.close().catch(() => {});
    await stopServer(server);
    fs.rmSync(userDataDir, { recursive: true, force: true });
  }
  console.log(`screenshots in ${ARTIFACTS}`);
  // The plain closing line CI reads: 'N passed, N failed'.
  console.log(`webui: ${tests.length - Math.min(failed, tests.length)} passed, ${Math.min(failed, tests.length)} failed`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
