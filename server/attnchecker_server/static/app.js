// The collector's dashboard page: sign-in, routing, the runs table. It reads the JSON API (/api/v1) and /metrics
// with the signed-in token, exactly as any client would, so the API's roles decide what it may see and do.
import { devicePage, devicesPage } from "./devices_page.js";
import { fmtAgo, fmtNum, fmtTime, h, num, show } from "./dom.js";
import { policyVersions, runPage } from "./run_page.js";
import { TOKEN_KEY, detailOf, get, poll, request, setUnauthorizedHandler, state, stopPolling } from "./session.js";

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

function route() {
  stopPolling();
  state.view += 1;
  renderSession();
  if (!state.token && !state.open) return renderSignIn();
  const match = /^#\/(runs|devices)\/([^/?#]+)$/.exec(location.hash);
  let id = null;
  try {
    id = match ? decodeURIComponent(match[2]) : null;
  } catch (_) {
    id = null; // a mangled address: show the list instead
  }
  const devices = location.hash.startsWith("#/devices");
  for (const link of document.querySelectorAll("nav.views a")) {
    link.classList.toggle("active", link.getAttribute("href") === (devices ? "#/devices" : "#/"));
  }
  if (devices) {
    if (id) devicePage(id, state.view);
    else devicesPage(state.view);
  } else if (id) runPage(id, state.view);
  else runsPage(state.view);
}

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

setUnauthorizedHandler(signOut);
boot();
