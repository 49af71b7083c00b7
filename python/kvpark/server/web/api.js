// The server's API as both pages use it: the API key, authorised fetch, and Server-Sent Events
// read through fetch.
//
// Why fetch and not EventSource: EventSource can send no Authorization header, and it drops the
// SSE comments (": preempted", ": resumed", ": queued N", keepalives) that carry kvpark's notices.
//
// The key: the page learns from a <meta> the server writes whether one is needed, so it never
// provokes a 401 to find out. It is asked for in a dialog, sent only as an Authorization header,
// and kept in this tab's sessionStorage (or localStorage when the person ticks "remember"); it
// never goes into a URL.

const KEY_ITEM = "kvpark.apiKey";

export function keyNeeded() {
  const meta = document.querySelector('meta[name="kvpark-auth"]');
  return meta !== null && meta.content === "key";
}

export function storedKey() {
  return sessionStorage.getItem(KEY_ITEM) ?? localStorage.getItem(KEY_ITEM);
}

function storeKey(key, remember) {
  sessionStorage.setItem(KEY_ITEM, key);
  if (remember) localStorage.setItem(KEY_ITEM, key);
  else localStorage.removeItem(KEY_ITEM);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_ITEM);
  localStorage.removeItem(KEY_ITEM);
}

export class AuthError extends Error {}

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// fetch() with the key; a 401 forgets the key and throws AuthError, another error status throws
// HttpError with the server's message.
export async function apiFetch(path, options = {}) {
  const headers = new Headers(options.headers ?? {});
  const key = storedKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...options, headers, cache: "no-store" });
  if (response.ok) return response;
  const message = await errorMessage(response);
  if (response.status === 401) {
    forgetKey();
    throw new AuthError(message);
  }
  throw new HttpError(response.status, message);
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body?.error?.message ?? `${response.status} ${response.statusText}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// Until the page has a key the server takes: the dialog, checked against /v1/models. Resolves at
// once when the server wants none or the stored one is there.
let asking = null;
export function ensureKey(reason = "") {
  if (!keyNeeded() || storedKey()) return Promise.resolve();
  asking ??= askForKey(reason).finally(() => {
    asking = null;
  });
  return asking;
}

function askForKey(reason) {
  const dialog = document.getElementById("key-dialog");
  const form = dialog.querySelector("form");
  const input = dialog.querySelector("input[type=password]");
  const remember = dialog.querySelector("input[type=checkbox]");
  const error = dialog.querySelector(".error");
  error.textContent = reason;
  input.value = "";
  return new Promise((resolve) => {
    const submit = async (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      storeKey(key, remember.checked);
      try {
        await apiFetch("/v1/models");
      } catch (err) {
        error.textContent = err instanceof AuthError ? "The server did not take that key." : "";
        if (err instanceof AuthError) return;
      }
      form.removeEventListener("submit", submit);
      dialog.close();
      resolve();
    };
    form.addEventListener("submit", submit);
    dialog.addEventListener("cancel", (event) => event.preventDefault());
    dialog.showModal();
    input.focus();
  });
}

// A "Change key" button for pages on a server that wants one.
export function keyButton(button, onChange) {
  if (!keyNeeded()) return;
  button.hidden = false;
  button.addEventListener("click", async () => {
    forgetKey();
    await ensureKey();
    onChange?.();
  });
}

// Reads an SSE body line by line: handlers.comment(text) for each comment line as it comes (the
// notices must not wait for an event's end), handlers.event(name, data) for each event.
export async function readEvents(response, handlers) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let name = "";
  let data = [];
  const line = (text) => {
    if (text === "") {
      if (data.length) handlers.event(name || "message", data.join("\n"));
      name = "";
      data = [];
    } else if (text.startsWith(":")) {
      handlers.comment(text.slice(1).trim());
    } else {
      const colon = text.indexOf(":");
      const field = colon < 0 ? text : text.slice(0, colon);
      const value = colon < 0 ? "" : text.slice(colon + 1).replace(/^ /, "");
      if (field === "data") data.push(value);
      else if (field === "event") name = value;
    }
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      line(buffer.slice(0, end).replace(/\r$/, ""));
      buffer = buffer.slice(end + 1);
    }
  }
  if (buffer) line(buffer);
  line("");
}

// Small DOM helper: el("div", {class: "x", text: "y"}, child, ...)
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key in node && typeof value !== "string") node[key] = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) node.append(child);
  }
  return node;
}

export function formatBytes(bytes) {
  if (bytes < 1024) return `${bytes} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let value = bytes / 1024;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value < 10 ? value.toFixed(1) : Math.round(value)} ${units[unit]}`;
}

export function formatSeconds(seconds) {
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
}
