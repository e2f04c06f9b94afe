// Conversations and settings, kept in the browser's localStorage so they survive reloads.
//
//   afm.conversations  [{ id, title, updated, messages: [{ role, content, reasoning?,
//                          stats?, stopped?, error? }] }]   newest first
//   afm.current        id of the conversation on screen
//   afm.settings       { system, temperature, top_p, max_tokens, api_key }  ("" means server
//                      default; api_key is sent as `Authorization: Bearer` when set)

const KEYS = { conversations: "afm.conversations", current: "afm.current", settings: "afm.settings" };

export const DEFAULT_SETTINGS = { system: "", temperature: "", top_p: "", max_tokens: "", api_key: "" };

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback; // unreadable or corrupt storage: start afresh rather than break the page
  }
}

// Returns an error message when the browser refuses to store (quota, private mode).
function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return null;
  } catch (e) {
    return `Could not save to browser storage: ${e.message}`;
  }
}

export function loadConversations() {
  const list = read(KEYS.conversations, []);
  return Array.isArray(list) ? list.filter((c) => c && c.id && Array.isArray(c.messages)) : [];
}

export function saveConversations(list) {
  return write(KEYS.conversations, list);
}

export function loadCurrentId() {
  return read(KEYS.current, null);
}

export function saveCurrentId(id) {
  return write(KEYS.current, id);
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(KEYS.settings, {}) };
}

export function saveSettings(settings) {
  return write(KEYS.settings, settings);
}

// Headers for every API call: the server's --api-key, when one was entered in Settings.
export function authHeaders() {
  const key = String(loadSettings().api_key ?? "").trim();
  return key ? { authorization: `Bearer ${key}` } : {};
}

export function newConversation() {
  const id = crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`;
  return { id, title: "New chat", updated: Date.now(), messages: [] };
}

export function titleFrom(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || "New chat";
}
