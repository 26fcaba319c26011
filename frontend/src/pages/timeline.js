// A Gantt view over wall time: one row per inference lane (generation, environment, reward bars,
// coloured by group), one row per trainer rank (its spans), the orchestrator's instants, and weight
// syncs as bands. Wheel zooms, drag pans; the window is in the URL and fetched from the server
// (windowed, so a long run stays responsive). Click a bar for its details.
import { useEffect, useMemo, useRef, useState } from "preact/hooks";
import { enc } from "../api.js";
import { useApi, useLiveKey } from "../hooks.js";
import { href, setParams } from "../route.js";
import { ErrorBox, fmtDuration, fmtTime, html, Loading, Message } from "../ui.js";
import { NoRun, pickRun, RunPicker } from "./common.js";

const LABEL = 150;
const ROW = 18;
const AXIS = 22;
// a nested span is drawn inside its parent, its top moved down by INSET per level, so each level
// keeps a strip of its parent visible (and clickable) above it; a row grows to keep the deepest
// bar at least MIN_BAR high
const INSET = 4;
const MIN_BAR = 6;
const SPAN_COLORS = {
  step: "#dee2e6", forward: "#4c6ef5", backward: "#f76707", loss_computation: "#ae3ec9", optimizer: "#2b8a3e",
  data_to_device: "#868e96", zero_grad: "#adb5bd", grad_norm: "#e64980", weight_sync: "#fab005",
};

// Trainer spans nest by "/" in their names (`checkpoint/dcp_save/write` is inside
// `checkpoint/dcp_save`, inside `checkpoint`); `step` encloses every span of its step.
function spanDepth(name) {
  return name === "step" ? 0 : name.split("/").length;
}

// a span without a colour of its own is a blue, darker for each level, so nested levels stay apart
function spanColor(name, depth) {
  return SPAN_COLORS[name] || SPAN_COLORS[name.split("/").pop()] || `hsl(207, 80%, ${Math.max(30, 82 - 12 * depth)}%)`;
}

function rowHeight(row) {
  return Math.max(ROW, 4 + row.depth * INSET + MIN_BAR);
}

function groupColor(id) {
  const h = (Math.abs(Number(id) * 2654435761) % 360) | 0;
  return `hsl(${h}, 60%, 55%)`;
}

function defaultWindow(bounds) {
  const times = Object.values(bounds.step_times || {}).sort((a, b) => a - b);
  const end = bounds.end;
  if (times.length >= 4) return [times[times.length - 4], end];
  return [Math.max(bounds.start, end - 120), end];
}

export function TimelinePage({ params, runs }) {
  const run = pickRun(params, runs);
  const live = useLiveKey(run, (c) => c.event, 2000);
  const bounds = useApi(run ? `runs/${enc(run)}/time-bounds` : null, {}, live);
  if (!run) return html`<${NoRun} />`;
  if (bounds.error) return html`<${ErrorBox} error=${bounds.error} />`;
  if (!bounds.data) return html`<${Loading} what="time range" />`;
  if (bounds.data.start === null) return html`<h2>Timeline</h2><${Message} kind="empty">This run has no timeline events or rollouts recorded yet.<//>`;
  let [start, end] = defaultWindow(bounds.data);
  if (params.at) {
    const at = Number(params.at);
    start = at - 10;
    end = at + 30;
  }
  if (params.start && params.end) {
    start = Number(params.start);
    end = Number(params.end);
  }
  return html`<h2>Timeline</h2><${Gantt} run=${run} runs=${runs} start=${start} end=${end} bounds=${bounds.data} live=${live} />`;
}

function Gantt({ run, runs, start, end, bounds, live }) {
  // spans under ~a pixel wide are left out by the server (and said so), keeping wide views light
  const win = useApi(`runs/${enc(run)}/timeline`, { start, end, limit: 8000, min_duration: (end - start) / 1500 }, live);
  const canvas = useRef(null);
  const hits = useRef([]);
  const [picked, setPicked] = useState(null);
  const [view, setView] = useState([start, end]);
  useEffect(() => setView([start, end]), [start, end]);
  const rows = useMemo(() => buildRows(win.data), [win.data]);
  useEffect(() => {
    const c = canvas.current;
    if (!c || !win.data) return;
    hits.current = draw(c, rows, view[0], view[1]);
    c.setAttribute("data-drawn", "1");
  }, [rows, view, win.data]);
  const commit = (s, e) => setParams({ start: s.toFixed(3), end: e.toFixed(3), at: undefined });
  const zoom = (factor, centre) => {
    const [s, e] = view;
    const c = centre ?? (s + e) / 2;
    commit(c - (c - s) * factor, c + (e - c) * factor);
  };
  const drag = useRef(null);
  const toTime = (x, c) => view[0] + ((x - LABEL) / (c.clientWidth - LABEL)) * (view[1] - view[0]);
  return html`
    <div class="toolbar">
      <${RunPicker} runs=${runs} run=${run} />
      <button onClick=${() => zoom(0.5)} data-testid="zoom-in">zoom in</button>
      <button onClick=${() => zoom(2)} data-testid="zoom-out">zoom out</button>
      <button onClick=${() => commit(view[0] - (view[1] - view[0]) / 2, view[1] - (view[1] - view[0]) / 2)}>◀ earlier</button>
      <button onClick=${() => commit(view[0] + (view[1] - view[0]) / 2, view[1] + (view[1] - view[0]) / 2)}>later ▶</button>
      <button onClick=${() => commit(bounds.start, bounds.end)}>whole run</button>
      <span class="muted" data-testid="window">${fmtTime(view[0])} → ${fmtTime(view[1])} (${fmtDuration(view[1] - view[0])})</span>
      ${win.data && (win.data.truncated || win.data.lanes.truncated) && html`<span class="badge failed">too many events: the first ${win.data.events.id.length} are shown; zoom in</span>`}
    </div>
    <${ErrorBox} error=${win.error} />
    ${!win.data ? html`<${Loading} what="events" />` : html`
      <div class="timeline-wrap">
        <canvas class="gantt" ref=${canvas} data-testid="gantt" style=${{ height: `${canvasHeight(rows)}px` }}
          onWheel=${(e) => {
            e.preventDefault();
            zoom(e.deltaY > 0 ? 1.25 : 0.8, toTime(e.offsetX, e.currentTarget));
          }}
          onMouseDown=${(e) => (drag.current = { x: e.clientX, view: [...view], moved: false })}
          onMouseMove=${(e) => {
            const d = drag.current;
            if (!d) return;
            const dt = ((e.clientX - d.x) / (e.currentTarget.clientWidth - LABEL)) * (d.view[1] - d.view[0]);
            if (Math.abs(e.clientX - d.x) > 3) d.moved = true;
            setView([d.view[0] - dt, d.view[1] - dt]);
          }}
          onMouseUp=${(e) => {
            const d = drag.current;
            drag.current = null;
            if (d && d.moved) commit(view[0], view[1]);
            else setPicked(hitTest(hits.current, e.offsetX, e.offsetY));
          }}
          onMouseLeave=${() => {
            if (drag.current && drag.current.moved) commit(view[0], view[1]);
            drag.current = null;
          }}></canvas>
      </div>`}
    ${picked && html`<${Details} item=${picked} run=${run} />`}
  `;
}

// The server answers in columns; rebuild light objects (attrs parsed here, only for trainer rows'
// ranks and for the details panel).
function eventsOf(data) {
  const c = data.events;
  return c.id.map((id, i) => ({
    id, name: c.name[i], component: c.component[i], step: c.step[i], start: c.start[i], end: c.end[i], attrsText: c.attrs[i],
  }));
}

function rolloutsOf(data) {
  const c = data.lanes.rollouts;
  const t = data.lanes.turns;
  const byId = new Map();
  const out = c.rollout_id.map((id, i) => {
    const r = { turns: [] };
    for (const k of Object.keys(c)) r[k] = c[k][i];
    byId.set(id, r);
    return r;
  });
  t.rollout_id.forEach((id, i) => {
    const r = byId.get(id);
    if (r) r.turns.push({ start_time: t.start_time[i], end_time: t.end_time[i], env_time: t.env_time[i] });
  });
  return out;
}

function buildRows(data) {
  if (!data) return [];
  const rows = [
    { key: "orchestrator", label: "orchestrator", items: [], depth: 0 },
    { key: "sync", label: "weight sync", items: [], depth: 0 },
  ];
  const ranks = new Map();
  const lanes = new Map();
  for (const e of eventsOf(data)) {
    if (e.component === "trainer" && e.name === "weight_sync") rows[1].items.push({ kind: "event", e });
    else if (e.component === "trainer") {
      const m = /"rank":\s*(\d+)/.exec(e.attrsText);
      const r = m ? Number(m[1]) : 0;
      if (!ranks.has(r)) ranks.set(r, { key: `rank${r}`, label: `trainer rank ${r}`, items: [], depth: 0 });
      const row = ranks.get(r);
      const depth = spanDepth(e.name);
      row.items.push({ kind: "event", e, depth });
      row.depth = Math.max(row.depth, depth);
    } else rows[0].items.push({ kind: "event", e });
  }
  for (const r of rolloutsOf(data)) {
    const k = `${r.server} lane ${r.lane}`;
    if (!lanes.has(k)) lanes.set(k, { key: k, label: k, items: [], depth: 0 });
    lanes.get(k).items.push({ kind: "rollout", r });
  }
  const byName = (a, b) => a.label.localeCompare(b.label, undefined, { numeric: true });
  // parents first, so a child is drawn over its parent and a click inside the child picks it
  for (const row of ranks.values()) row.items.sort((a, b) => a.depth - b.depth);
  return [...rows, ...[...ranks.values()].sort(byName), ...[...lanes.values()].sort(byName)];
}

function canvasHeight(rows) {
  return AXIS + rows.reduce((sum, row) => sum + rowHeight(row), 0) + 4;
}

function draw(c, rows, t0, t1) {
  const w = (c.width = c.clientWidth);
  const hgt = (c.height = canvasHeight(rows));
  const ctx = c.getContext("2d");
  const x = (t) => LABEL + ((t - t0) / (t1 - t0)) * (w - LABEL);
  const hits = [];
  ctx.clearRect(0, 0, w, hgt);
  ctx.font = "11px sans-serif";
  // weight syncs as bands across every row
  ctx.fillStyle = "rgba(250, 176, 5, 0.15)";
  for (const it of rows[1].items) {
    const e = it.e;
    ctx.fillRect(x(e.start), AXIS, Math.max(1, x(e.end) - x(e.start)), hgt - AXIS);
  }
  // time axis
  ctx.fillStyle = "#555";
  const span = t1 - t0;
  const step = niceStep(span / 8);
  for (let t = Math.ceil(t0 / step) * step; t < t1; t += step) {
    const px = x(t);
    ctx.fillRect(px, AXIS - 5, 1, 5);
    ctx.fillText(`${(t - t0).toFixed(step < 1 ? 2 : 0)} s`, px + 2, 12);
  }
  let y = AXIS;
  rows.forEach((row, i) => {
    const h = rowHeight(row);
    ctx.fillStyle = i % 2 ? "#fafbfc" : "#fff";
    ctx.fillRect(0, y, w, h);
    ctx.fillStyle = "#333";
    ctx.fillText(row.label, 4, y + 13);
    for (const it of row.items) {
      if (it.kind === "event") {
        const e = it.e;
        if (e.start === e.end) {
          ctx.fillStyle = e.name.startsWith("rollout_discarded") ? "#e03131" : "#495057";
          ctx.fillRect(x(e.start), y + 2, 1.5, h - 4);
          hits.push([x(e.start) - 2, y, 5, h, it]);
          continue;
        }
        const top = y + 2 + (it.depth ?? 0) * INSET;
        ctx.fillStyle = spanColor(e.name, it.depth ?? 0);
        const x0 = Math.max(LABEL, x(e.start));
        const bw = Math.max(1, Math.min(w, x(e.end)) - x0);
        ctx.fillRect(x0, top, bw, y + h - 2 - top);
        if (it.depth > 1 && bw > 3) {
          ctx.strokeStyle = "rgba(0, 0, 0, 0.25)";
          ctx.strokeRect(x0 + 0.5, top + 0.5, bw - 1, y + h - 3 - top);
        }
        hits.push([x0, it.depth ? top : y, bw, it.depth ? y + h - top : h, it]);
      } else {
        const r = it.r;
        let t = r.dispatch_time;
        for (const turn of r.turns) {
          ctx.fillStyle = groupColor(r.group_id);
          const a = Math.max(LABEL, x(turn.start_time || t));
          ctx.fillRect(a, y + 3, Math.max(1, x(turn.end_time) - a), ROW - 6);
          if (turn.env_time) {
            ctx.fillStyle = "#2b8a3e";
            ctx.fillRect(Math.max(LABEL, x(turn.end_time)), y + 6, Math.max(1, x(turn.end_time + turn.env_time) - x(turn.end_time)), ROW - 12);
          }
          t = turn.end_time;
        }
        if (r.finish_time > r.generation_end_time) {
          ctx.fillStyle = "#f08c00";
          const a = Math.max(LABEL, x(r.generation_end_time));
          ctx.fillRect(a, y + 6, Math.max(1, x(r.finish_time) - a), ROW - 12);
        }
        const a = Math.max(LABEL, x(r.dispatch_time));
        hits.push([a, y, Math.max(2, x(r.finish_time) - a), h, it]);
      }
    }
    y += h;
  });
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, LABEL - 2, AXIS);
  return hits;
}

function niceStep(raw) {
  const p = Math.pow(10, Math.floor(Math.log10(raw || 1)));
  for (const m of [1, 2, 5, 10]) if (raw <= m * p) return m * p;
  return 10 * p;
}

function hitTest(hits, px, py) {
  let best = null;
  for (const [x0, y0, w, hh, it] of hits) {
    if (px >= x0 && px <= x0 + w && py >= y0 && py <= y0 + hh) best = it; // the last drawn is on top
  }
  return best;
}

function Details({ item, run }) {
  if (item.kind === "rollout") {
    const r = item.r;
    return html`<div class="panel" data-testid="timeline-details">
      <b>rollout ${r.rollout_id}</b> · group ${r.group_id} · ${r.env} · ${r.server} lane ${r.lane} · ${r.status}${r.reason ? " (" + r.reason + ")" : ""}
      · reward ${r.reward ?? "—"} · ${fmtDuration(r.finish_time - r.dispatch_time)} · ${r.turns.length} turn(s)
      <a href=${href("rollouts", { runs: run, step: r.step, rollout: r.rollout_id, tab: r.status === "kept" ? undefined : "dropped" })}>open the rollout →</a>
    </div>`;
  }
  const e = item.e;
  return html`<div class="panel" data-testid="timeline-details">
    <b>${e.name}</b> · ${e.component} · step ${e.step ?? "—"} · ${fmtTime(e.start)} · ${fmtDuration(e.end - e.start)}
    <pre>${JSON.stringify(JSON.parse(e.attrsText || "{}"), null, 1)}</pre>
  </div>`;
}
