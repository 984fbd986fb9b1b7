// The Devices view: the fleet, most suspect first (GET /api/v1/devices), and one device (GET /api/v1/devices/{uuid})
// with its suspicion, runs, recent events, status history and, for operators, the status form (PATCH with If-Match).
import { fmtAgo, fmtNum, fmtTime, fmtValue, h, num, short, show } from "./dom.js";
import { detailOf, get, poll, request, state } from "./session.js";

const STATUSES = ["ok", "suspect", "quarantined"];

function statusBadge(status) {
  const cls = status === "quarantined" ? "badge bad" : status === "suspect" ? "badge lag" : "badge";
  return h("span", { class: cls, dataset: { status: String(status ?? "") } }, status ?? "?");
}

function suspicionCell(suspicion) {
  const s = suspicion && typeof suspicion === "object" ? suspicion : {};
  const score = num(s.score);
  return [
    h("span", { title: s.reason ?? "" }, score === null ? "–" : score.toFixed(1)),
    s.significant ? h("span", { class: "badge bad significant" }, "significant") : null,
  ];
}

export function devicesPage(view) {
  const body = h("tbody", { id: "devices-body" });
  const summary = h("span", { class: "muted", id: "fleet-summary" });
  show(
    h("div", { class: "row" }, h("h1", {}, "Devices"), summary),
    h("p", { class: "muted" }, "Every device a rank registered, most suspect first: its faults against what the fleet's ",
      "rate predicts for its checks (docs/collector.md, Suspicion). Significant devices are red."),
    h("p", { class: "error", id: "poll-error" }),
    h("div", { class: "card scroll" }, h("table", { id: "devices" },
      h("thead", {}, h("tr", {},
        h("th", {}, "Device"), h("th", {}, "Host"), h("th", {}, "Status"), h("th", { class: "num" }, "Checks"),
        h("th", { class: "num" }, "Faults"), h("th", { class: "num" }, "Uncorrectable"),
        h("th", { class: "num" }, "Runs with faults"), h("th", {}, "Suspicion"), h("th", {}, "Why"),
        h("th", {}, "Last seen"))),
      body)),
  );
  poll(view, async () => {
    const { json } = await get("/api/v1/devices?limit=500");
    if (view !== state.view) return;
    const items = Array.isArray(json && json.items) ? json.items : [];
    const fleet = (json && json.fleet) || {};
    summary.textContent = `${fmtNum(json && json.total)} device(s); ${fmtNum(fleet.devices)} with checks, ` +
      `${fmtNum(fleet.detected)} faults in ${fmtNum(fleet.checks)} checks; false-alarm rate ${short(fleet.alpha)}`;
    body.replaceChildren(...(items.length ? items.map(deviceRow) : [h("tr", {}, h("td", { colspan: 10, class: "muted" },
      "No devices yet: agents register theirs when they protect() a model with a collector."))]));
    document.getElementById("poll-error").textContent = "";
  });
}

function deviceRow(d) {
  const totals = d.totals || {};
  const significant = Boolean(d.suspicion && d.suspicion.significant);
  const uuid = String(d.uuid ?? "");
  return h(
    "tr",
    { class: significant ? "bad" : null, dataset: { uuid } },
    h("td", {}, h("a", { href: `#/devices/${encodeURIComponent(uuid)}` }, uuid)),
    h("td", {}, d.hostname ?? "–"),
    h("td", {}, statusBadge(d.status)),
    h("td", { class: "num" }, fmtNum(totals.checks)),
    h("td", { class: "num" }, fmtNum(totals.detected)),
    h("td", { class: "num" }, fmtNum(totals.uncorrectable)),
    h("td", { class: "num" }, `${fmtNum(totals.fault_runs)} / ${fmtNum(totals.runs)}`),
    h("td", {}, suspicionCell(d.suspicion)),
    h("td", { class: "wrap" }, d.suspicion ? d.suspicion.reason ?? "" : ""),
    h("td", { title: fmtTime(d.last_seen_at) }, fmtAgo(d.last_seen_at)),
  );
}

// May this session set a device's status? A PATCH with an If-Match no device ever has ("0": versions start at 1)
// changes nothing: the API answers 412 to an operator, 403 (or 401) to anyone else.
async function mayMark(path) {
  if (!state.token) return false;
  const r = await request("PATCH", path, { body: { status: "ok", reason: "probe" }, headers: { "If-Match": '"0"' } });
  return r.status === 412;
}

export function devicePage(uuid, view) {
  const path = `/api/v1/devices/${encodeURIComponent(uuid)}`;
  const parts = {
    title: h("h1", { id: "device-uuid" }, uuid),
    meta: h("div", { class: "row muted", id: "device-meta" }),
    counts: h("div", { class: "counts", id: "device-counts" }),
    suspicion: h("p", { id: "device-suspicion" }),
    runs: h("div", { class: "scroll", id: "device-runs" }),
    events: h("div", { class: "scroll", id: "device-events" }),
    history: h("div", { class: "scroll", id: "device-history" }),
    form: h("div", { id: "device-status-form" }),
  };
  show(
    h("p", {}, h("a", { href: "#/devices" }, "← all devices")),
    parts.title,
    parts.meta,
    h("p", { class: "error", id: "poll-error" }),
    parts.counts,
    h("div", { class: "card" }, h("h2", {}, "Suspicion"), parts.suspicion),
    h("div", { class: "grid" },
      h("div", { class: "card" }, h("h2", {}, "Status"), parts.form),
      h("div", { class: "card" }, h("h2", {}, "Status history"), parts.history)),
    h("div", { class: "card" }, h("h2", {}, "Runs on this device"), parts.runs),
    h("div", { class: "card" }, h("h2", {}, "Recent events on this device"), parts.events),
  );
  const form = statusForm(path, view, parts.form);
  poll(view, async () => {
    const r = await get(path);
    if (view !== state.view) return;
    const d = r.json || {};
    document.title = `${uuid} · ATTNChecker`;
    parts.meta.replaceChildren(
      h("span", {}, `host ${d.hostname ?? "–"}`), h("span", {}, `${d.kind ?? "?"} ${d.name ?? ""}`),
      h("span", {}, `PCI ${d.pci_bus_id ?? "–"}`), h("span", {}, `serial ${d.serial ?? "–"}`),
      h("span", { title: fmtTime(d.first_seen_at) }, `first seen ${fmtAgo(d.first_seen_at)}`),
      h("span", { title: fmtTime(d.last_seen_at) }, `last seen ${fmtAgo(d.last_seen_at)}`),
      statusBadge(d.status));
    const totals = d.totals || {};
    parts.counts.replaceChildren(...["checks", "detected", "corrected", "uncorrectable", "runs", "fault_runs"].map((key) =>
      h("div", { class: key === "uncorrectable" && (num(totals[key]) || 0) > 0 ? "count bad" : "count",
        dataset: { count: key } }, h("div", { class: "value" }, fmtNum(totals[key])),
      h("div", { class: "label" }, key === "fault_runs" ? "runs with faults" : key))));
    const s = d.suspicion || {};
    parts.suspicion.className = s.significant ? "error" : "";
    parts.suspicion.replaceChildren(s.significant ? h("strong", {}, "Significant. ") : null, s.reason ?? "–");
    renderRuns(parts.runs, d.runs);
    renderDeviceEvents(parts.events, d.events);
    renderStatusHistory(parts.history, d.history);
    form.update(d, r.etag);
    document.getElementById("poll-error").textContent = "";
  });
}

function renderRuns(box, runs) {
  const rows = Array.isArray(runs) ? runs : [];
  box.replaceChildren(h("table", { id: "device-runs-table" },
    h("thead", {}, h("tr", {}, h("th", {}, "Run"), h("th", { class: "num" }, "Rank"), h("th", { class: "num" }, "Checks"),
      h("th", { class: "num" }, "Faults"), h("th", { class: "num" }, "Uncorrectable"), h("th", {}, "Last seen"))),
    h("tbody", {}, rows.map((run) => h("tr", { class: (num(run.detected) || 0) > 0 ? "bad" : null },
      h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(String(run.run_id ?? ""))}` }, run.run_name ?? run.run_id)),
      h("td", { class: "num" }, fmtNum(run.rank)), h("td", { class: "num" }, fmtNum(run.checks)),
      h("td", { class: "num" }, fmtNum(run.detected)), h("td", { class: "num" }, fmtNum(run.uncorrectable)),
      h("td", { title: fmtTime(run.last_seen_at) }, fmtAgo(run.last_seen_at)))))));
}

function renderDeviceEvents(box, events) {
  const rows = Array.isArray(events) ? events : [];
  if (!rows.length) {
    box.replaceChildren(h("p", { class: "muted" }, "No fault events stored for this device (old ones go with prune)."));
    return;
  }
  const columns = ["step", "rank", "layer", "op", "kind", "action", "value"];
  box.replaceChildren(h("table", { id: "device-events-table" },
    h("thead", {}, h("tr", {}, h("th", {}, "Time"), h("th", {}, "Run"), columns.map((c) => h("th", {}, c)))),
    h("tbody", {}, rows.map((e) => h("tr", { class: e.action === "uncorrectable" ? "bad" : null },
      h("td", {}, fmtTime(e.ts)),
      h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(String(e.run_id ?? ""))}` }, short(e.run_id).slice(0, 8))),
      columns.map((c) => h("td", {}, c === "value" ? fmtValue(e[c]) : short(e[c]))))))));
}

function renderStatusHistory(box, history) {
  const rows = Array.isArray(history) ? [...history].reverse() : [];
  box.replaceChildren(rows.length
    ? h("table", { id: "device-history-table" },
        h("thead", {}, h("tr", {}, h("th", {}, "Version"), h("th", {}, "Status"), h("th", {}, "By"), h("th", {}, "When"),
          h("th", {}, "Why"))),
        h("tbody", {}, rows.map((rev) => h("tr", {}, h("td", {}, `v${rev.version}`), h("td", {}, statusBadge(rev.status)),
          h("td", {}, rev.actor ?? "–"), h("td", {}, fmtTime(rev.changed_at)), h("td", { class: "wrap" }, rev.reason ?? "")))))
    : h("p", { class: "muted" }, "Never changed: ok since first seen."));
}

function statusForm(path, view, box) {
  // The version the form shows and may overwrite (If-Match). While the operator is choosing (dirty) neither the
  // select nor the etag follows the poll: a change made elsewhere meanwhile then answers 412 instead of being
  // overwritten by, or silently substituted for, the operator's choice.
  let etag = null;
  let dirty = false;
  let loaded = false; // the first poll has filled the form: nobody chooses against a status they have not seen
  let allowed = null; // may this token set a status (null: not known yet)
  const select = h("select", { id: "device-status", name: "status" }, STATUSES.map((s) => h("option", { value: s }, s)));
  const reason = h("input", { id: "device-reason", name: "reason", type: "text", maxlength: 500,
    placeholder: "why (kept in the history)" });
  const save = h("button", { type: "submit", id: "device-save" }, "Set status");
  const note = h("p", { class: "note", id: "device-readonly", hidden: true },
    "Read-only: only an operator token may set a device's status.");
  const status = h("p", { id: "device-status-result", role: "status" });
  const form = h("form", { class: "policy", id: "device-form" },
    h("label", { for: "device-status" }, "Status"), select, h("label", { for: "device-reason" }, "Reason"), reason,
    h("div", { class: "actions" }, save));
  box.replaceChildren(
    h("p", { class: "muted" }, "Suspect or quarantined: the ranks on it follow the suspect-device policy (full ",
      "protection unless changed) from their next step; a quarantined device also warns (or refuses, strict) at ",
      "protect()."),
    note, form, status);
  select.addEventListener("input", () => { dirty = true; });

  function refreshAccess() {
    const editable = allowed === true && loaded;
    form.dataset.access = allowed === false ? "read-only" : editable ? "edit" : "checking";
    note.hidden = allowed !== false;
    for (const el of [select, reason, save]) el.disabled = !editable;
  }

  function follow(device, newEtag) {
    select.value = device.status ?? "ok";
    etag = newEtag || etag;
    dirty = false;
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!reason.value.trim()) {
      status.className = "error";
      status.textContent = "Give a reason: it is kept in the device's history.";
      return;
    }
    const r = await request("PATCH", path, { body: { status: select.value, reason: reason.value.trim() },
      headers: etag ? { "If-Match": etag } : {} });
    if (r.status === 200) {
      follow(r.json, r.etag);
      status.className = "";
      status.textContent = `Set to ${r.json.status} (v${r.json.status_version}).`;
      reason.value = "";
    } else if (r.status === 412) {
      // Changed elsewhere since the form was filled: say so and show the status now in force.
      status.className = "error";
      status.textContent = `412: ${detailOf(r.json, r.status)}. Your change was not saved; the form now shows ` +
        "the current status.";
      const now = await get(path).catch(() => null);
      if (now && view === state.view) follow(now.json || {}, now.etag);
    } else {
      status.className = "error";
      status.textContent = `${r.status}: ${detailOf(r.json, r.status)}`;
    }
  });

  refreshAccess();
  mayMark(path).then((value) => {
    if (view !== state.view) return;
    allowed = value;
    refreshAccess();
  }).catch(() => { allowed = false; refreshAccess(); });
  return {
    update(device, newEtag) {
      if (!dirty) follow(device, newEtag);
      loaded = true;
      refreshAccess();
    },
  };
}
