// learnmesh operations dashboard: polls /admin/summary with the stored admin key and
// draws live charts on <canvas> (no libraries, no build step).
"use strict";

const KEY_STORE = "learnmesh.adminKey";
const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(200, parseInt(params.get("poll") || "1000", 10) || 1000);
const HISTORY = 180; // points kept per series
const COLORS = { a: "#4fc3f7", b: "#ffb74d", c: "#81c784", d: "#e57373", e: "#ba68c8" };

const series = { rps: [], p50: [], p99: [], ratio: [], sync: [], loss: [] };
let polls = 0;
let timer = null;

const $ = (id) => document.getElementById(id);

function fmt(v, digits = 1) {
  if (v === null || v === undefined || v === "" || Number.isNaN(Number(v))) return "–";
  const n = Number(v);
  if (Math.abs(n) >= 1e9) return (n / 1e9).toFixed(1) + "G";
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + "k";
  if (Number.isInteger(n)) return String(n);
  return n.toFixed(digits);
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0; n = Number(n);
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + u[i];
}

function num(v) {
  if (v === null || v === undefined || v === "") return null;
  const n = Number(v);
  return Number.isFinite(n) ? n : null;
}

function push(name, t, v) {
  const s = series[name];
  s.push({ t, v: num(v) });
  if (s.length > HISTORY) s.shift();
}

// ------------------------------------------------------------------ charts
function drawChart(canvas, lines, opts = {}) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
  }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const pad = { l: 48, r: 10, t: 8, b: 20 };
  const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
  const pts = lines.flatMap((l) => l.data.filter((p) => p.v !== null));
  const now = Date.now();
  const span = HISTORY * POLL_MS;
  let max = Math.max(opts.min_max || 0, ...pts.map((p) => p.v));
  if (!Number.isFinite(max) || max <= 0) max = 1;
  max = niceCeil(max * 1.1);
  g.font = "11px system-ui, sans-serif";
  g.strokeStyle = "#26304a"; g.fillStyle = "#8391ad"; g.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = pad.t + ph - (ph * i) / 4;
    g.beginPath(); g.moveTo(pad.l, y); g.lineTo(pad.l + pw, y); g.stroke();
    g.textAlign = "right"; g.textBaseline = "middle";
    const tick = (max * i) / 4;
    g.fillText(fmt(tick, Number.isInteger(tick) ? 0 : (max < 10 ? 2 : 1)), pad.l - 6, y);
  }
  g.textAlign = "center"; g.textBaseline = "top";
  for (let i = 0; i <= 3; i++) {
    const x = pad.l + (pw * i) / 3;
    const ago = Math.round((span * (3 - i)) / 3 / 1000);
    g.fillText(ago ? `-${ago}s` : "now", x, pad.t + ph + 4);
  }
  if (!pts.length) {
    g.textAlign = "center"; g.textBaseline = "middle";
    g.fillText("no data yet", pad.l + pw / 2, pad.t + ph / 2);
  }
  let lx = pad.l + 8;
  for (const line of lines) {
    g.strokeStyle = line.color; g.lineWidth = 2; g.beginPath();
    let started = false;
    for (const p of line.data) {
      if (p.v === null) { started = false; continue; }
      const x = pad.l + pw - ((now - p.t) / span) * pw;
      const y = pad.t + ph - (p.v / max) * ph;
      if (x < pad.l) continue;
      if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; }
    }
    g.stroke();
    const last = [...line.data].reverse().find((p) => p.v !== null);
    g.fillStyle = line.color; g.textAlign = "left"; g.textBaseline = "top";
    const label = `${line.label} ${last ? fmt(last.v, 2) : "–"}`;
    g.fillText(label, lx, pad.t + 2);
    lx += g.measureText(label).width + 14;
  }
}

function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function drawAll() {
  drawChart($("chart-rps"), [{ label: "req/s", color: COLORS.a, data: series.rps }]);
  drawChart($("chart-latency"), [{ label: "p50", color: COLORS.c, data: series.p50 },
                                 { label: "p99", color: COLORS.d, data: series.p99 }]);
  drawChart($("chart-ratio"), [{ label: "ratio", color: COLORS.e, data: series.ratio }]);
  drawChart($("chart-sync"), [{ label: "ms", color: COLORS.b, data: series.sync }]);
  drawChart($("chart-loss"), [{ label: "loss", color: COLORS.c, data: series.loss }]);
}

// ------------------------------------------------------------------ tables
function fillTable(id, rows, cells, empty) {
  const body = $(id).tBodies[0];
  const frag = document.createDocumentFragment();
  if (!rows.length) {
    const tr = document.createElement("tr"); const td = document.createElement("td");
    td.colSpan = $(id).tHead.rows[0].cells.length; td.className = "empty"; td.textContent = empty;
    tr.appendChild(td); frag.appendChild(tr);
  }
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const c of cells(row)) {
      const td = document.createElement("td");
      if (typeof c === "object" && c !== null) { td.textContent = c.text; if (c.cls) td.className = c.cls; }
      else td.textContent = c;
      tr.appendChild(td);
    }
    frag.appendChild(tr);
  }
  body.replaceChildren(frag);
}

// A listing read from every Redis master says which did not answer (shared/redis_client.py Reach).
function partialNote(listing) {
  const lost = (listing || {}).unreachable || [];
  return listing && listing.partial ? `partial: ${lost.length} Redis master${lost.length === 1 ? "" : "s"} not answering (${lost.map((u) => u.node).join(", ")})` : "";
}

// An upstream's breakers over the live replicas: each replica keeps its own (gateway/proxy/health.py).
function breakers(m) {
  const n = `${m.replicas} replica${m.replicas === 1 ? "" : "s"}`;
  if (m.open > 0) return `open on ${m.open} of ${n}` + (m.half_open > 0 ? `, half-open on ${m.half_open}` : "");
  if (m.half_open > 0) return `half-open on ${m.half_open} of ${n}`;
  return `closed on ${n}`;
}

// What a worker does for callers now: the pool's own flags first (a worker that still reports
// may be benched, refusing our key, or stopping), then whether it answers at all.
function workerState(w) {
  if (w.drained) return { text: "drained", cls: "drained" };
  if (w.alive === false) return { text: "down", cls: "lag-bad" };
  if (w.handshake_failing) return { text: "key refused", cls: "lag-bad" };
  if (w.leaving) return { text: "stopping", cls: "drained" };
  if (w.benched) return { text: "benched", cls: "lag-bad" };
  return { text: "serving", cls: "" };
}

function render(s) {
  const t = Date.now();
  const gw = s.gateway || {}, tr = s.trainer || {}, sync = s.sync || {};
  push("rps", t, gw.rps); push("p50", t, gw.p50_ms); push("p99", t, gw.p99_ms);
  push("ratio", t, sync.compression_ratio); push("sync", t, sync.sync_latency_ms); push("loss", t, tr.loss);
  $("rps").textContent = fmt(gw.rps);
  $("p50").textContent = fmt(gw.p50_ms, 2);
  $("p99").textContent = fmt(gw.p99_ms, 2);
  $("requests-total").textContent = fmt(gw.requests_total);
  $("ratio").textContent = fmt(sync.compression_ratio);
  $("sync").textContent = fmt(sync.sync_latency_ms);
  $("loss").textContent = fmt(tr.loss, 4);
  $("step").textContent = fmt(tr.step);
  $("sps").textContent = fmt(tr.samples_per_s ?? tr.samples_per_sec ?? tr.sps);
  $("trainer-state").textContent = tr.paused ? "trainer paused" : (tr.alive ? "trainer running" : "trainer not reporting");
  $("backlog").textContent = fmt((s.samples || {}).backlog);
  $("version").textContent = fmt(s.model_version);
  $("replicas").textContent = fmt(gw.replicas);
  $("who").textContent = s.who ? `${s.who.name} (${s.who.role})` : "";
  fillTable("workers", s.workers || [], (w) => [
    w.id, fmt(w.version),
    { text: fmt(w.lag), cls: (w.lag || 0) > 0 ? "lag-bad" : "" }, fmt(w.load),
    workerState(w),
  ], "no workers reporting");
  fillTable("sessions", ((s.sessions || {}).shown) || [], (x) => [
    x.id.slice(0, 8) + "…", x.principal, x.protocol_version || "–", fmt(x.events),
    x.ttl_s === null ? "–" : `${fmt(x.ttl_s, 0)} s`,
  ], "no legacy sessions");
  $("sessions-partial").textContent = partialNote(s.sessions);
  fillTable("upstreams", s.upstreams || [], (u) => {
    const m = u.mesh;
    return [
      u.enabled ? u.name : u.name + " (disabled)", u.revision,
      { text: breakers(m), cls: m.open + m.half_open > 0 ? "lag-bad" : "" }, fmt(m.calls, 0), fmt(m.errors, 0),
    ];
  }, "no upstream MCP servers");
  const ctx = s.contexts || {};
  $("ctx-bytes").textContent = ctx.global_bytes !== undefined
    ? `${bytes(ctx.global_bytes)} of ${bytes(ctx.global_budget_bytes)} · ${fmt(ctx.principals)} principals` : "";
  fillTable("contexts", ctx.recent || [], (c) => [c.principal, c.id, fmt(c.version), fmt(c.entries), bytes(c.bytes)],
            "no contexts");
  $("contexts-partial").textContent = partialNote(ctx);
  // parts whose Redis master did not answer (a cluster with a master down): shown as unknown
  const missing = s.unavailable || [];
  $("unavailable").textContent = missing.length ? `not read (a Redis master is down): ${missing.join(", ")}` : "";
  drawAll();
  polls += 1;
  document.body.dataset.polls = String(polls);
  $("updated").textContent = new Date(s.ts_ms || t).toLocaleTimeString();
}

// ------------------------------------------------------------------ polling and the key
function setConn(state, text) {
  const el = $("conn");
  el.className = "pill pill-" + state; el.textContent = text;
}

function askKey(message) {
  if (timer) { clearTimeout(timer); timer = null; }
  setConn("bad", "signed out");
  $("login-error").textContent = message || "";
  const d = $("login");
  if (!d.open) d.showModal();
  $("key").focus();
}

async function poll() {
  timer = null;
  const key = localStorage.getItem(KEY_STORE);
  if (!key) { askKey(); return; }
  try {
    const resp = await fetch("/admin/summary", { headers: { Authorization: "Bearer " + key }, cache: "no-store" });
    if (resp.status === 401 || resp.status === 403) {
      localStorage.removeItem(KEY_STORE);
      askKey(resp.status === 401 ? "That key was not accepted." : "That key may not view the dashboard.");
      return;
    }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    render(await resp.json());
    setConn("ok", "live");
  } catch (err) {
    setConn("wait", "retrying (" + err.message + ")");
  }
  timer = setTimeout(poll, POLL_MS);
}

$("login-form").addEventListener("submit", (ev) => {
  const key = $("key").value.trim();
  if (!key) { ev.preventDefault(); return; }
  localStorage.setItem(KEY_STORE, key);
  $("key").value = "";
  setConn("wait", "connecting");
  if (!timer) poll();
});
$("logout").addEventListener("click", () => { localStorage.removeItem(KEY_STORE); askKey(); });
window.addEventListener("resize", drawAll);
$("poll-ms").textContent = String(POLL_MS);
poll();
