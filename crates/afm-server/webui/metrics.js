// The live server panel: polls the Prometheus text at /metrics and shows running and waiting
// requests and prefix-cache hits. A server without /metrics shows "metrics unavailable".

import { authHeaders } from "./store.js";

const POLL_MS = 2000;

// Names as afm exports them; the alternatives cover other spellings of the same counters.
const SHOWN = [
  { label: "Running", names: ["afm:num_requests_running"] },
  { label: "Waiting", names: ["afm:num_requests_waiting"] },
  { label: "Prefix-cache hits", names: ["afm:radix_cache_hits_total", "afm:prefix_cache_hits_total"] },
];

// name → value, summed over label sets (`name{a="b"} 3`).
export function parsePrometheus(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const v = Number(m[3]);
    if (Number.isFinite(v)) values.set(m[1], (values.get(m[1]) ?? 0) + v);
  }
  return values;
}

function format(v) {
  return Number.isInteger(v) ? v.toLocaleString() : v.toFixed(2);
}

export function startMetricsPanel(container) {
  const status = container.querySelector(".metrics-status");
  const list = container.querySelector(".metrics-values");
  const show = (values) => {
    list.replaceChildren();
    for (const { label, names } of SHOWN) {
      const name = names.find((n) => values.has(n));
      const row = document.createElement("div");
      row.className = "metric";
      row.dataset.metric = names[0];
      const dt = document.createElement("dt");
      dt.textContent = label;
      const dd = document.createElement("dd");
      dd.textContent = name ? format(values.get(name)) : "–";
      row.append(dt, dd);
      list.append(row);
    }
  };
  const poll = async () => {
    try {
      const response = await fetch("/metrics", { cache: "no-store", headers: authHeaders() });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      show(parsePrometheus(await response.text()));
      status.textContent = "live";
      container.classList.remove("unavailable");
    } catch {
      list.replaceChildren();
      status.textContent = "metrics unavailable";
      container.classList.add("unavailable");
    }
    setTimeout(poll, POLL_MS);
  };
  poll();
}
