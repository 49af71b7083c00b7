// The chat page: conversations in tabs (kept in localStorage), each streaming its answers from
// /v1/chat/completions through fetch, with stop, regenerate and per-conversation settings. Several
// conversations may stream at once; each shows when it is queued, parked and resumed.

import { AuthError, apiFetch, ensureKey, keyButton, el } from "/web/api.js";
import { ChatStore, DEFAULT_SETTINGS, chatTitle, requestBody } from "/web/chat_store.js";
import { Answer } from "/web/chat_stream.js";
import { emptyState, messageElement, updateMessage, updateStatus } from "/web/chat_view.js";

const store = new ChatStore();
const running = new Map(); // chat id -> its Answer while it streams
const nodes = new Map(); // message -> its element, for the chat in view
const pending = new Set(); // messages to redraw at the next frame
let props = null;
let frame = 0;
const $ = (id) => document.getElementById(id);

async function loadProps() {
  try {
    props = await (await apiFetch("/props")).json();
  } catch (err) {
    if (err instanceof AuthError) {
      await ensureKey(err.message);
      return loadProps();
    }
    props = null; // still loading, say: the page works without it
  }
  $("model").textContent = props?.model ?? "";
  $("exact").hidden = props?.exact !== true;
}

// ---------------------------------------------------------------- tabs

function renderTabs() {
  const tabs = store.chats.map((chat) => {
    const active = chat.id === store.activeId;
    const state = running.get(chat.id)?.meta.state ?? "";
    return el("div", { class: `tab${active ? " active" : ""}`, role: "presentation" },
      el("button", {
        class: "tab-title", type: "button", role: "tab", "aria-selected": String(active),
        onclick: () => select(chat.id),
      }, el("span", { class: `tab-dot ${state}`, title: state }), el("span", { text: chatTitle(chat) })),
      el("button", {
        class: "tab-close", type: "button", title: "Close this conversation",
        "aria-label": "Close this conversation", text: "×", onclick: () => closeChat(chat.id),
      }));
  });
  const add = el("button", {
    class: "tab-new", type: "button", title: "New conversation", "aria-label": "New conversation",
    text: "+", onclick: () => { store.add(); showChat(); },
  });
  $("tabs").replaceChildren(...tabs, add);
}

function select(id) {
  store.select(id);
  showChat();
}

function closeChat(id) {
  running.get(id)?.stop();
  store.remove(id);
  showChat();
}

function showChat() {
  renderTabs();
  renderMessages();
  renderSettings();
  renderComposer();
}

// ---------------------------------------------------------------- messages

function actionsFor(chat) {
  return (message) => {
    if (chat.messages.at(-1) !== message || running.has(chat.id)) return [];
    return [el("button", {
      type: "button", class: "ghost small", text: "↻ Regenerate", title: "Ask for this answer again",
      onclick: () => regenerate(chat),
    })];
  };
}

function renderMessages() {
  const chat = store.active;
  const list = $("messages");
  nodes.clear();
  if (!chat.messages.length) {
    list.replaceChildren(emptyState());
    return;
  }
  list.replaceChildren(...chat.messages.map((message) => {
    const node = messageElement(message, actionsFor(chat));
    nodes.set(message, node);
    return node;
  }));
  list.scrollTop = list.scrollHeight;
}

// An answer changed: its status line at once (a park and its resume may arrive in one read, and
// each is shown), its text at the next frame.
function changed(chat, message) {
  store.saveSoon();
  const node = nodes.get(message);
  if (chat.id === store.activeId && node) {
    updateStatus(node, message.meta);
    pending.add(message);
  }
  frame ||= requestAnimationFrame(redraw);
}

function redraw() {
  frame = 0;
  const list = $("messages");
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
  for (const message of pending) {
    const node = nodes.get(message);
    if (node) updateMessage(node, message, actionsFor(store.active));
  }
  pending.clear();
  if (atBottom) list.scrollTop = list.scrollHeight;
  renderTabs();
  renderComposer();
}

// ---------------------------------------------------------------- asking

function ask(chat) {
  const body = requestBody(chat);
  const message = { role: "assistant", content: "", meta: null };
  chat.messages.push(message);
  const answer = new Answer(message, body, props, () => changed(chat, message));
  running.set(chat.id, answer);
  store.save();
  if (chat.id === store.activeId) renderMessages();
  renderTabs();
  renderComposer();
  answer.run().then(async () => {
    running.delete(chat.id);
    store.save();
    pending.add(message);
    changed(chat, message);
    if (answer.error instanceof AuthError) await ensureKey(answer.error.message);
  });
}

function send() {
  const chat = store.active;
  const prompt = $("prompt");
  const text = prompt.value;
  if (running.has(chat.id) || !text.trim()) return;
  chat.messages.push({ role: "user", content: text });
  prompt.value = "";
  ask(chat);
}

function regenerate(chat) {
  if (running.has(chat.id) || chat.messages.at(-1)?.role !== "assistant") return;
  chat.messages.pop();
  ask(chat);
}

function renderComposer() {
  const busy = running.has(store.activeId);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// ---------------------------------------------------------------- settings

const FIELDS = ["system", "temperature", "top_p", "max_tokens", "seed", "json"];

function renderSettings() {
  const s = store.active.settings;
  for (const name of FIELDS) {
    const input = $(`set-${name}`);
    if (input.type === "checkbox") input.checked = Boolean(s[name]);
    else input.value = s[name];
  }
  $("temperature-value").textContent = Number(s.temperature).toFixed(2);
  $("top_p-value").textContent = Number(s.top_p).toFixed(2);
}

function bindSettings() {
  for (const name of FIELDS) {
    $(`set-${name}`).addEventListener("input", (event) => {
      const input = event.target;
      store.active.settings[name] = input.type === "checkbox" ? input.checked : input.value;
      store.save();
      renderSettings();
    });
  }
  $("settings-reset").addEventListener("click", () => {
    store.active.settings = { ...DEFAULT_SETTINGS };
    store.save();
    renderSettings();
  });
  const panel = $("settings");
  const toggle = (open) => {
    panel.hidden = !open;
    $("settings-button").setAttribute("aria-expanded", String(open));
  };
  $("settings-button").addEventListener("click", () => toggle(panel.hidden));
  $("settings-close").addEventListener("click", () => toggle(false));
}

function bindComposer() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => running.get(store.activeId)?.stop());
}

// timers of paused and queued answers, and "no word from the server" for a silent one
function tick() {
  const now = Date.now();
  for (const [chatId, answer] of running) {
    const node = nodes.get(answer.message);
    if (chatId === store.activeId && node) updateStatus(node, answer.meta, now);
  }
}

async function start() {
  keyButton($("key-button"), loadProps);
  bindComposer();
  bindSettings();
  showChat();
  setInterval(tick, 200);
  await ensureKey();
  await loadProps();
}

start();
