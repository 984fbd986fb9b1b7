// DOM building and value formatting for the dashboard page. Everything from the API enters the page through
// textContent (h() and s() below), never as HTML: run names, hosts and event values come from agents.

export function h(tag, attrs, ...children) {
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
export function s(tag, attrs, ...children) {
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

export function show(...nodes) {
  main().replaceChildren(...nodes);
}

// Values from the API, read defensively: fields may be missing, null, or new.

export function num(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}

export function fmtNum(value) {
  const n = num(value);
  return n === null ? "–" : n.toLocaleString("en-US");
}

export function fmtVersion(value) {
  const n = num(value);
  return n === null ? "–" : `v${n}`;
}

export function fmtAgo(iso) {
  const t = Date.parse(iso);
  if (!Number.isFinite(t)) return "–";
  const seconds = Math.max(0, Math.round((Date.now() - t) / 1000));
  if (seconds < 60) return `${seconds} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return new Date(t).toISOString().slice(0, 16).replace("T", " ");
}

export function fmtTime(iso) {
  const t = Date.parse(iso);
  return Number.isFinite(t) ? new Date(t).toISOString().replace("T", " ").slice(0, 19) : "–";
}

export function fmtPercent(ratio) {
  return ratio === null ? "–" : `${(100 * ratio).toFixed(ratio < 0.01 ? 2 : 1)} %`;
}

// An event's value travels as a string (JSON has no INF/NaN); long finite ones are shortened, the title keeps all.
export function fmtValue(value) {
  const n = typeof value === "string" && value.trim() !== "" ? Number(value) : NaN;
  return Number.isFinite(n) && value.length > 10 ? n.toPrecision(4) : short(value);
}

export function label(key) {
  return String(key).replace(/_/g, " ");
}

export function short(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number" && (!Number.isInteger(value) || Math.abs(value) >= 1e9)) return value.toPrecision(4);
  if (typeof value === "object") {
    const text = JSON.stringify(value);
    return text.length > 120 ? text.slice(0, 117) + "…" : text;
  }
  return String(value);
}
