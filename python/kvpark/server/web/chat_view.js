// How one message looks: a user's turn as plain text, an answer as Markdown with its status line
// (queued, paused while parked, resumed, stopped...) and, once it has them, the numbers the server
// gave: tokens and speed (timings), prompt tokens from the prefix cache, the preempt record and
// each park.

import { el, formatSeconds } from "/web/api.js";
import { renderMarkdown } from "/web/markdown.js";
import { statusOf } from "/web/chat_stream.js";

export function messageElement(message, actions) {
  if (message.role === "user") {
    return el("article", { class: "msg user" },
      el("div", { class: "bubble" }, el("div", { class: "plain", text: message.content })));
  }
  const status = el("div", { class: "status" },
    el("span", { class: "dot" }), el("span", { class: "label" }), el("span", { class: "timer" }));
  const body = el("div", { class: "md" });
  const stats = el("footer", { class: "stats" });
  const tools = el("div", { class: "tools" });
  const node = el("article", { class: "msg assistant" },
    el("img", { class: "avatar", src: "/web/icon.svg", alt: "", width: 28, height: 28 }),
    el("div", { class: "bubble" }, status, body, stats, tools));
  node.parts = { status, body, stats, tools, rendered: null, statsFor: null };
  updateMessage(node, message, actions);
  return node;
}

// Redraw what changed: the text only when it grew, the stats only when they did.
export function updateMessage(node, message, actions) {
  const parts = node.parts;
  if (!parts) return;
  const meta = message.meta ?? { state: "done", parks: [] };
  if (parts.rendered !== message.content) {
    parts.rendered = message.content;
    renderMarkdown(message.content, parts.body);
    parts.body.classList.toggle("empty", message.content === "");
  }
  updateStatus(node, meta);
  const statsKey = JSON.stringify([meta.state, meta.usage, meta.timings, meta.preempt,
    meta.parks.map((p) => [p.mode, p.live, p.ms])]);
  if (parts.statsFor !== statsKey) {
    parts.statsFor = statsKey;
    parts.stats.replaceChildren(...statsOf(meta));
  }
  parts.tools.replaceChildren(...(actions ? actions(message) : []));
}

export function updateStatus(node, meta, now = Date.now()) {
  const { status } = node.parts;
  const [state, label, timer] = statusOf(meta, now);
  status.dataset.state = state;
  status.hidden = label === "";
  const labelNode = status.querySelector(".label");
  if (labelNode.textContent !== label) labelNode.textContent = label;
  const timerNode = status.querySelector(".timer");
  if (timerNode.textContent !== timer) timerNode.textContent = timer;
}

function statsOf(meta) {
  const out = [];
  const t = meta.timings;
  const u = meta.usage;
  if (t) {
    const speed = t.predicted_per_second ? ` · ${t.predicted_per_second.toFixed(1)} tok/s` : "";
    out.push(stat("tokens", `${t.predicted_n} tokens${speed}`,
      `generated in ${formatSeconds(t.predicted_ms / 1000)}, first token after ${formatSeconds(t.prompt_ms / 1000)}`));
  }
  if (u) {
    const cached = u.prompt_tokens_details?.cached_tokens ?? 0;
    out.push(stat("prompt", `prompt ${u.prompt_tokens} · ${cached} cached`,
      "prompt tokens, and of them those whose K and V came from the prefix cache"));
  }
  const parks = meta.parks ?? [];
  if (meta.preempt) {
    const { parks: n, recomputes } = meta.preempt;
    const text = n === 0 ? "never parked" : `parked ${n}× · ${n - recomputes} swap, ${recomputes} recompute`;
    out.push(stat(n ? "parked" : "calm", text, "the preempt record of this answer"));
  }
  if (parks.length) {
    const over = parks.filter((p) => p.ms !== null);
    const total = over.reduce((sum, p) => sum + p.ms, 0) / 1000;
    const chips = parks.slice(-8).map((p) => {
      const mode = p.mode ?? p.live ?? "parked";
      const time = p.ms === null ? "…" : formatSeconds(p.ms / 1000);
      return el("span", { class: `park ${mode}`, text: `${mode} ${time}`,
        title: `paused - parked (${mode}) for ${time}, then resumed from the same token` });
    });
    const more = parks.length > 8 ? el("span", { class: "park more", text: `+${parks.length - 8} earlier` }) : null;
    out.push(el("div", { class: "parks" },
      over.length ? el("span", { class: "parks-total", text: `paused ${formatSeconds(total)} in all:` }) : null,
      more, chips));
  }
  if (t || u || meta.preempt) {
    const record = { usage: u, timings: t, preempt: meta.preempt, finish_reason: meta.finish };
    out.push(el("details", { class: "raw" }, el("summary", { text: "details" }),
      el("pre", { text: JSON.stringify(record, null, 2) })));
  }
  return out;
}

function stat(kind, text, title) {
  return el("span", { class: `stat ${kind}`, text, title });
}

export function emptyState() {
  return el("div", { class: "empty-state" },
    el("h2", { text: "Start a conversation" }),
    el("p", { text: "Answers stream as they are generated. When the KV pool fills, kvpark parks " +
      "an answer instead of failing it: it shows as paused here and goes on from the same token." }),
    el("p", {}, "Watch conversations share the pool on the ", el("a", { href: "/pool", text: "pool view" }), "."));
}
