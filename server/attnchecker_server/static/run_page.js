// A run's page: header, counts, fault timeline, overhead against the budget and per-op periods (both from /metrics),
// the coverage map when the registration carries one, recent events, policy history and the policy editor.
import { fmtAgo, fmtNum, fmtPercent, fmtTime, fmtValue, fmtVersion, h, label, num, short, show } from "./dom.js";
import { policyEditor } from "./policy_editor.js";
import { get, poll, request, state } from "./session.js";
import { KNOWN_OPS, renderTimeline } from "./timeline.js";

const EVENT_PAGE = 1000; // the API's largest page
const EVENT_PAGES = 5; // the chart shows at most this many pages of a run's events
const RECENT_EVENTS = 50;

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

export function runPage(runId, view) {
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
  // The agent's map (attnchecker.coverage, Coverage.to_wire): counts, one line per group of layers that share their
  // protection paths, one per gap. Anything else is drawn as a generic table, so an older or newer agent still shows.
  const lines = (value) => (Array.isArray(value) ? value.filter((line) => typeof line === "string") : null);
  const layers = lines(coverage.layers);
  const gaps = lines(coverage.gaps);
  if (layers !== null || gaps !== null) {
    const unprotected = num(coverage.unprotected) || 0;
    const rows = [
      ...(gaps || []).map((line) => h("tr", { class: "bad" }, h("td", {}, "unprotected"), h("td", {}, line))),
      ...(layers || []).map((line) => h("tr", {}, h("td", {}, "protected"), h("td", {}, line))),
    ];
    box.replaceChildren(
      h("h2", {}, "Coverage map"),
      h("p", { id: "coverage-summary", class: unprotected ? "bad" : "muted" },
        `${fmtNum(coverage.protected)} ops protected, ${fmtNum(unprotected)} unprotected`),
      h("div", { class: "scroll" }, h("table", { id: "coverage-table" },
        h("thead", {}, h("tr", {}, h("th", {}, "State"), h("th", {}, "Layers: ops and path (or why not)"))),
        h("tbody", {}, rows),
      )),
    );
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

export function policyVersions(run) {
  const requested = num(run.requested_policy_version);
  const applied = num(run.applied_policy_version);
  const lag = requested !== null && applied !== requested;
  return h("span", { class: lag ? "badge lag" : "badge", title: lag ? "the agent has not applied the newest version yet" : "" },
    `${fmtVersion(requested)} / ${fmtVersion(applied)}`);
}
