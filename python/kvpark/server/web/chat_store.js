// The conversations, kept in localStorage so that they survive a reload: each with its messages,
// its settings and, per answer, what the server said about it (timings, the preempt record,
// cached prompt tokens, its parks). Nothing here talks to the server.

const STORE = "kvpark.chats.v1";

export const DEFAULT_SETTINGS = Object.freeze({
  system: "",
  temperature: 0.7,
  top_p: 1,
  max_tokens: 512,
  seed: "",
  json: false,
});

function newId() {
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}

function blankChat(settings) {
  return { id: newId(), settings: { ...DEFAULT_SETTINGS, ...settings }, messages: [] };
}

export class ChatStore {
  constructor(storage = localStorage) {
    this.storage = storage;
    this.chats = [];
    this.activeId = null;
    this.timer = null;
    this.load();
  }

  load() {
    let saved = null;
    try {
      saved = JSON.parse(this.storage.getItem(STORE) ?? "null");
    } catch {
      saved = null; // a store this version cannot read: start afresh rather than fail
    }
    const chats = Array.isArray(saved?.chats) ? saved.chats.filter(isChat) : [];
    for (const chat of chats) {
      chat.settings = { ...DEFAULT_SETTINGS, ...chat.settings };
      for (const message of chat.messages) {
        // an answer that was streaming when the page went away will never finish
        if (message.meta && ["waiting", "queued", "streaming", "paused"].includes(message.meta.state)) {
          message.meta.state = "interrupted";
        }
      }
    }
    this.chats = chats.length ? chats : [blankChat()];
    this.activeId = chats.some((c) => c.id === saved?.active) ? saved.active : this.chats[0].id;
  }

  get active() {
    return this.chats.find((c) => c.id === this.activeId) ?? this.chats[0];
  }

  find(id) {
    return this.chats.find((c) => c.id === id) ?? null;
  }

  select(id) {
    if (this.find(id)) this.activeId = id;
    this.save();
  }

  // a new conversation starts with the settings of the one in view
  add() {
    const chat = blankChat(this.active?.settings);
    this.chats.push(chat);
    this.activeId = chat.id;
    this.save();
    return chat;
  }

  remove(id) {
    const index = this.chats.findIndex((c) => c.id === id);
    if (index < 0) return;
    this.chats.splice(index, 1);
    if (!this.chats.length) this.chats.push(blankChat());
    if (this.activeId === id) this.activeId = this.chats[Math.max(0, index - 1)].id;
    this.save();
  }

  save() {
    clearTimeout(this.timer);
    this.timer = null;
    const body = JSON.stringify({ active: this.activeId, chats: this.chats });
    try {
      this.storage.setItem(STORE, body);
    } catch {
      // storage full: the page goes on; the conversations live until the tab closes
    }
  }

  // while an answer streams: at most one write a second
  saveSoon() {
    this.timer ??= setTimeout(() => this.save(), 1000);
  }
}

function isChat(chat) {
  return chat && typeof chat.id === "string" && Array.isArray(chat.messages);
}

export function chatTitle(chat) {
  const first = chat.messages.find((m) => m.role === "user");
  if (!first) return "New chat";
  const text = first.content.replace(/\s+/g, " ").trim();
  return text.length > 28 ? `${text.slice(0, 27)}…` : text;
}

// The request body for the next answer of a chat whose messages end with the user's turn.
export function requestBody(chat) {
  const s = chat.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of chat.messages) {
    if (m.role === "user" || (m.role === "assistant" && m.content)) {
      messages.push({ role: m.role, content: m.content });
    }
  }
  const body = {
    model: "default",
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number(s.temperature),
    top_p: Number(s.top_p),
    max_tokens: Number(s.max_tokens),
  };
  if (String(s.seed).trim() !== "") body.seed = Number(s.seed);
  if (s.json) body.response_format = { type: "json_object" };
  return body;
}
