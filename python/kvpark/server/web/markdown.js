// The Markdown a chat answer needs, rendered into DOM nodes (never through innerHTML, so nothing a
// model writes can become markup): headings, lists (nested by indentation), emphasis, inline code,
// fenced code blocks, block quotes, rules and paragraphs. Links are shown as text: the link's text,
// then its address, neither clickable. An answer still streaming may end inside a code fence: the
// block runs to the end until the fence closes.

import { el } from "/web/api.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;

export function renderMarkdown(text, container) {
  container.replaceChildren(...blocks(text.replace(/\r\n?/g, "\n").split("\n")));
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || ITEM.test(line) ||
    QUOTE.test(line);
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (line.trim() === "") {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      const close = new RegExp(`^ {0,3}${m[1][0]}{${m[1].length},}\\s*$`);
      const body = [];
      i += 1;
      while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
      i += 1; // the closing fence (or the end of an answer still streaming)
      out.push(codeBlock(body.join("\n"), m[2]));
    } else if ((m = HEADING.exec(line))) {
      out.push(el(`h${Math.min(m[1].length + 2, 6)}`, {}, inline(m[2])));
      i += 1;
    } else if (RULE.test(line)) {
      out.push(el("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        body.push(m[1]);
        i += 1;
      }
      out.push(el("blockquote", {}, blocks(body)));
    } else if (ITEM.test(line)) {
      const [list, next] = parseList(lines, i);
      out.push(list);
      i = next;
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() !== "" && (para.length === 0 ||
        !startsBlock(lines[i]))) {
        para.push(lines[i].trim());
        i += 1;
      }
      out.push(el("p", {}, withBreaks(para)));
    }
  }
  return out;
}

// A list from line i: its items at the first item's indentation; deeper items and indented lines
// belong to the item above them. Returns the list and the index of the first line after it.
function parseList(lines, start) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = ordered ? el("ol") : el("ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  let i = start;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || m[1].length < indent || /\d/.test(m[2]) !== ordered) break;
    if (m[1].length > indent) break; // cannot happen for the first; deeper ones go below
    const body = [m[3]];
    i += 1;
    while (i < lines.length) {
      const line = lines[i];
      const deeper = ITEM.exec(line);
      if (line.trim() === "") {
        const next = lines[i + 1] ?? "";
        if (next.trim() !== "" && leading(next) > indent) {
          body.push("");
          i += 1;
          continue;
        }
        break;
      }
      if (deeper && deeper[1].length <= indent) break;
      if (!deeper && leading(line) <= indent && startsBlock(line)) break;
      body.push(line.slice(Math.min(leading(line), indent + 2)));
      i += 1;
    }
    list.append(listItem(body));
    while (i < lines.length && lines[i].trim() === "" && ITEM.test(lines[i + 1] ?? "") &&
      ITEM.exec(lines[i + 1])[1].length === indent) {
      i += 1; // a blank line between two items of this list
    }
  }
  return [list, i];
}

function listItem(body) {
  // a one-paragraph item stays inline; one with nested blocks gets them as blocks
  const rest = body.slice(1);
  if (rest.every((line) => line.trim() !== "" && !startsBlock(line.trim()) && !ITEM.test(line))) {
    return el("li", {}, withBreaks(body.map((line) => line.trim())));
  }
  const head = [];
  let i = 0;
  while (i < body.length && body[i].trim() !== "" && (i === 0 || !startsBlock(body[i]))) {
    head.push(body[i].trim());
    i += 1;
  }
  return el("li", {}, withBreaks(head), blocks(body.slice(i)));
}

function leading(line) {
  return line.length - line.trimStart().length;
}

function withBreaks(lines) {
  const out = [];
  lines.forEach((line, index) => {
    if (index > 0) out.push(el("br"));
    out.push(...inline(line));
  });
  return out;
}

function codeBlock(code, language) {
  const copy = el("button", { type: "button", class: "copy", text: "Copy" });
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(code);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Select and copy";
    }
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  });
  const head = el("div", { class: "code-head" }, el("span", { text: language || "code" }), copy);
  return el("div", { class: "code" }, head, el("pre", {}, el("code", { text: code })));
}

// Inline spans, leftmost first: code, links, strong, emphasis, strike-through.
const INLINE = new RegExp([
  "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)", // 1, 2: code
  "\\[([^\\]\\n]+)\\]\\(\\s*<?([^)\\s>]*)>?(?:\\s+\"[^\"]*\")?\\s*\\)", // 3, 4: link
  "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 5: strong
  "(?<![\\w])__(?=\\S)([\\s\\S]*?\\S)__(?![\\w])", // 6: strong
  "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*", // 7: emphasis
  "(?<![\\w])_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?![\\w])", // 8: emphasis
  "~~(?=\\S)([\\s\\S]*?\\S)~~", // 9: strike-through
].join("|"), "g");

export function inline(text) {
  const out = [];
  let last = 0;
  INLINE.lastIndex = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) out.push(document.createTextNode(text.slice(last, m.index)));
    last = m.index + m[0].length;
    if (m[2] !== undefined) {
      out.push(el("code", { text: m[2].replace(/^ (.*) $/, "$1") }));
    } else if (m[3] !== undefined) {
      // shown as text: nothing a model writes becomes something to click
      out.push(el("span", { class: "link" }, inline(m[3]),
        m[4] ? el("span", { class: "link-url", text: ` (${m[4]})` }) : null));
    } else if (m[5] !== undefined || m[6] !== undefined) {
      out.push(el("strong", {}, inline(m[5] ?? m[6])));
    } else if (m[7] !== undefined || m[8] !== undefined) {
      out.push(el("em", {}, inline(m[7] ?? m[8])));
    } else {
      out.push(el("del", {}, inline(m[9])));
    }
  }
  if (last < text.length) out.push(document.createTextNode(text.slice(last)));
  return out;
}
