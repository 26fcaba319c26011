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

const LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"];

function LogView({ run, runs, params }) {
  const cursor = useCursor(run);
  const [lines, setLines] = useState([]);
  const [error, setError] = useState(null);
  const last = useRef(0);
  const generation = useRef(0);
  const filters = { component: params.component, rank: params.rank, level: params.level, q: params.q };
  const key = JSON.stringify(filters) + run;
  useEffect(() => {
    generation.current += 1;
    last.current = 0;
    setLines([]);
  }, [key]);
  useEffect(() => {
    const asked = generation.current;
    api(`runs/${enc(run)}/logs`, { ...filters, after: last.current, limit: 5000 }).then((d) => {
      // an answer to an older filter is dropped; two requests of one filter can overlap (a new
      // cursor while one is in flight): keep only lines not shown yet
      if (asked !== generation.current) return;
      const fresh = d.logs.filter((l) => l.id > last.current);
      if (fresh.length) {
        last.current = fresh[fresh.length - 1].id;
        setLines((old) => [...old, ...fresh].slice(-20000));
      }
      setError(null);
    }, (e) => asked === generation.current && setError(e));
  }, [key, cursor && cursor.log]);
  return html`<form class="toolbar" data-testid="logs-filter" onSubmit=${(e) => {
      e.preventDefault();
      const f = e.target.elements;
      setParams({
        component: f.component.value || undefined,
        rank: f.rank.value || undefined,
        level: f.level.value || undefined,
        q: f.q.value || undefined,
      });
    }}>
      <${RunPicker} runs=${runs} run=${run} />
      <label>component <input type="text" name="component" value=${params.component || ""} /></label>
      <label>rank <input type="number" min="0" name="rank" value=${params.rank || ""} style="width:5em" /></label>
      <label>level <select name="level" value=${params.level || ""}>
        <option value="">any</option>
        ${LEVELS.map((l) => html`<option value=${l}>${l} and above</option>`)}
      </select></label>
      <label>text <input type="text" name="q" value=${params.q || ""} /></label>
      <button type="submit">filter</button>
    </form>
    <${ErrorBox} error=${error} />
    <table data-testid="logs-table"><thead><tr><th>time</th><th>component</th><th>level</th><th>source</th><th>message</th></tr></thead>
      <tbody>${lines.map((l) => html`<tr data-id=${l.id}><td>${fmtTime(l.time)}</td><td>${l.rank == null ? l.component : `${l.component}-${l.rank}`}</td><td>${l.level}</td><td>${l.source}</td><td><pre>${l.message}</pre></td></tr>`)}</tbody></table>`;
}
