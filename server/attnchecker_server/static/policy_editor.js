// The policy editor of a run's page: PATCH of the changed fields with If-Match; a stale edit shows the 412 and the
// version in force. It is offered only when the API says this token may write (mayEdit).
import { fmtVersion, h, num } from "./dom.js";
import { detailOf, get, request, state } from "./session.js";

const POLICY_FIELDS = [
  { name: "mode", label: "Mode", type: "select", options: ["off", "detect", "correct"] },
  { name: "period", label: "Period (steps)", type: "int", min: 1 },
  { name: "tolerance", label: "Tolerance", type: "select", options: ["roundoff", "extreme"] },
  { name: "tolerance_factor", label: "Tolerance factor", type: "float", min: 0 },
  { name: "overhead_budget", label: "Overhead budget", type: "float", min: 0, max: 1 },
];

// May this session change this run's policy? A PATCH with an If-Match no policy ever has ("0": versions start at 1)
// changes nothing by definition: the API answers 412 to a role that may write, 403 (or 401) to one that may not.
async function mayEdit(api) {
  if (!state.token) return false;
  const r = await request("PATCH", `${api}/policy`, { body: {}, headers: { "If-Match": '"0"' } });
  return r.status === 412;
}

export function policyEditor(runId, api, view, box) {
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
