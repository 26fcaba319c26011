// A line chart (uPlot) of one or more series that may have different x values (several runs).
// Marks its element `data-drawn` once drawn, which the browser tests and the benchmark wait for.
import { useEffect, useRef } from "preact/hooks";
import uPlot from "uplot";
import { html } from "./ui.js";

export function ema(values, alpha) {
  if (!alpha) return values;
  const out = new Array(values.length);
  let s = 0;
  let n = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v === null || v === undefined || !Number.isFinite(v)) {
      out[i] = null;
      continue;
    }
    s = alpha * s + (1 - alpha) * v;
    n += 1;
    out[i] = s / (1 - Math.pow(alpha, n)); // debiased, so the first points are not pulled to 0
  }
  return out;
}

function percentileRange(lines) {
  const all = [];
  for (const l of lines) for (const v of l.y) if (v !== null && Number.isFinite(v)) all.push(v);
  if (all.length < 10) return null;
  all.sort((a, b) => a - b);
  const lo = all[Math.floor(all.length * 0.01)];
  const hi = all[Math.ceil(all.length * 0.99) - 1];
  const pad = (hi - lo) * 0.05 || Math.abs(hi) * 0.05 || 1;
  return [lo - pad, hi + pad];
}

// lines: [{label, color, x, y}]; opts: {smooth, log, skipFirst, outliers, time, height}
export function Chart({ title, lines, opts = {}, testid }) {
  const box = useRef(null);
  const plot = useRef(null);
  useEffect(() => {
    const el = box.current;
    if (!el) return;
    let shown = lines
      .filter((l) => l.x.length)
      .map((l) => {
        let x = l.x;
        let y = l.y;
        if (opts.skipFirst && x.length > 1) {
          x = x.slice(1);
          y = y.slice(1);
        }
        if (opts.log) y = y.map((v) => (v > 0 ? v : null));
        return { ...l, x, y };
      });
    el.removeAttribute("data-drawn");
    if (plot.current) {
      plot.current.destroy();
      plot.current = null;
    }
    if (!shown.length) {
      el.setAttribute("data-drawn", "empty");
      return;
    }
    const series = [{}];
    const tables = [];
    for (const l of shown) {
      if (opts.smooth) {
        tables.push([l.x, l.y]);
        series.push({ label: `${l.label} (raw)`, stroke: l.color + "44", width: 1, points: { show: false } });
        tables.push([l.x, ema(l.y, opts.smooth)]);
        series.push({ label: l.label, stroke: l.color, width: 1.5, points: { show: false } });
      } else {
        tables.push([l.x, l.y]);
        series.push({ label: l.label, stroke: l.color, width: 1.5, points: { show: l.x.length < 40 } });
      }
    }
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    el.setAttribute("data-points", String(Math.max(...shown.map((l) => l.x.length))));
    const range = opts.outliers ? percentileRange(shown) : null;
    const width = Math.max(260, el.clientWidth || 400);
    const options = {
      width,
      height: opts.height || 190,
      series,
      legend: { show: shown.length > 1 || !!opts.smooth, live: true },
      scales: {
        x: { time: !!opts.time },
        y: opts.log ? { distr: 3 } : range ? { range: () => range } : {},
      },
      axes: [{ stroke: "#555", grid: { stroke: "#eee" } }, { stroke: "#555", grid: { stroke: "#eee" }, size: 60 }],
      cursor: { drag: { x: true, y: false } },
      hooks: { draw: [() => el.setAttribute("data-drawn", "1")] },
    };
    plot.current = new uPlot(options, data, el);
    const ro = new ResizeObserver(() => {
      if (plot.current && el.clientWidth && Math.abs(el.clientWidth - plot.current.width) > 8) {
        plot.current.setSize({ width: el.clientWidth, height: options.height });
      }
    });
    ro.observe(el);
    return () => ro.disconnect();
  }, [lines, opts.smooth, opts.log, opts.skipFirst, opts.outliers, opts.time]);
  useEffect(() => () => plot.current && plot.current.destroy(), []);
  return html`<div class="chart-card" data-testid=${testid}>
    <div class="chart-title" title=${title}>${title}</div>
    <div class="chart" ref=${box}></div>
  </div>`;
}

// Bars of a histogram: edges (n+1) and counts (n), drawn on a canvas.
export function Histogram({ title, edges, counts, color = "#2f6fdf" }) {
  const ref = useRef(null);
  useEffect(() => {
    const c = ref.current;
    if (!c) return;
    const ctx = c.getContext("2d");
    const w = (c.width = c.clientWidth || 400);
    const hgt = (c.height = 160);
    ctx.clearRect(0, 0, w, hgt);
    const max = Math.max(1, ...counts);
    const bw = w / Math.max(1, counts.length);
    ctx.fillStyle = color;
    counts.forEach((n, i) => {
      const bh = ((hgt - 20) * n) / max;
      ctx.fillRect(i * bw + 1, hgt - 16 - bh, Math.max(1, bw - 2), bh);
    });
    ctx.fillStyle = "#444";
    ctx.font = "11px sans-serif";
    if (edges.length) {
      ctx.fillText(fmtEdge(edges[0]), 2, hgt - 3);
      const last = fmtEdge(edges[edges.length - 1]);
      ctx.fillText(last, w - ctx.measureText(last).width - 2, hgt - 3);
    }
    c.setAttribute("data-drawn", "1");
  }, [edges, counts]);
  return html`<div class="chart-card"><div class="chart-title">${title}</div><canvas class="hist" ref=${ref}></canvas></div>`;
}

// A heatmap: counts[column][row], columns labelled by `steps`, rows by bin `edges`.
export function Heatmap({ title, steps, edges, counts }) {
  const ref = useRef(null);
  useEffect(() => {
    const c = ref.current;
    if (!c || !counts.length) return;
    const ctx = c.getContext("2d");
    const w = (c.width = c.clientWidth || 400);
    const hgt = (c.height = 180);
    ctx.clearRect(0, 0, w, hgt);
    const rows = counts[0].length;
    const cw = w / counts.length;
    const rh = (hgt - 14) / rows;
    counts.forEach((col, i) => {
      const total = col.reduce((a, b) => a + b, 0) || 1;
      col.forEach((n, j) => {
        if (!n) return;
        ctx.fillStyle = `rgba(47, 111, 223, ${Math.min(1, 0.1 + (2 * n) / total)})`;
        ctx.fillRect(i * cw, hgt - 14 - (j + 1) * rh, Math.ceil(cw), Math.ceil(rh));
      });
    });
    ctx.fillStyle = "#444";
    ctx.font = "11px sans-serif";
    ctx.fillText(`step ${steps[0]}`, 2, hgt - 2);
    const last = `step ${steps[steps.length - 1]}`;
    ctx.fillText(last, w - ctx.measureText(last).width - 2, hgt - 2);
    ctx.fillText(fmtEdge(edges[edges.length - 1]), 2, 10);
    c.setAttribute("data-drawn", "1");
  }, [steps, edges, counts]);
  return html`<div class="chart-card"><div class="chart-title">${title}</div><canvas class="hist" ref=${ref}></canvas></div>`;
}

function fmtEdge(v) {
  return Math.abs(v) >= 100 || Number.isInteger(v) ? String(Math.round(v)) : v.toFixed(2);
}
