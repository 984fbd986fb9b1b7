// The collector's dashboard page. It reads the JSON API (/api/v1) and /metrics with the signed-in token, exactly as
// any client would, so the API's roles decide what it may see and do. All text from the API goes into the page
// through textContent (h() below), never as HTML: run names, hosts and event values come from agents.
"use strict";

const TOKEN_KEY = "attnchecker.token"; // sessionStorage: gone when the browser session ends
const POLL_MS = 2000;
const EVENT_PAGE = 1000; // the API's largest page
const EVENT_PAGES = 5; // the chart shows at most this many pages of a run's events
const RECENT_EVENTS = 50;
const KNOWN_OPS = ["q", "k", "v", "scores", "context", "out"];
const KIND_COLOURS = { inf: "#d32f2f", neg_inf: "#7b1fa2", nan: "#ef6c00", near_inf: "#f9a825", silent: "#1976d2" };
const OTHER_COLOUR = "#607d8b";
const POLICY_FIELDS = [
  { name: "mode", label: "Mode", type: "select", options: ["off", "detect", "correct"] },
  { name: "period", label: "Period (steps)", type: "int", min: 1 },
  { name: "tolerance", label: "Tolerance", type: "select", options: ["roundoff", "extreme"] },
  { name: "tolerance_factor", label: "Tolerance factor", type: "float", min: 0 },
  { name: "overhead_budget", label: "Overhead budget", type: "float", min: 0, max: 1 },
];

const state = {
  token: sessionStorage.getItem(TOKEN_KEY),
  open: false, // the collector answered reads without a token (ATTNCHECKER_OPEN_READS)
  canEdit: null, // per run id: may this session change the run's policy? (asked once per run)
  timer: null,
  view: 0, // bumped on every navigation so a slow answer never draws into the next page
};

// --- DOM -----------------------------------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) el.setAttribute(key, String(value));
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function main() {
  return document.getElementById("main");
}

function show(...nodes) {
  main().replaceChildren(...nodes);
}

// --- values from the API, read defensively (fields may be missing, null, or new) -----------------------------------

function num(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}

function fmtNum(value) {
  const n = num(value);
  return n === null ? "–" : n.toLocaleString("en-US");
}

function fmtVersion(value) {
  const n = num(value);
  return n === null ? "–" : `v${n}`;
}

function fmtAgo(iso) {
  const t = Date.parse(iso);
  if (!Number.isFinite(t)) return "–";
  const seconds = Math.max(0, Math.round((Date.now() - t) / 1000));
  if (seconds < 60) return `${seconds} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return new Date(t).toISOString().slice(0, 16).replace("T", " ");
}

function fmtTime(iso) {
  const t = Date.parse(iso);
  return Number.isFinite(t) ? new Date(t).toISOString().replace("T", " ").slice(0, 19) : "–";
}

function fmtPercent(ratio) {
  return ratio === null ? "–" : `${(100 * ratio).toFixed(ratio < 0.01 ? 2 : 1)} %`;
}

// An event's value travels as a string (JSON has no INF/NaN); long finite ones are shortened, the title keeps all.
function fmtValue(value) {
  const n = typeof value === "string" && value.trim() !== "" ? Number(value) : NaN;
  return Number.isFinite(n) && value.length > 10 ? n.toPrecision(4) : short(value);
}

function label(key) {
  return String(key).replace(/_/g, " ");
}

function short(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number" && (!Number.isInteger(value) || Math.abs(value) >= 1e9)) return value.toPrecision(4);
  if (typeof value === "object") {
    const text = JSON.stringify(value);
    return text.length > 120 ? text.slice(0, 117) + "…" : text;
  }
  return String(value);
}

// --- the API ---------------------------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

function detailOf(body, status) {
  if (body && typeof body.message === "string") return body.message;
  if (body && typeof body.detail === "string") return body.detail;
  return `HTTP ${status}`;
}

async function request(method, path, { body, headers, token = state.token } = {}) {
  const all = { Accept: "application/json", ...(headers || {}) };
  if (token) all.Authorization = `Bearer ${token}`;
  if (body !== undefined) all["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers: all,
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store",
    credentials: "omit",
  });
  const text = await response.text();
  let json = null;
  try {
    json = text ? JSON.parse(text) : null;
  } catch (_) {
    json = null;
  }
  return { status: response.status, ok: response.ok, json, text, etag: response.headers.get("ETag") };
}

async function get(path) {
  const r = await request("GET", path);
  if (r.status === 401) {
    signOut("Your token is no longer accepted; sign in again.");
    throw new ApiError(401, detailOf(r.json, r.status));
  }
  if (!r.ok) throw new ApiError(r.status, detailOf(r.json, r.status));
  return r;
}

// --- sign-in ---------------------------------------------------------------------------------------------------------

async function probe(token) {
  return request("GET", "/api/v1/runs?limit=1", { token });
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = null;
  state.canEdit = null;
  stopPolling();
  renderSignIn(message);
}

function renderSession() {
  const session = document.getElementById("session");
  const button = document.getElementById("signout");
  if (state.token) {
    session.textContent = "signed in with a token";
    button.textContent = "Sign out";
    button.hidden = false;
  } else if (state.open) {
    // Anyone may read here; an operator still signs in to change policies.
    session.textContent = "open reads: read-only without a token";
    button.textContent = "Sign in";
    button.hidden = false;
  } else {
    session.textContent = "";
    button.hidden = true;
  }
}

function renderSignIn(message) {
  state.view += 1;
  renderSession();
  const error = h("p", { class: "error", id: "signin-error", role: "alert" }, message || "");
  const input = h("input", { id: "token", name: "token", type: "password", autocomplete: "off", spellcheck: "false" });
  const form = h(
    "form",
    { class: "card signin", id: "signin" },
    h("h1", {}, "Sign in"),
    h("p", { class: "muted" }, "A viewer or operator token from ", h("code", {}, "attnchecker-server token create"),
      ". It is kept for this browser session only."),
    h("label", { for: "token" }, "Token"),
    input,
    h("button", { type: "submit" }, "Sign in"),
    error,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const token = input.value.trim();
    if (!token) {
      error.textContent = "Paste a token first.";
      return;
    }
    const r = await probe(token);
    if (r.status === 200) {
      sessionStorage.setItem(TOKEN_KEY, token);
      state.token = token;
      state.canEdit = null;
      route();
    } else {
      error.textContent = detailOf(r.json, r.status);
    }
  });
  show(form);
  input.focus();
}

async function boot() {
  document.getElementById("signout").addEventListener("click", () => {
    if (state.token) signOut("Signed out.");
    else {
      stopPolling();
      renderSignIn();
    }
  });
  window.addEventListener("hashchange", route);
  if (state.token) {
    const r = await probe(state.token);
    if (r.status !== 200) return signOut(detailOf(r.json, r.status));
  } else {
    const r = await probe(null);
    state.open = r.status === 200;
    if (!state.open) return renderSignIn();
  }
  route();
}

// --- routing and polling ---------------------------------------------------------------------------------------------

function stopPolling() {
  if (state.timer !== null) clearTimeout(state.timer);
  state.timer = null;
}

function route() {
  stopPolling();
  state.view += 1;
  renderSession();
  if (!state.token && !state.open) return renderSignIn();
  const match = /^#\/runs\/([^/?#]+)$/.exec(location.hash);
  let runId = null;
  try {
    runId = match ? decodeURIComponent(match[1]) : null;
  } catch (_) {
    runId = null; // a mangled address: show the runs instead
  }
  if (runId) runPage(runId, state.view);
  else runsPage(state.view);
}

// Calls refresh() now and every POLL_MS while the page is still the one that started it.
function poll(view, refresh) {
  const tick = async () => {
    if (view !== state.view) return;
    try {
      await refresh();
    } catch (err) {
      if (view === state.view && !(err instanceof ApiError && err.status === 401)) {
        const box = document.getElementById("poll-error");
        if (box) box.textContent = `Could not refresh: ${err.message}`;
      }
    }
    if (view === state.view) state.timer = setTimeout(tick, POLL_MS);
  };
  tick();
}

// --- the runs table ----------------------------------------------------------------------------------------------------

function runsPage(view) {
  const body = h("tbody", { id: "runs-body" });
  const table = h(
    "table",
    { id: "runs" },
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        h("th", {}, "Name"),
        h("th", {}, "Status"),
        h("th", {}, "Model"),
        h("th", { class: "num" }, "Ranks"),
        h("th", { class: "num" }, "Last step"),
        h("th", { class: "num" }, "Detected"),
        h("th", { class: "num" }, "Corrected"),
        h("th", { class: "num" }, "Uncorrectable"),
        h("th", {}, "Policy requested / applied"),
        h("th", {}, "Last seen"),
      ),
    ),
    body,
  );
  const count = h("span", { class: "muted", id: "runs-count" });
  show(
    h("div", { class: "row" }, h("h1", {}, "Runs"), count),
    h("p", { class: "error", id: "poll-error" }),
    h("div", { class: "card scroll" }, table),
  );
  poll(view, async () => {
    const { json } = await get("/api/v1/runs?limit=200");
    if (view !== state.view) return;
    const runs = Array.isArray(json && json.data) ? json.data : [];
    count.textContent = `${runs.length}${json && json.next_cursor ? "+" : ""} run(s), newest first; updates live`;
    body.replaceChildren(...(runs.length ? runs.map(runRow) : [h("tr", {}, h("td", { colspan: 10, class: "muted" },
      "No runs yet. Attach the agent with attnchecker.protect(model, collector=…) and a run appears here."))]));
    document.getElementById("poll-error").textContent = "";
  });
}

function policyVersions(run) {
  const requested = num(run.requested_policy_version);
  const applied = num(run.applied_policy_version);
  const lag = requested !== null && applied !== requested;
  return h("span", { class: lag ? "badge lag" : "badge", title: lag ? "the agent has not applied the newest version yet" : "" },
    `${fmtVersion(requested)} / ${fmtVersion(applied)}`);
}

function runRow(run) {
  const totals = run.totals || {};
  const bad = (num(totals.uncorrectable) || 0) > 0;
  const id = String(run.id ?? "");
  return h(
    "tr",
    { class: bad ? "bad" : null, dataset: { runId: id } },
    h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(id)}` }, run.name ?? id)),
    h("td", {}, h("span", { class: `badge ${run.status === "running" ? "running" : "finished"}` }, run.status ?? "?")),
    h("td", {}, run.model ?? "–"),
    h("td", { class: "num" }, fmtNum(run.world_size)),
    h("td", { class: "num" }, fmtNum(run.last_step)),
    h("td", { class: "num" }, fmtNum(totals.detected)),
    h("td", { class: "num" }, fmtNum(totals.corrected)),
    h("td", { class: "num" }, bad ? h("span", { class: "badge bad" }, fmtNum(totals.uncorrectable)) : fmtNum(totals.uncorrectable)),
    h("td", {}, policyVersions(run)),
    h("td", { title: fmtTime(run.last_seen_at) }, fmtAgo(run.last_seen_at)),
  );
}

// --- one run -------------------------------------------------------------------------------------------------------------

async function fetchEvents(runId) {
  const events = [];
  let cursor = null;
  for (let page = 0; page < EVENT_PAGES; page += 1) {
    const params = new URLSearchParams({ limit: String(EVENT_PAGE) });
    if (cursor) params.set("cursor", cursor);
    const { json } = await get(`/api/v1/runs/${encodeURIComponent(runId)}/events?${params}`);
    if (Array.isArray(json && json.data)) events.push(...json.data);
    cursor = json && json.next_cursor;
    if (!cursor) return { events, truncated: false };
  }
  return { events, truncated: true };
}

// Prometheus text format -> [{name, labels, value}]; only what this page reads (no exemplars, no timestamps).
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
    let lm;
    while ((lm = re.exec(m[3] || "")) !== null) {
      labels[lm[1]] = lm[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    samples.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return samples;
}

async function fetchRunMetrics(runName) {
  const r = await request("GET", "/metrics", { headers: { Accept: "text/plain" } });
  if (!r.ok) return null;
  return parseMetrics(r.text).filter((sample) => sample.labels.run === runName);
}

function metricValue(samples, name) {
  const found = samples.find((sample) => sample.name === name);
  return found ? num(found.value) : null;
}

function runPage(runId, view) {
  const api = `/api/v1/runs/${encodeURIComponent(runId)}`;
  const parts = {
    title: h("h1", { id: "run-name" }, "…"),
    meta: h("div", { class: "row muted", id: "run-meta" }),
    counts: h("div", { class: "counts", id: "counts" }),
    chart: h("div", { class: "chart", id: "timeline" }),
    overhead: h("div", { id: "overhead" }),
    periods: h("div", { id: "periods" }),
    coverage: h("div", { class: "card", id: "coverage", hidden: true }),
    events: h("div", { class: "scroll", id: "events" }),
    history: h("div", { class: "scroll", id: "history" }),
    editor: h("div", { id: "policy-editor" }),
  };
  show(
    h("p", {}, h("a", { href: "#/" }, "← all runs")),
    parts.title,
    parts.meta,
    h("p", { class: "error", id: "poll-error" }),
    parts.counts,
    h("div", { class: "card" }, h("h2", {}, "Fault timeline by op and kind"), parts.chart),
    h(
      "div",
      { class: "grid" },
      h("div", { class: "card" }, h("h2", {}, "Check overhead against the budget"), parts.overhead),
      h("div", { class: "card" }, h("h2", {}, "Checks and current period per op"), parts.periods),
    ),
    parts.coverage,
    h(
      "div",
      { class: "grid" },
      h("div", { class: "card" }, h("h2", {}, "Policy"), parts.editor),
      h("div", { class: "card" }, h("h2", {}, "Policy history"), parts.history),
    ),
    h("div", { class: "card" }, h("h2", {}, "Recent events"), parts.events),
  );
  const editor = policyEditor(runId, api, view, parts.editor);
  poll(view, async () => {
    const [runR, eventsR, historyR] = await Promise.all([get(api), fetchEvents(runId), get(`${api}/policy/history`)]);
    const run = runR.json || {};
    const samples = await fetchRunMetrics(run.name);
    if (view !== state.view) return;
    document.title = `${run.name ?? runId} · ATTNChecker`;
    renderRunHeader(parts, run);
    renderCounts(parts.counts, run.totals);
    renderTimeline(parts.chart, eventsR.events, eventsR.truncated, run.last_step);
    renderOverhead(parts.overhead, samples);
    renderPeriods(parts.periods, samples);
    renderCoverage(parts.coverage, run);
    renderEvents(parts.events, eventsR.events);
    renderHistory(parts.history, historyR.json);
    editor.update(run);
    document.getElementById("poll-error").textContent = "";
  });
}

function renderRunHeader(parts, run) {
  parts.title.textContent = run.name ?? run.id ?? "run";
  parts.meta.replaceChildren(
    h("span", { class: `badge ${run.status === "running" ? "running" : "finished"}`, id: "run-status" }, run.status ?? "?"),
    h("span", {}, `model ${run.model ?? "–"}`),
    h("span", {}, `host ${run.host ?? "–"}`),
    h("span", {}, `ranks ${fmtNum(run.world_size)}`),
    h("span", { id: "run-last-step" }, `last step ${fmtNum(run.last_step)}`),
    h("span", { title: fmtTime(run.last_seen_at) }, `last seen ${fmtAgo(run.last_seen_at)}`),
    h("span", { id: "run-policy" }, "policy requested / applied ", policyVersions(run)),
  );
}

function renderCounts(box, totals) {
  const known = ["checks", "detected", "corrected", "uncorrectable"];
  const values = totals && typeof totals === "object" ? totals : {};
  // Fields added later (tripwire tier counts, …) show up as further cards, as long as they are numbers.
  const keys = [...known, ...Object.keys(values).filter((key) => !known.includes(key) && num(values[key]) !== null)];
  box.replaceChildren(
    ...keys.map((key) => {
      const bad = key === "uncorrectable" && (num(values[key]) || 0) > 0;
      return h("div", { class: bad ? "count bad" : "count", dataset: { count: key } },
        h("div", { class: "value" }, fmtNum(values[key])), h("div", { class: "label" }, label(key)));
    }),
  );
}

function renderTimeline(box, events, truncated, lastStep) {
  if (!events.length) {
    box.replaceChildren(h("p", { class: "muted", id: "timeline-empty" }, "No fault events yet."));
    return;
  }
  const ops = [...KNOWN_OPS, ...new Set(events.map((e) => String(e.op)).filter((op) => !KNOWN_OPS.includes(op)))];
  const kinds = [...new Set(events.map((e) => String(e.kind)))].sort();
  const steps = events.map((e) => num(e.step) ?? 0);
  // The axis runs to the run's last step, so a quiet stretch after the faults shows as such.
  const first = Math.min(...steps);
  const last = Math.max(first + 1, num(lastStep) ?? 0, ...steps);
  const pad = Math.max(0.5, (last - first) * 0.02);
  const lo = first - pad;
  const hi = last + pad;
  const width = 1000;
  const lane = 26;
  const left = 70;
  const right = 16;
  const top = 10;
  const height = top + lane * ops.length + 30;
  const x = (step) => left + ((step - lo) / (hi - lo)) * (width - left - right);
  const y = (op, kind) => top + lane * ops.indexOf(op) + lane / 2 + (kinds.indexOf(kind) - (kinds.length - 1) / 2) * 3;
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "fault timeline" });
  ops.forEach((op, i) => {
    const yy = top + lane * i;
    svg.append(
      s("rect", { x: left, y: yy, width: width - left - right, height: lane, fill: i % 2 ? "#f7f8fb" : "#ffffff" }),
      s("text", { x: left - 8, y: yy + lane / 2 + 4, "text-anchor": "end", "font-size": 12, fill: "#6b7385" }, op),
    );
  });
  const ticks = 6;
  for (let i = 0; i <= ticks; i += 1) {
    const step = Math.round(first + ((last - first) * i) / ticks);
    if (i > 0 && step === Math.round(first + ((last - first) * (i - 1)) / ticks)) continue;
    svg.append(
      s("line", { x1: x(step), x2: x(step), y1: top, y2: top + lane * ops.length, stroke: "#e3e6ec" }),
      s("text", { x: x(step), y: height - 12, "text-anchor": "middle", "font-size": 11, fill: "#6b7385" }, step),
    );
  }
  svg.append(s("text", { x: width - right, y: height - 1, "text-anchor": "end", "font-size": 11, fill: "#6b7385" }, "step"));
  for (const e of events) {
    const kind = String(e.kind);
    const uncorrectable = e.action === "uncorrectable";
    const dot = s(
      "circle",
      {
        cx: x(num(e.step) ?? 0),
        cy: y(String(e.op), kind),
        r: uncorrectable ? 6 : 4,
        fill: KIND_COLOURS[kind] || OTHER_COLOUR,
        "fill-opacity": 0.85,
        stroke: uncorrectable ? "#000" : "none",
        "stroke-width": uncorrectable ? 2 : 0,
        class: uncorrectable ? "fault uncorrectable" : "fault",
      },
      s("title", {}, `step ${e.step} · layer ${e.layer} · ${e.op} · ${kind} · ${e.action}`),
    );
    svg.append(dot);
  }
  const legend = h(
    "div",
    { class: "legend" },
    kinds.map((kind) => h("span", {}, h("i", { dataset: { kind } }), kind)),
    h("span", {}, "● with a black ring: uncorrectable"),
    h("span", { class: "muted" }, `${events.length} event(s)${truncated ? ` (the first ${events.length} only)` : ""}`),
  );
  // Colours set through the DOM, not inline style attributes (the page's CSP allows no inline styles).
  legend.querySelectorAll("i[data-kind]").forEach((el) => {
    el.style.background = KIND_COLOURS[el.dataset.kind] || OTHER_COLOUR;
  });
  box.replaceChildren(svg, legend);
}

function renderOverhead(box, samples) {
  if (!samples || !samples.length) {
    box.replaceChildren(h("p", { class: "muted" }, "Not in /metrics (finished runs leave it after ATTNCHECKER_METRICS_RECENT_SECONDS)."));
    return;
  }
  const check = metricValue(samples, "attnchecker_check_seconds_total");
  const step = metricValue(samples, "attnchecker_step_seconds_total");
  const budget = metricValue(samples, "attnchecker_overhead_budget_ratio");
  const ratio = check !== null && step ? check / step : null;
  const scale = Math.max(ratio || 0, budget || 0, 0.0001) * 1.25;
  const fill = h("div", { class: ratio !== null && budget !== null && ratio > budget ? "fill over" : "fill" });
  fill.style.width = `${Math.min(100, (100 * (ratio || 0)) / scale)}%`;
  const marker = h("div", { class: "budget", title: "budget" });
  marker.style.left = `${Math.min(100, (100 * (budget || 0)) / scale)}%`;
  box.replaceChildren(
    h("div", { class: "meter" }, fill, budget !== null ? marker : null),
    h("p", { id: "overhead-text" }, `checking took ${fmtPercent(ratio)} of step time; budget ${fmtPercent(budget)}`),
    h("p", { class: "muted" }, `${check === null ? "–" : check.toFixed(3)} s checking over ${step === null ? "–" : step.toFixed(3)} s of steps`),
  );
}

function renderPeriods(box, samples) {
  const byOp = new Map();
  for (const sample of samples || []) {
    const op = sample.labels.op;
    if (!op) continue;
    const row = byOp.get(op) || {};
    if (sample.name === "attnchecker_checks_total") row.checks = sample.value;
    if (sample.name === "attnchecker_check_period_steps") row.period = sample.value;
    byOp.set(op, row);
  }
  const ops = [...byOp.keys()].filter((op) => "checks" in byOp.get(op) || "period" in byOp.get(op));
  if (!ops.length) {
    box.replaceChildren(h("p", { class: "muted" }, "No interval statistics yet."));
    return;
  }
  ops.sort((a, b) => (KNOWN_OPS.indexOf(a) + 99) % 99 - (KNOWN_OPS.indexOf(b) + 99) % 99);
  box.replaceChildren(
    h(
      "table",
      { id: "periods-table" },
      h("thead", {}, h("tr", {}, h("th", {}, "Op"), h("th", { class: "num" }, "Checks"), h("th", { class: "num" }, "Period (steps)"))),
      h("tbody", {}, ops.map((op) => h("tr", {}, h("td", {}, op), h("td", { class: "num" }, fmtNum(byOp.get(op).checks)),
        h("td", { class: "num" }, fmtNum(byOp.get(op).period))))),
    ),
  );
}

// The coverage map (what is protected, by which path, and what is not) exists only when the agent sends one in the
// run's registration; its shape is the agent's, so it is drawn generically.
function coverageOf(run) {
  const config = run && typeof run.config === "object" && run.config !== null ? run.config : {};
  for (const candidate of [run && run.coverage, config.coverage, config.coverage_map]) {
    if (candidate !== null && candidate !== undefined && typeof candidate === "object") return candidate;
  }
  return null;
}

function renderCoverage(box, run) {
  const coverage = coverageOf(run);
  box.hidden = coverage === null;
  if (coverage === null) {
    box.replaceChildren();
    return;
  }
  const rows = Array.isArray(coverage) ? coverage : Object.entries(coverage).map(([key, value]) =>
    value && typeof value === "object" && !Array.isArray(value) ? { module: key, ...value } : { module: key, value });
  const objects = rows.filter((row) => row && typeof row === "object");
  const columns = [...new Set(objects.flatMap((row) => Object.keys(row)))].slice(0, 12);
  box.replaceChildren(
    h("h2", {}, "Coverage map"),
    objects.length && columns.length
      ? h("div", { class: "scroll" }, h("table", { id: "coverage-table" },
          h("thead", {}, h("tr", {}, columns.map((c) => h("th", {}, label(c))))),
          h("tbody", {}, objects.map((row) => h("tr", {}, columns.map((c) => h("td", {}, short(row[c])))))),
        ))
      : h("pre", { class: "json" }, short(coverage)),
  );
}

function renderEvents(box, events) {
  if (!events.length) {
    box.replaceChildren(h("p", { class: "muted" }, "No fault events yet."));
    return;
  }
  const recent = events.slice(-RECENT_EVENTS).reverse();
  const columns = ["step", "rank", "layer", "op", "kind", "pattern", "action", "value", "residual", "bound"];
  box.replaceChildren(
    h(
      "table",
      { id: "events-table" },
      h("thead", {}, h("tr", {}, h("th", {}, "Time"), columns.map((c) => h("th", {}, c)))),
      h(
        "tbody",
        {},
        recent.map((e) =>
          h("tr", { class: e.action === "uncorrectable" ? "bad" : null }, h("td", {}, fmtTime(e.ts)),
            columns.map((c) => h("td", { title: c === "value" ? short(e[c]) : null }, c === "value" ? fmtValue(e[c]) : short(e[c]))))),
      ),
    ),
  );
}

function renderHistory(box, json) {
  const revisions = Array.isArray(json && json.data) ? [...json.data].reverse() : [];
  box.replaceChildren(
    h(
      "table",
      { id: "history-table" },
      h("thead", {}, h("tr", {}, h("th", {}, "Version"), h("th", {}, "By"), h("th", {}, "When"), h("th", {}, "Changed"))),
      h(
        "tbody",
        {},
        revisions.map((rev, i) => {
          const before = revisions[i + 1] && revisions[i + 1].policy;
          const after = rev.policy || {};
          const changed = before
            ? Object.keys(after).filter((k) => JSON.stringify(after[k]) !== JSON.stringify(before[k]))
                .map((k) => `${k} ${short(before[k])} → ${short(after[k])}`).join(", ") || "(no change)"
            : "first version";
          return h("tr", {}, h("td", {}, fmtVersion(rev.version)), h("td", {}, rev.actor ?? "–"),
            h("td", {}, fmtTime(rev.changed_at)), h("td", { class: "wrap" }, changed));
        }),
      ),
    ),
  );
}

// --- the policy editor -------------------------------------------------------------------------------------------

// May this session change this run's policy? A PATCH with an If-Match no policy ever has ("0": versions start at 1)
// changes nothing by definition: the API answers 412 to a role that may write, 403 (or 401) to one that may not.
async function mayEdit(api) {
  if (!state.token) return false;
  const r = await request("PATCH", `${api}/policy`, { body: {}, headers: { "If-Match": '"0"' } });
  return r.status === 412;
}

function policyEditor(runId, api, view, box) {
  let current = null; // the policy as last read (with its version)
  let dirty = false;
  let editable = false;
  const inputs = {};
  const status = h("p", { id: "policy-status", role: "status" });
  const version = h("span", { id: "policy-version" });
  const save = h("button", { type: "submit", id: "policy-save" }, "Save");
  const reload = h("button", { type: "button", class: "secondary", id: "policy-reload" }, "Reload current");
  const form = h("form", { class: "policy", id: "policy-form" });
  for (const field of POLICY_FIELDS) {
    const id = `policy-${field.name}`;
    const input = field.type === "select"
      ? h("select", { id, name: field.name }, field.options.map((o) => h("option", { value: o }, o)))
      : h("input", { id, name: field.name, type: "number", min: field.min, max: field.max,
          step: field.type === "int" ? 1 : "any" });
    input.addEventListener("input", () => { dirty = true; });
    inputs[field.name] = input;
    form.append(h("label", { for: id }, field.label), input);
  }
  form.append(h("div", { class: "actions" }, save, reload));
  const readOnly = h("p", { class: "note", id: "policy-readonly", hidden: true },
    "Read-only: only an operator token may change the policy.");
  box.replaceChildren(h("p", {}, "Current version ", version), readOnly, form, status);

  function fill(policy, etag) {
    current = { ...policy, etag: etag || `"${policy.version}"` };
    version.textContent = fmtVersion(policy.version);
    for (const field of POLICY_FIELDS) {
      if (policy[field.name] !== undefined) inputs[field.name].value = String(policy[field.name]);
    }
    dirty = false;
  }

  function setEditable(value, known = true) {
    editable = value;
    readOnly.hidden = value || !known;
    form.dataset.access = known ? (value ? "edit" : "read-only") : "checking";
    for (const input of Object.values(inputs)) input.disabled = !value;
    save.disabled = !value;
    reload.disabled = !value;
  }

  async function load() {
    const r = await get(`${api}/policy`);
    if (view === state.view) fill(r.json || {}, r.etag);
  }

  function changes() {
    const out = {};
    for (const field of POLICY_FIELDS) {
      const raw = inputs[field.name].value;
      const value = field.type === "select" ? raw : field.type === "int" ? Number.parseInt(raw, 10) : Number(raw);
      if (field.type !== "select" && !Number.isFinite(value)) throw new Error(`${field.label}: enter a number`);
      if (value !== current[field.name]) out[field.name] = value;
    }
    return out;
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!editable || current === null) return;
    let body;
    try {
      body = changes();
    } catch (err) {
      status.className = "error";
      status.textContent = err.message;
      return;
    }
    if (!Object.keys(body).length) {
      status.className = "muted";
      status.textContent = "Nothing changed.";
      return;
    }
    const r = await request("PATCH", `${api}/policy`, { body, headers: { "If-Match": current.etag } });
    if (r.status === 200) {
      fill(r.json, r.etag);
      status.className = "";
      status.textContent = `Saved ${fmtVersion(r.json.version)}; the agent applies it at its next step boundary.`;
    } else if (r.status === 412) {
      // Somebody else changed it since this form was filled: say so, and show the version now in force.
      status.className = "error";
      status.textContent = `412 Precondition Failed: ${detailOf(r.json, r.status)}. Your edit was not saved; ` +
        "the form now shows the current version.";
      await load();
    } else if (r.status === 403 || r.status === 401) {
      setEditable(false);
      status.className = "error";
      status.textContent = detailOf(r.json, r.status);
    } else {
      status.className = "error";
      status.textContent = `${r.status}: ${detailOf(r.json, r.status)}`;
    }
  });
  reload.addEventListener("click", async () => {
    status.textContent = "";
    await load();
  });

  setEditable(false, false);
  (async () => {
    await load();
    if (state.canEdit === null || state.canEdit.runId !== runId) {
      state.canEdit = { runId, value: await mayEdit(api) };
    }
    if (view === state.view) setEditable(state.canEdit.value);
  })().catch((err) => { status.className = "error"; status.textContent = err.message; });

  return {
    // Called on every poll: a newer version from elsewhere refreshes the form unless the user is editing it.
    update(run) {
      const requested = num(run.requested_policy_version);
      if (current !== null && requested !== null && requested !== current.version && !dirty) load().catch(() => {});
    },
  };
}

boot();
