// The signed-in session, the API client and the polling loop of the dashboard page. The token lives in
// sessionStorage (gone when the browser session ends) and leaves the page only as a Bearer header to this origin.

export const TOKEN_KEY = "attnchecker.token";
const POLL_MS = 2000;

export const state = {
  token: sessionStorage.getItem(TOKEN_KEY),
  open: false, // the collector answered reads without a token (ATTNCHECKER_OPEN_READS)
  canEdit: null, // per run id: may this session change the run's policy? (asked once per run)
  timer: null,
  view: 0, // bumped on every navigation so a slow answer never draws into the next page
};

let onUnauthorized = () => {};

/** What to do when the API stops accepting the token (the app shows the sign-in form). */
export function setUnauthorizedHandler(handler) {
  onUnauthorized = handler;
}

export class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

export function detailOf(body, status) {
  if (body && typeof body.message === "string") return body.message;
  if (body && typeof body.detail === "string") return body.detail;
  return `HTTP ${status}`;
}

export async function request(method, path, { body, headers, token = state.token } = {}) {
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

export async function get(path) {
  const r = await request("GET", path);
  if (r.status === 401) {
    onUnauthorized("Your token is no longer accepted; sign in again.");
    throw new ApiError(401, detailOf(r.json, r.status));
  }
  if (!r.ok) throw new ApiError(r.status, detailOf(r.json, r.status));
  return r;
}

export function stopPolling() {
  if (state.timer !== null) clearTimeout(state.timer);
  state.timer = null;
}

// Calls refresh() now and every POLL_MS while the page is still the one that started it.
export function poll(view, refresh) {
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
