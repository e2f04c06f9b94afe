// A small Markdown renderer for model answers: fenced code blocks, headings, lists, quotes,
// tables, rules, and inline code, bold, italic, strikethrough and links.
//
// Safety: every piece of source text is HTML-escaped before any tag is added, and links keep
// only http(s), mailto and same-page URLs, so a model cannot inject markup or script.
// Streaming: an unclosed code fence runs to the end, so a half-written block already shows as
// code.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+/;
const TABLE_DIVIDER = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const BLANK = /^\s*$/;

export function escapeHtml(text) {
  return text
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;")
    .replace(/'/g, "&#39;");
}

export function renderMarkdown(source) {
  // NUL marks code-span placeholders below; it has no business in text anyway.
  const text = String(source).replace(/\r\n?/g, "\n").replace(/\0/g, "");
  return renderBlocks(text.split("\n"));
}

function renderBlocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (BLANK.test(line)) {
      i++;
    } else if ((m = line.match(FENCE))) {
      const body = [];
      for (i++; i < lines.length && !closesFence(lines[i], m[1]); i++) body.push(lines[i]);
      i++; // the closing fence, or past the end while it is still streaming
      out.push(codeBlock(body.join("\n"), m[2]));
    } else if ((m = line.match(HEADING))) {
      const level = m[1].length;
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) body.push(lines[i].replace(QUOTE, ""));
      out.push(`<blockquote>${renderBlocks(body)}</blockquote>`);
    } else if (LIST_ITEM.test(line)) {
      i = renderList(lines, i, out);
    } else if (isTableStart(lines, i)) {
      i = renderTable(lines, i, out);
    } else {
      const body = [];
      for (; i < lines.length && !BLANK.test(lines[i]) && (body.length === 0 || !startsBlock(lines, i)); i++) {
        body.push(lines[i].trim());
      }
      out.push(`<p>${inline(body.join("\n")).replace(/\n/g, "<br>")}</p>`);
    }
  }
  return out.join("\n");
}

function closesFence(line, fence) {
  const t = line.trim();
  return t.length >= fence.length && t[0] === fence[0] && /^(`+|~+)$/.test(t);
}

function startsBlock(lines, i) {
  const line = lines[i];
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    LIST_ITEM.test(line) || isTableStart(lines, i);
}

function codeBlock(code, lang) {
  const safeLang = /^[\w+#.-]{1,32}$/.test(lang) ? lang : "";
  const cls = safeLang ? ` class="language-${safeLang}"` : "";
  return `<div class="code-block"><div class="code-head"><span>${safeLang || "code"}</span>` +
    `<button type="button" class="copy-code">Copy</button></div>` +
    `<pre><code${cls}>${escapeHtml(code)}</code></pre></div>`;
}

// Items start at the list's indent; deeper lines (and lazy continuation lines) belong to the
// current item and are rendered recursively, which gives nested lists.
function renderList(lines, i, out) {
  const first = lines[i].match(LIST_ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  let contentIndent = first[0].length;
  while (i < lines.length) {
    const line = lines[i];
    const m = line.match(LIST_ITEM);
    if (m && m[1].length <= indent + 1 && /\d/.test(m[2]) === ordered) {
      items.push([line.slice(m[0].length)]);
      contentIndent = m[0].length;
    } else if (m && m[1].length <= indent + 1) {
      break; // a different kind of list starts
    } else if (BLANK.test(line)) {
      const next = lines[i + 1];
      if (next === undefined || (leadingSpaces(next) <= indent && !LIST_ITEM.test(next))) break;
      items[items.length - 1].push("");
    } else if (leadingSpaces(line) > indent) {
      items[items.length - 1].push(line.slice(Math.min(leadingSpaces(line), contentIndent)));
    } else if (!startsBlock(lines, i)) {
      items[items.length - 1].push(line);
    } else {
      break;
    }
    i++;
  }
  const tag = ordered ? "ol" : "ul";
  const start = ordered && parseInt(first[2], 10) !== 1 ? ` start="${parseInt(first[2], 10)}"` : "";
  // A one-paragraph item shows without <p> margins (a "tight" list).
  const li = items.map((item) => `<li>${renderBlocks(item).replace(/^<p>([\s\S]*?)<\/p>/, "$1")}</li>`);
  out.push(`<${tag}${start}>${li.join("")}</${tag}>`);
  return i;
}

function leadingSpaces(line) {
  return line.length - line.trimStart().length;
}

function isTableStart(lines, i) {
  return lines[i].includes("|") && i + 1 < lines.length && TABLE_DIVIDER.test(lines[i + 1]) &&
    lines[i + 1].includes("-");
}

function splitRow(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function renderTable(lines, i, out) {
  const head = splitRow(lines[i]);
  const aligns = splitRow(lines[i + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
  const cell = (tag, text, k) =>
    `<${tag}${aligns[k] ? ` style="text-align:${aligns[k]}"` : ""}>${inline(text)}</${tag}>`;
  const rows = [];
  for (i += 2; i < lines.length && lines[i].includes("|") && !BLANK.test(lines[i]); i++) {
    rows.push(`<tr>${head.map((_, k) => cell("td", splitRow(lines[i])[k] ?? "", k)).join("")}</tr>`);
  }
  out.push(`<div class="table-wrap"><table><thead><tr>${head.map((h, k) => cell("th", h, k)).join("")}</tr></thead>` +
    `<tbody>${rows.join("")}</tbody></table></div>`);
  return i;
}

function safeUrl(url) {
  return /^(https?:|mailto:|#|\/(?!\/))/i.test(url);
}

// Inline spans. Code spans are cut out first (their content is literal), the rest is escaped,
// then the emphasis and link patterns run on the escaped text.
export function inline(text) {
  const codes = [];
  let s = text.replace(/(`+)([\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => {
    codes.push(`<code>${escapeHtml(code.replace(/^ (.*) $/s, "$1"))}</code>`);
    return `\0${codes.length - 1}\0`;
  });
  s = escapeHtml(s);
  // The URL is already escaped, so it cannot leave the attribute.
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (_, label, url) =>
    safeUrl(url) ? `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>` : label);
  s = s
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*([^\s*](?:[^*\n]*?[^\s*])?)\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_([^\s_](?:[^_\n]*?[^\s_])?)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  return s.replace(/\0(\d+)\0/g, (_, k) => codes[Number(k)]);
}
