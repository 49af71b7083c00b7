// The pool view: one GET /v1/pool/events stream read through fetch (it needs the API key, which
// EventSource cannot send), a snapshot and then deltas, applied to one picture of the pool that
// pool_draw.js draws. A stream that ends or fails is opened again after a pause; a 401 asks for the
// key. The server never sends a prompt's text: ids and sizes only.

import { AuthError, apiFetch, ensureKey, keyButton, readEvents } from "/web/api.js";
import { draw, drawClock } from "/web/pool_draw.js";

const TIMELINE_S = 300;
const STALE_S = 12; // the server pings every 5 s: this long without a frame, the line is down

export const view = {
  time: 0, // the server's clock at the last frame (seconds)
  offset: 0, // server clock - this page's clock
  interval: 0.25,
  pool: null,
  preempt: null,
  owners: new Int32Array(0),
  requests: [],
  counts: {},
  timeline: [],
  skips: 0,
  heard: 0,
};

export function serverNow() {
  return Date.now() / 1000 + view.offset;
}

function fill(runs) {
  for (const [first, count, owner] of runs) view.owners.fill(owner, first, first + count);
}

function clock(time) {
  view.time = time;
  view.offset = time - Date.now() / 1000;
}

function applySnapshot(body) {
  clock(body.time);
  view.interval = body.interval;
  view.pool = body.pool;
  view.preempt = body.preempt;
  view.owners = new Int32Array(body.pool.pages);
  fill(body.pages);
  view.requests = body.requests;
  view.counts = body.counts;
  view.timeline = body.timeline;
}

function applyDelta(body) {
  if (view.pool === null) return; // cannot happen: a snapshot comes first on every connection
  clock(body.time);
  if (body.pages) fill(body.pages);
  if (body.requests) view.requests = body.requests;
  if (body.preempt) view.preempt = body.preempt;
  if (body.counts) view.counts = body.counts;
  if (body.timeline) view.timeline.push(...body.timeline);
  const since = body.time - TIMELINE_S;
  while (view.timeline.length && view.timeline[0].time < since) view.timeline.shift();
}

let frame = 0;
function redraw() {
  frame ||= requestAnimationFrame(() => {
    frame = 0;
    draw(view, serverNow());
  });
}

function setLine(state, detail = "") {
  const pill = document.getElementById("line");
  pill.dataset.state = state;
  pill.querySelector(".text").textContent = { live: "live", connecting: "connecting", down: "reconnecting" }[state];
  pill.title = detail;
}

function alive() {
  view.heard = Date.now();
  if (document.getElementById("line").dataset.state !== "live") setLine("live");
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function follow() {
  let pause = 1000;
  for (;;) {
    try {
      await ensureKey();
      setLine("connecting");
      const response = await apiFetch("/v1/pool/events");
      setLine("live");
      pause = 1000;
      await readEvents(response, {
        comment: (text) => {
          alive();
          if (text === "skipped") view.skips += 1; // this page read too slowly: a snapshot follows
        },
        event: (name, data) => {
          alive();
          const body = JSON.parse(data);
          if (name === "snapshot") applySnapshot(body);
          else if (name === "delta") applyDelta(body);
          redraw();
        },
      });
      setLine("down", "the stream ended");
    } catch (err) {
      if (err instanceof AuthError) {
        await ensureKey(err.message);
        continue;
      }
      setLine("down", err.message);
    }
    await sleep(pause);
    pause = Math.min(pause * 2, 10000);
  }
}

function tick() {
  if (view.pool !== null) drawClock(view, serverNow());
  const pill = document.getElementById("line");
  if (pill.dataset.state === "live" && Date.now() - view.heard > STALE_S * 1000) setLine("down", "no frame");
}

keyButton(document.getElementById("key-button"), () => location.reload());
window.addEventListener("resize", redraw);
setInterval(tick, 1000);
follow();
