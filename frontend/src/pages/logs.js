// Every component's log lines with filters by component, level and text, following live.
import { useEffect, useRef, useState } from "preact/hooks";
import { api, enc } from "../api.js";
import { useApi, useCursor } from "../hooks.js";
import { setParams } from "../route.js";
import { ErrorBox, fmtTime, html, Loading, Message } from "../ui.js";
import { NoRun, pickRun, RunPicker } from "./common.js";

export function LogsPage({ params, runs }) {
  const run = pickRun(params, runs);
  const meta = useApi(run ? `runs/${enc(run)}` : null);
  if (!run) return html`<${NoRun} />`;
  if (meta.error) return html`<${ErrorBox} error=${meta.error} />`;
  if (!meta.data) return html`<${Loading} />`;
  if (!meta.data.has.logs) return html`<h2>Logs</h2><${Message} kind="empty">This run has no logs recorded in its run store.<//>`;
  return html`<h2>Logs</h2><${LogView} run=${run} runs=${runs} params=${params} />`;
}

function LogView({ run, runs, params }) {
  const cursor = useCursor(run);
  const [lines, setLines] = useState([]);
  const [error, setError] = useState(null);
  const last = useRef(0);
  const filters = { component: params.component, level: params.level, q: params.q };
  const key = JSON.stringify(filters) + run;
  useEffect(() => {
    last.current = 0;
    setLines([]);
  }, [key]);
  useEffect(() => {
    api(`runs/${enc(run)}/logs`, { ...filters, after: last.current, limit: 5000 }).then((d) => {
      // two requests can overlap (a filter change and a new cursor): keep only lines not shown yet
      const fresh = d.logs.filter((l) => l.id > last.current);
      if (fresh.length) {
        last.current = fresh[fresh.length - 1].id;
        setLines((old) => [...old, ...fresh].slice(-20000));
      }
      setError(null);
    }, setError);
  }, [key, cursor && cursor.log]);
  return html`<form class="toolbar" onSubmit=${(e) => {
      e.preventDefault();
      const f = e.target.elements;
      setParams({ component: f.component.value || undefined, level: f.level.value || undefined, q: f.q.value || undefined });
    }}>
      <${RunPicker} runs=${runs} run=${run} />
      <label>component <input type="text" name="component" value=${params.component || ""} /></label>
      <label>level <input type="text" name="level" value=${params.level || ""} placeholder="INFO, WARNING…" /></label>
      <label>text <input type="text" name="q" value=${params.q || ""} /></label>
      <button type="submit">filter</button>
    </form>
    <${ErrorBox} error=${error} />
    <table data-testid="logs-table"><thead><tr><th>time</th><th>component</th><th>level</th><th>source</th><th>message</th></tr></thead>
      <tbody>${lines.map((l) => html`<tr><td>${fmtTime(l.time)}</td><td>${l.rank == null ? l.component : `${l.component}-${l.rank}`}</td><td>${l.level}</td><td>${l.source}</td><td><pre>${l.message}</pre></td></tr>`)}</tbody></table>`;
}
