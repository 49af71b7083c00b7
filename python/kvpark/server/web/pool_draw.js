// Drawing the pool view: the cards, the grid of pages coloured by owner, the requests, the parked
// ones with their host bytes, and the timeline of the last five minutes. Everything is redrawn
// from `view` (pool.js), which holds the latest picture.

import { el, formatBytes, formatSeconds } from "/web/api.js";

const FREE = 0;
const CACHED = -1;
const SHARED = -2;
const PALETTE = ["#6366f1", "#0ea5e9", "#10b981", "#f59e0b", "#ec4899", "#8b5cf6", "#14b8a6",
  "#f97316", "#84cc16", "#06b6d4", "#e11d48", "#a855f7"];
const $ = (id) => document.getElementById(id);

export function colorOf(key) {
  return PALETTE[(key - 1) % PALETTE.length];
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function shortId(id) {
  return id.length > 24 ? `${id.slice(0, 13)}…${id.slice(-6)}` : id;
}

function chip(key) {
  const node = el("span", { class: "chip" });
  node.style.background = colorOf(key);
  return node;
}

export function draw(view, now) {
  const counts = drawGrid(view);
  drawCards(view, counts);
  drawRequests(view);
  drawClock(view, now);
  drawEvents(view);
}

// what moves with the clock: the parked requests' timers and the timeline
export function drawClock(view, now) {
  drawParked(view, now);
  drawTimeline(view, now);
}

// ------------------------------------------------------------------------------------ canvas

function prepare(canvas, height) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  canvas.style.height = `${height}px`;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return [ctx, width];
}

// ------------------------------------------------------------------------------------ the grid

let grid = null; // the last layout, for the tooltip

function layout(pages, width) {
  const wanted = 2 ** Math.ceil(Math.log2(Math.sqrt(pages * 2)));
  const cols = Math.max(1, Math.min(pages, Math.max(16, Math.min(128, wanted))));
  const gap = width / cols >= 12 ? 3 : 1;
  const cell = Math.max(2, Math.floor((width - gap * (cols - 1)) / cols));
  const rows = Math.ceil(pages / cols);
  return { cols, rows, cell, gap, height: rows * (cell + gap) - gap };
}

function drawGrid(view) {
  const canvas = $("grid");
  const pages = view.owners.length;
  const shape = layout(pages, canvas.clientWidth);
  const [ctx] = prepare(canvas, shape.height);
  const free = cssVar("--page-free");
  const cached = cssVar("--page-cached");
  const shared = cssVar("--page-shared");
  const counts = { free: 0, cached: 0, shared: 0, owned: 0, owners: 0 };
  const owners = new Set();
  for (let page = 0; page < pages; page += 1) {
    const owner = view.owners[page];
    const x = (page % shape.cols) * (shape.cell + shape.gap);
    const y = Math.floor(page / shape.cols) * (shape.cell + shape.gap);
    if (owner > 0) {
      owners.add(owner);
      counts.owned += 1;
      ctx.fillStyle = colorOf(owner);
    } else if (owner === CACHED) {
      counts.cached += 1;
      ctx.fillStyle = cached;
    } else if (owner === SHARED) {
      counts.shared += 1;
      ctx.fillStyle = shared;
    } else {
      counts.free += 1;
      ctx.fillStyle = free;
    }
    ctx.fillRect(x, y, shape.cell, shape.cell);
    if ((owner === CACHED || owner === SHARED) && shape.cell >= 6) {
      ctx.strokeStyle = owner === SHARED ? "rgb(255 255 255 / 55%)" : "rgb(255 255 255 / 70%)";
      ctx.lineWidth = 1;
      ctx.beginPath();
      ctx.moveTo(x + 1, y + shape.cell - 1);
      ctx.lineTo(x + shape.cell - 1, y + 1);
      ctx.stroke();
    }
  }
  counts.owners = owners.size;
  grid = { ...shape, view };
  canvas.dataset.counts = JSON.stringify(counts); // what the grid shows, for tests and tools
  canvas.dataset.draws = String(Number(canvas.dataset.draws ?? 0) + 1);
  drawLegend(view, counts);
  return counts;
}

function drawLegend(view, counts) {
  const items = view.requests.filter((r) => r.pages > 0).map((r) =>
    el("span", { class: "legend-item", title: r.id }, chip(r.key), `${shortId(r.id)} · ${r.pages} p`));
  const swatch = (cls, text) => el("span", { class: "legend-item" }, el("span", { class: `chip ${cls}` }), text);
  $("legend").replaceChildren(...items,
    swatch("shared", `shared ${counts.shared}`),
    swatch("cached", `cached ${counts.cached}`),
    swatch("free", `free ${counts.free}`));
  $("grid-size").textContent = `${view.pool.pages} pages × ${view.pool.page_size} cells`;
}

function tooltip(event) {
  const tip = $("grid-tip");
  if (grid === null) return;
  const rect = event.target.getBoundingClientRect();
  const col = Math.floor((event.clientX - rect.left) / (grid.cell + grid.gap));
  const row = Math.floor((event.clientY - rect.top) / (grid.cell + grid.gap));
  const page = row * grid.cols + col;
  if (col >= grid.cols || page >= grid.view.owners.length) {
    tip.hidden = true;
    return;
  }
  const owner = grid.view.owners[page];
  const request = grid.view.requests.find((r) => r.key === owner);
  const what = owner > 0 ? (request ? `${request.id} (${request.state})` : `request ${owner}`)
    : { [FREE]: "free", [CACHED]: "cached: kept for later prompts", [SHARED]: "shared by several requests" }[owner];
  tip.textContent = `page ${page} · ${what}`;
  tip.style.left = `${event.clientX - rect.left + 14}px`;
  tip.style.top = `${event.clientY - rect.top + 14}px`;
  tip.hidden = false;
}

$("grid").addEventListener("mousemove", tooltip);
$("grid").addEventListener("mouseleave", () => { $("grid-tip").hidden = true; });

// ------------------------------------------------------------------------------------ cards

function bar(id, parts) {
  $(id).replaceChildren(...parts.map(([share, cls]) => {
    const part = el("span", { class: cls });
    part.style.width = `${(100 * share).toFixed(2)}%`;
    return part;
  }));
}

function drawCards(view, counts) {
  const pages = view.owners.length || 1;
  const used = counts.owned + counts.shared;
  $("card-pages").textContent = `${used} used`;
  $("card-pages-detail").textContent = `${counts.cached} cached · ${counts.free} free of ${view.pool.pages}`;
  bar("card-pages-bar", [[used / pages, "used"], [counts.cached / pages, "cached"]]);
  const c = view.counts;
  $("card-requests").textContent = `${c.running} running`;
  $("card-requests-detail").textContent = `${c.waiting} waiting · ${c.parked} parked · ${c.finished} done`;
  const parks = c.parks_swap + c.parks_recompute;
  $("card-parks").textContent = `${parks} park${parks === 1 ? "" : "s"}`;
  $("card-parks-detail").textContent =
    `${c.parks_swap} swap · ${c.parks_recompute} recompute · ${c.resumes} resumed · ${c.rotations} rotations`;
  const p = view.preempt;
  const budget = p.ram_budget;
  $("card-ram").textContent = formatBytes(p.ram_held);
  $("card-ram-detail").textContent = !p.enabled ? "preemption is off (--no-preempt)"
    : budget < 0 ? "held for parks · no limit (--preempt-ram -1)"
    : budget === 0 ? "every park recomputes (--preempt-ram 0)"
    : `held for parks of ${formatBytes(budget)} (--preempt-ram)`;
  bar("card-ram-bar", [[budget > 0 ? Math.min(1, p.ram_held / budget) : 0, "ram"]]);
}

// ------------------------------------------------------------------------------------ lists

const STATES = { prefill: "prefill", decode: "decode", replay: "replaying", waiting: "waiting",
  parked: "parked", parking: "parking", restoring: "restoring" };

function drawRequests(view) {
  const rows = view.requests.slice(0, 60).map((r) => el("tr", {},
    el("td", {}, chip(r.key)),
    el("td", { class: "mono", title: r.id, text: shortId(r.id) }),
    el("td", {}, el("span", { class: `state ${r.state}`, text: STATES[r.state] ?? r.state })),
    el("td", { class: "num", text: r.state === "waiting" ? `#${r.place}` : String(r.slot ?? "") }),
    el("td", { class: "num", text: `${r.prompt_tokens}${r.cached_tokens ? ` (${r.cached_tokens})` : ""}`,
      title: `${r.prompt_tokens} prompt tokens, ${r.cached_tokens} of them from the prefix cache` }),
    el("td", { class: "num", text: String(r.output_tokens) }),
    el("td", { class: "num", text: String(r.cells), title: `${r.cells} cells in ${r.pages} pages` }),
    el("td", { class: "num", text: r.parks ? `${r.parks}${r.recomputes ? ` (${r.recomputes} rec.)` : ""}` : "",
      title: `${r.parks - r.recomputes} swap, ${r.recomputes} recompute` })));
  if (view.requests.length > 60) {
    rows.push(el("tr", {}, el("td", { colspan: "8", class: "more", text: `and ${view.requests.length - 60} more` })));
  }
  $("requests-body").replaceChildren(...rows);
  $("requests-empty").hidden = view.requests.length > 0;
}

function drawParked(view, now) {
  const parked = view.requests.filter((r) => r.mode);
  const late = Math.max(0, now - view.time);
  $("parked-list").replaceChildren(...parked.map((r) => el("li", { class: "parked-item" },
    chip(r.key),
    el("span", { class: "mono", title: r.id, text: shortId(r.id) }),
    el("span", { class: `mode ${r.mode}`, text: r.mode }),
    el("span", { class: "bytes", text: r.mode === "swap" ? formatBytes(r.host_bytes) : "no host bytes" }),
    el("span", { class: "for", text: `${r.state === "parked" ? "parked" : r.state} ${formatSeconds(r.parked_s + late)}` }))));
  $("parked-empty").hidden = parked.length > 0;
}

// ------------------------------------------------------------------------------------ timeline

const LANES = [["park", "parks"], ["resume", "resumes"], ["rotation", "rotations"], ["evict", "evictions"]];

let span = 60; // seconds the timeline shows: one minute or five (the snapshot carries five)

for (const button of document.querySelectorAll(".span-choice button")) {
  button.addEventListener("click", () => {
    span = Number(button.dataset.span);
    for (const other of document.querySelectorAll(".span-choice button")) {
      other.setAttribute("aria-pressed", String(other === button));
    }
    if (lastView !== null) drawTimeline(lastView, Date.now() / 1000 + lastView.offset);
  });
}
let lastView = null;

function drawTimeline(view, now) {
  lastView = view;
  const canvas = $("timeline");
  const [ctx, width] = prepare(canvas, 150);
  const left = 84;
  const plot = width - left - 12;
  const lane = 28;
  const x = (t) => left + plot * (1 - (now - t) / span);
  ctx.font = "12px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  ctx.strokeStyle = cssVar("--line");
  ctx.fillStyle = cssVar("--muted");
  LANES.forEach(([, label], i) => {
    ctx.fillText(label, 0, 14 + i * lane);
    ctx.beginPath();
    ctx.moveTo(left, 14 + i * lane + 12);
    ctx.lineTo(left + plot, 14 + i * lane + 12);
    ctx.stroke();
  });
  const step = span / 5; // five ticks: every 12 s, or every minute
  for (let tick = 0; tick <= 5; tick += 1) {
    const at = left + plot * (1 - tick / 5);
    ctx.beginPath();
    ctx.moveTo(at, 0);
    ctx.lineTo(at, 4 * lane);
    ctx.stroke();
    const ago = tick * step;
    const label = tick === 0 ? "now" : ago >= 60 ? `−${ago / 60} min` : `−${ago} s`;
    ctx.fillText(label, Math.min(at - ctx.measureText(label).width / 2, width - ctx.measureText(label).width), 4 * lane + 16);
  }
  for (const entry of view.timeline) {
    const at = x(entry.time);
    if (at < left) continue;
    const i = LANES.findIndex(([kind]) => kind === entry.kind);
    if (i < 0) continue;
    mark(ctx, entry, at, 14 + i * lane);
  }
}

function mark(ctx, entry, x, y) {
  const recompute = entry.mode === "recompute";
  ctx.beginPath();
  if (entry.kind === "park") {
    ctx.fillStyle = cssVar(recompute ? "--recompute" : "--swap");
    ctx.moveTo(x - 5, y - 5); ctx.lineTo(x + 5, y - 5); ctx.lineTo(x, y + 5);
  } else if (entry.kind === "resume") {
    ctx.fillStyle = cssVar("--resume");
    ctx.moveTo(x - 5, y + 5); ctx.lineTo(x + 5, y + 5); ctx.lineTo(x, y - 5);
  } else if (entry.kind === "rotation") {
    ctx.fillStyle = cssVar("--rotate");
    ctx.moveTo(x, y - 6); ctx.lineTo(x + 5, y); ctx.lineTo(x, y + 6); ctx.lineTo(x - 5, y);
  } else {
    ctx.fillStyle = cssVar("--evict");
    const h = Math.min(20, 4 + 3 * Math.log2(1 + (entry.pages ?? 1)));
    ctx.rect(x - 1.5, y + 8 - h, 3, h);
  }
  ctx.fill();
}

function drawEvents(view) {
  const recent = view.timeline.slice(-40).reverse();
  $("events").replaceChildren(...recent.map((e) => {
    const when = new Date(e.time * 1000).toLocaleTimeString([], { hour12: false });
    const what = e.kind === "evict" ? `${e.pages} cached page${e.pages === 1 ? "" : "s"} evicted`
      : e.kind === "rotation" ? `${e.count ?? 1} rotation${(e.count ?? 1) === 1 ? "" : "s"}: a long-parked request takes its turn`
      : `${shortId(e.request ?? "")}${e.mode ? ` · ${e.mode}` : ""}${e.cells ? ` · ${e.cells} cells` : ""}`;
    return el("li", {}, el("time", { class: "mono", text: when }),
      el("span", { class: `kind ${e.kind} ${e.mode ?? ""}`, text: e.kind }),
      e.key ? chip(e.key) : null, el("span", { text: what }));
  }));
  $("events-empty").hidden = recent.length > 0;
}
