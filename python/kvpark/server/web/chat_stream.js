// One answer streaming from /v1/chat/completions, and what its stream says on the way: the
// tokens, ": queued N" (its place in the wait queue), ": preempted" and ": resumed" (parked and
// back, from the same token), ": recomputed" (that resume replays its tokens), keepalives and pings
// (the server is there), and the last chunk's usage, timings and preempt record.
//
// A park's mode is not in the notice. The stream settles it at the resume: ": recomputed" comes
// right after ": resumed" exactly when the resume replays (a recompute park), so a resume followed
// by anything else was a swap. While the request is parked the page asks /slots once: the slot's
// park counters (n_preempt, n_recompute) say whether this park is a recompute, so the label can say
// "(swap)" or "(recompute)" during the pause, as soon as the answer comes back. A server that never
// swaps (--preempt-ram 0, in /props) makes every park a recompute: that label is known at once.

import { apiFetch, readEvents } from "/web/api.js";

export const REQUEST_ID_HEADER = "x-kvpark-request-id";

export class Answer {
  // message: the stored assistant message this answer fills; body: the request; props: /props
  // (or null); onChange: called after every change, for the page to redraw
  constructor(message, body, props, onChange) {
    this.message = message;
    this.body = body;
    this.onChange = onChange;
    this.alwaysRecompute = props?.preempt?.enabled && props.preempt.ram_mib === 0;
    this.controller = new AbortController();
    this.requestId = null;
    this.resumed = null; // the park whose ": resumed" came last, until the next line settles it
    this.ended = false;
    message.content = "";
    message.meta = { state: "waiting", started: Date.now(), heard: Date.now(), parks: [] };
  }

  get meta() {
    return this.message.meta;
  }

  async run() {
    try {
      const response = await apiFetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(this.body),
        signal: this.controller.signal,
      });
      this.requestId = response.headers.get(REQUEST_ID_HEADER);
      await readEvents(response, {
        comment: (text) => this.comment(text),
        event: (_name, data) => this.data(data),
      });
      this.settle(null);
      if (!["error", "stopped"].includes(this.meta.state)) this.meta.state = "done";
    } catch (err) {
      if (err.name === "AbortError") {
        this.meta.state = "stopped";
      } else {
        this.meta.state = "error";
        this.meta.error = err.message;
        this.error = err;
      }
    } finally {
      this.ended = true;
      this.meta.ended = Date.now();
      this.onChange();
    }
  }

  stop() {
    this.controller.abort();
  }

  heard() {
    this.meta.heard = Date.now();
  }

  // the line after ": resumed": ": recomputed" makes that park a recompute, anything else a swap
  settle(text) {
    const park = this.resumed;
    if (park === null) return false;
    this.resumed = null;
    park.mode = text === "recomputed" ? "recompute" : "swap";
    return text === "recomputed";
  }

  comment(text) {
    this.heard();
    if (this.settle(text)) {
      this.onChange();
      return;
    }
    const [word, place] = text.split(" ");
    const meta = this.meta;
    if (word === "preempted") {
      const park = { mode: null, live: this.alwaysRecompute ? "recompute" : null, at: Date.now(), ms: null };
      meta.parks.push(park);
      meta.state = "paused";
      this.lookUpMode(park);
    } else if (word === "resumed") {
      const park = meta.parks.at(-1);
      if (park && park.ms === null) {
        park.ms = Date.now() - park.at;
        this.resumed = park;
      }
      meta.state = "streaming";
      meta.resumedAt = Date.now();
    } else if (word === "queued") {
      meta.state = "queued";
      meta.place = Number(place);
    } else {
      return; // a keepalive or a ping: the server is there, nothing else changed
    }
    this.onChange();
  }

  data(text) {
    this.heard();
    this.settle(null);
    if (text === "[DONE]") return;
    const chunk = JSON.parse(text);
    const meta = this.meta;
    if (chunk.error) {
      meta.state = "error";
      meta.error = chunk.error.message;
      this.onChange();
      return;
    }
    this.requestId ??= chunk.id;
    for (const choice of chunk.choices ?? []) {
      const piece = choice.delta?.content;
      if (piece) {
        meta.firstToken ??= Date.now();
        this.message.content += piece;
      }
      if (choice.finish_reason) meta.finish = choice.finish_reason;
    }
    if (meta.state === "waiting" || meta.state === "queued") meta.state = "streaming";
    if (chunk.usage) meta.usage = chunk.usage;
    if (chunk.timings) meta.timings = chunk.timings;
    if (chunk.preempt) meta.preempt = chunk.preempt;
    this.onChange();
  }

  // While parked: this park's mode from the slot's counters, for the label.
  async lookUpMode(park) {
    if (this.requestId === null || park.live !== null) return;
    let slots;
    try {
      slots = await (await apiFetch("/slots")).json();
    } catch {
      return; // the label goes on without its mode; the resume settles it
    }
    const slot = slots.find((s) => s.request_id === this.requestId);
    const parks = this.meta.parks;
    const stillParked = slot && (slot.state === "parked" || slot.state === "parking");
    if (!stillParked || park.ms !== null || slot.n_preempt !== parks.length) return;
    const earlier = parks.slice(0, -1).filter((p) => p.mode === "recompute").length;
    park.live = slot.n_recompute > earlier ? "recompute" : "swap";
    this.onChange();
  }
}

// What an answer's status line says now: [state, label, timer text or ""].
export function statusOf(meta, now = Date.now()) {
  const silent = (now - meta.heard) / 1000;
  const quiet = silent >= 5 ? ` · no word from the server for ${Math.floor(silent)} s` : "";
  switch (meta.state) {
    case "waiting":
      return ["waiting", "waiting for the server", quiet];
    case "queued":
      return ["queued", `queued - place ${meta.place}`, quiet];
    case "paused": {
      const park = meta.parks.at(-1);
      const mode = park?.mode ?? park?.live;
      const label = mode ? `paused - parked (${mode})` : "paused - parked";
      const since = park ? ((now - park.at) / 1000).toFixed(1) : "0.0";
      return ["paused", label, `${since} s · server alive ${Math.max(0, silent).toFixed(1)} s ago`];
    }
    case "streaming": {
      const back = meta.resumedAt && now - meta.resumedAt < 1500;
      return ["streaming", back ? "resumed from the same token" : "streaming", quiet];
    }
    case "stopped":
      return ["stopped", "stopped", ""];
    case "interrupted":
      return ["stopped", "interrupted: the page was closed while it streamed", ""];
    case "error":
      return ["error", `error: ${meta.error ?? "the stream failed"}`, ""];
    default:
      return ["done", "", ""];
  }
}
