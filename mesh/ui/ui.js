// meshpipe's page: reads /ui/events (a snapshot a second, mesh/snapshot.py) and draws it.
// The stream is read with fetch(), not EventSource, so that it can carry the API key in an
// Authorization header; the key lives in this tab's sessionStorage only. Every value from
// the server goes into the page as text (textContent), never as markup.
"use strict";

const KEY = "meshpipe-api-key";
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child);
  return node;
}

const pct = (x) => (x == null ? "–" : (100 * x).toFixed(0) + "%");
const ms = (x) => (x == null ? "–" : x.toFixed(1) + " ms");
function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}
const when = (t) => new Date(t * 1000).toLocaleTimeString();
function count(n) {
  for (const [unit, size] of [["T", 1e12], ["B", 1e9], ["M", 1e6], ["K", 1e3]]) {
    if (n >= size) return (n / size).toFixed(n >= 100 * size ? 0 : 1) + unit;
  }
  return n.toFixed(0);
}
// a mixture of experts holds all its parameters and multiplies the active ones: "1.2B (active 0.3B)"
function params(s) {
  if (s.parameters == null) return "–";
  const all = count(s.parameters);
  return s.active_parameters == null || s.active_parameters >= s.parameters ? all
    : `${all} (active ${count(s.active_parameters)})`;
}

function layerBar(s, layers) {
  const bar = el("svg:svg", { class: "bar", viewBox: `0 0 ${layers} 1`, preserveAspectRatio: "none" },
    el("svg:rect", { class: "all", x: 0, y: 0, width: layers, height: 1 }));
  if (s.start != null) bar.append(el("svg:rect", { class: "own", x: s.start, y: 0, width: s.end - s.start, height: 1 }));
  return bar;
}

function row(label, value) {
  return el("div", { class: "row" }, label, el("b", {}, value));
}

function stageCard(s, layers, bottleneck) {
  const card = el("div", { class: `stage ${s.state}${bottleneck ? " bottleneck" : ""}`, "data-stage": s.stage },
    el("div", { class: "head" }, el("span", {}, `stage ${s.stage}`), el("span", { class: "state" }, s.state)),
    el("div", { class: "endpoint" }, s.endpoint),
    row("engine", el("span", { class: "engine" }, s.engine || "?")),
    row("layers", el("span", { class: "layers" }, `[${s.start},${s.end})`)),
    layerBar(s, layers),
    row("parameters", el("span", { class: "params" }, params(s))),
    row("memory used", bytes(s.rss_bytes)),
    row("memory free", bytes(s.mem_available_bytes)),
    row("busy", el("span", { class: "busy" }, pct(s.busy))),
    row("per frame", ms(s.frame_ms)));
  if (s.claims && s.claims.length > 1) {  // coordinators sharing the stage (DESIGN.md §4)
    const lanes = s.claims.map((c) => `${c.lanes_in_use}/${c.lanes}${c.this ? " (this)" : ""}`).join(" + ");
    card.append(row("shared", el("span", { class: "claims" }, `${s.claims.length} coordinators, lanes ${lanes}`)));
  }
  if (s.kv_tier) {  // sequences evicted from lanes, kept to come back (DESIGN.md §2, "KV tier")
    const t = s.kv_tier;
    const disk = t.disk_limit ? ` + ${bytes(t.disk_bytes)} disk` : "";
    card.append(row("KV tier", el("span", { class: "kv-tier" },
      `${bytes(t.ram_bytes)}${disk}, ${t.hits} hits, ${t.misses} misses`)));
  }
  if (s.replaced) card.append(el("span", { class: "replaced" }, `replaced ${s.replaced}`));
  if (bottleneck) card.append(el("span", { class: "replaced" }, "bottleneck: the busiest stage"));
  return card;
}

function linkArrow(link) {
  return el("div", { class: "link", "data-to": link.to },
    el("svg:svg", { viewBox: "0 0 80 12" }, el("svg:line", { x1: 0, y1: 6, x2: 70, y2: 6 }),
      el("svg:polygon", { points: "70,1 80,6 70,11" })),
    el("div", {}, link.bytes_per_s == null ? "–" : bytes(link.bytes_per_s) + "/s"),
    el("div", { class: "ping" }, link.round_trip_ms == null ? "" : "rtt " + link.round_trip_ms.toFixed(1) + " ms"));
}

function renderTopology(snap) {
  const busiest = Math.max(...snap.stages.map((s) => s.busy || 0));
  const parts = [];
  snap.stages.forEach((s, i) => {
    if (i > 0 && snap.links[i - 1]) parts.push(linkArrow(snap.links[i - 1]));
    parts.push(stageCard(s, snap.layers, busiest > 0.05 && s.busy === busiest && snap.stages.length > 1));
  });
  $("stages").replaceChildren(...parts);
  const inRoute = new Set(snap.stages.map((s) => s.endpoint));
  $("spares").replaceChildren(...(snap.spares.length ? ["spares: "] : []), ...snap.spares.map((e) =>
    el("span", { class: "spare" }, e + (inRoute.has(e) ? " (serving)" : " (standby)"))));
}

function renderSpeculation(spec) {
  $("plan").textContent = spec.plan;
  $("tok-s").textContent = spec.tok_s.toFixed(1);
  $("ttft").textContent = spec.ttft_s == null ? "–" : (spec.ttft_s * 1000).toFixed(0) + " ms";
  $("in-flight").textContent = spec.frames_in_flight;
  $("stale").textContent = pct(spec.stale);
  $("round-trip").textContent = ms(spec.round_trip_ms);
  $("wire").textContent = ms(spec.wire_ms);
  $("proposers").tBodies[0].replaceChildren(...spec.proposers.map((p) =>
    el("tr", { "data-proposer": p.name }, el("td", {}, p.name), el("td", { class: "accept" }, pct(p.accept_rate)),
      el("td", {}, p.mean_window.toFixed(2)), el("td", {}, String(p.proposed)),
      el("td", { class: "choice" }, p.choice ?? "—"))));
}

function renderChart(history) {
  const n = history.length;
  const top = Math.max(1, ...history.map((p) => p.tok_s));
  const x = (i) => (n > 1 ? (360 * i) / (n - 1) : 0);
  $("chart-tok").setAttribute("points", history.map((p, i) => `${x(i)},${88 - (84 * p.tok_s) / top}`).join(" "));
  // acceptance is known only for seconds in which windows settled: a gap breaks the line
  let path = "";
  history.forEach((p, i) => {
    if (p.accept == null) return;
    const at = `${x(i)},${88 - 84 * p.accept}`;
    path += i && history[i - 1].accept != null ? `L${at} ` : `M${at} L${at} `;  // a lone second: a dot
  });
  $("chart-acc").setAttribute("d", path);
  $("chart-max").textContent = top.toFixed(0);
}

function renderRequests(r) {
  $("generating").textContent = r.generating;
  $("queued").textContent = r.queued;
  $("lanes").textContent = `${r.lanes_used} / ${r.lanes}`;
  $("prefix-hit").textContent = pct(r.prefix_hit);
}

function renderHealing(h) {
  const state = $("heal-state");
  state.className = h.ok ? "ok" : "bad";
  state.textContent = h.ok
    ? `serving: ${h.recoveries} recoveries, ${h.sessions_resumed} sessions resumed`
    : `recovering${h.broken_for_s == null ? "" : ` for ${h.broken_for_s.toFixed(0)} s`}: ${h.broken}`;
  $("timeline").replaceChildren(...h.timeline.slice().reverse().map((r) => el("li", { class: "recovery" },
    el("div", { class: "cause" }, r.cause),
    el("div", { class: "when" }, `${when(r.at)}: noticed after ${r.detect_s.toFixed(1)} s, serving again after ` +
      `${r.resume_s.toFixed(1)} s` + r.replaced.map(([gone, now]) => `; ${gone} → ${now || "(left out)"}`).join("")))));
}

function render(snap) {
  $("model").textContent = `${snap.model}, ${snap.layers} layers`;
  renderTopology(snap);
  renderSpeculation(snap.speculation);
  renderChart(snap.history);
  renderRequests(snap.requests);
  renderHealing(snap.healing);
  $("main").hidden = false;
  document.body.dataset.updated = String(snap.at);  // tests wait on this
}

function status(text, kind) {
  $("conn").textContent = text;
  $("conn").className = "conn " + kind;
}

async function read(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) render(JSON.parse(line.slice(6)));
    }
  }
}

function askKey(wrong) {
  status(wrong ? "the key was refused" : "API key needed", "down");
  $("key-form").hidden = false;
  $("key-input").focus();
}

async function connect() {
  const key = sessionStorage.getItem(KEY);
  const headers = key ? { Authorization: "Bearer " + key } : {};
  try {
    const response = await fetch("/ui/events", { headers, cache: "no-store" });
    if (response.status === 401) return askKey(Boolean(key));
    if (!response.ok) throw new Error("HTTP " + response.status);
    $("key-form").hidden = true;
    status("live", "live");
    await read(response);
    status("stream ended: reconnecting", "down");
  } catch (err) {
    status(`disconnected (${err.message}): reconnecting`, "down");
  }
  setTimeout(connect, 1000);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key-input").value.trim());
  $("key-input").value = "";
  connect();
});
connect();
