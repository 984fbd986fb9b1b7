// The fault timeline: one lane per op, a mark per event coloured by kind, uncorrectable faults ringed. Plain SVG
// built through the DOM (no charting library, nothing inline for the CSP to refuse).
import { h, num, s } from "./dom.js";

export const KNOWN_OPS = ["q", "k", "v", "scores", "context", "out"];
const KIND_COLOURS = { inf: "#d32f2f", neg_inf: "#7b1fa2", nan: "#ef6c00", near_inf: "#f9a825", silent: "#1976d2" };
const OTHER_COLOUR = "#607d8b";

export function renderTimeline(box, events, truncated, lastStep) {
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
