// Small shared pieces of the pages.
import { h } from "preact";
import htm from "htm";

export const html = htm.bind(h);

export const COLORS = [
  "#2f6fdf", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0c8599", "#e67700", "#5c940d",
  "#a61e4d", "#1864ab", "#862e9c", "#d9480f", "#087f5b", "#364fc7", "#b35900", "#495057",
];

export function runColor(index) {
  return COLORS[index % COLORS.length];
}

export function Message({ kind = "info", children }) {
  return html`<div class="message ${kind}" role=${kind === "error" ? "alert" : "status"}>${children}</div>`;
}

export function ErrorBox({ error }) {
  return error ? html`<${Message} kind="error">${error.message || String(error)}<//>` : null;
}

export function Loading({ what = "" }) {
  return html`<div class="loading">Loading${what ? " " + what : ""}…</div>`;
}

export function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "—";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return v.toPrecision(digits).replace(/\.?0+$/, "");
}

export function fmtTime(unix) {
  if (!unix) return "—";
  const d = new Date(unix * 1000);
  return d.toISOString().replace("T", " ").slice(0, 19);
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  if (seconds < 1) return `${(seconds * 1000).toFixed(1)} ms`;
  if (seconds < 120) return `${seconds.toFixed(2)} s`;
  const m = Math.floor(seconds / 60);
  return m < 120 ? `${m} min ${Math.round(seconds - m * 60)} s` : `${(m / 60).toFixed(1)} h`;
}

// Colour a value inside [lo, hi]: red (lo) to green (hi).
export function rangeColor(v, lo = 0, hi = 1) {
  if (v === null || v === undefined || hi === lo) return "transparent";
  const t = Math.max(0, Math.min(1, (v - lo) / (hi - lo)));
  return `hsl(${Math.round(t * 120)}, 65%, 85%)`;
}
