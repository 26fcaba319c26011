// Step metrics of the compared runs: grouped by `section/group/metric`, an overview first; EMA
// smoothing, log scale, first step and outliers left out, an environment filter (rollout metrics
// recomputed by the server for it), distributions, and a custom view saved by the server.
import { useEffect, useMemo, useState } from "preact/hooks";
import { api, enc } from "../api.js";
import { Heatmap, Histogram } from "../chart.js";
import { useApi } from "../hooks.js";
import { listParam, setParams } from "../route.js";
import { ErrorBox, html, Loading, Message } from "../ui.js";
import { NoRun } from "./common.js";
import { CustomView } from "./layout.js";
import { chartOpts, MetricChart, OVERVIEW, useSeries } from "./metric_data.js";

function groupKey(n) {
  if (n.section) return n.group ? `${n.section}/${n.group}` : n.section;
  return n.metric.split("_")[0];
}

export function MetricsPage({ params, runs }) {
  const [catalogue, setCatalogue] = useState(null);
  const [error, setError] = useState(null);
  useEffect(() => {
    setCatalogue(null);
    setError(null);
    if (!runs.length) return;
    let live = true; // answers for runs no longer shown are dropped
    Promise.all(runs.map((r) => api(`runs/${enc(r)}/metric-names`))).then(
      (all) => {
        if (!live) return;
        const seen = new Map();
        for (const d of all) for (const n of d.names) seen.set(n.name, n);
        setCatalogue([...seen.values()].sort((a, b) => a.name.localeCompare(b.name)));
      },
      (e) => live && setError(e),
    );
    return () => {
      live = false;
    };
  }, [runs.join(",")]);
  const run = runs[0];
  const meta = useApi(run ? `runs/${enc(run)}` : null);
  if (!runs.length) return html`<${NoRun} />`;
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!catalogue) return html`<${Loading} what="metric names" />`;
  const envs = (meta.data && meta.data.envs) || [];
  const opts = chartOpts(params);
  const view = params.view || "all";
  return html`
    <h2>Metrics</h2>
    <div class="toolbar">
      <label><input type="radio" name="view" checked=${view === "all"} onChange=${() => setParams({ view: undefined })} /> all metrics</label>
      <label><input type="radio" name="view" checked=${view === "custom"} onChange=${() => setParams({ view: "custom" })} data-testid="custom-view" /> custom view</label>
      <label>smoothing <input type="range" min="0" max="0.99" step="0.01" value=${opts.smooth} data-testid="smoothing"
        onChange=${(e) => setParams({ smooth: Number(e.target.value) ? e.target.value : undefined })} /> ${opts.smooth.toFixed(2)}</label>
      <label><input type="checkbox" checked=${opts.log} onChange=${(e) => setParams({ log: e.target.checked || undefined })} data-testid="log-scale" /> log scale</label>
      <label><input type="checkbox" checked=${opts.skipFirst} onChange=${(e) => setParams({ skip: e.target.checked || undefined })} /> ignore first step</label>
      <label><input type="checkbox" checked=${opts.outliers} onChange=${(e) => setParams({ outliers: e.target.checked || undefined })} /> ignore outliers</label>
      <label title="sample metrics (reward_<name>_*) of values normalised by each environment's metrics_ranges, as the Rollouts page colours them"><input type="checkbox" checked=${opts.normalise} onChange=${(e) => setParams({ norm: e.target.checked || undefined })} data-testid="normalise" /> normalise sample metrics</label>
      <label>environment <select value=${params.env || ""} onChange=${(e) => setParams({ env: e.target.value || undefined })} data-testid="env-filter">
        <option value="">all</option>${envs.map((e) => html`<option value=${e}>${e}</option>`)}</select></label>
      <label>find <input type="text" value=${params.q || ""} placeholder="metric name" onInput=${(e) => setParams({ q: e.target.value || undefined })} data-testid="metric-filter" /></label>
    </div>
    ${catalogue.length === 0 && html`<${Message} kind="empty">No step metrics recorded yet: they appear after the first training step.<//>`}
    ${view === "custom"
      ? html`<${CustomView} runs=${runs} catalogue=${catalogue} params=${params} opts=${opts} />`
      : html`<${AllMetrics} runs=${runs} catalogue=${catalogue} params=${params} opts=${opts} lastStep=${meta.data ? meta.data.steps - 1 : null} />`}
  `;
}

function AllMetrics({ runs, catalogue, params, opts, lastStep }) {
  const filter = (params.q || "").toLowerCase();
  const names = catalogue.map((n) => n.name);
  const groups = useMemo(() => {
    const out = new Map();
    out.set("overview", OVERVIEW.filter((n) => names.includes(n)));
    for (const n of catalogue) {
      if (n.name.startsWith("eval/")) continue; // on the Evals page
      const k = groupKey(n);
      if (!out.has(k)) out.set(k, []);
      out.get(k).push(n.name);
    }
    return out;
  }, [catalogue]);
  const open = new Set(params.open ? listParam(params.open) : ["overview"]);
  const shown = [];
  for (const [k, list] of groups) {
    const hits = filter ? list.filter((n) => n.toLowerCase().includes(filter)) : list;
    if (hits.length) shown.push([k, hits, filter ? true : open.has(k)]);
  }
  const wanted = [...new Set(shown.filter(([, , o]) => o).flatMap(([, l]) => l))];
  const { data, error } = useSeries(runs, wanted, params.env || "", opts.normalise);
  const toggle = (k, isOpen) => {
    const next = new Set(open);
    if (isOpen) next.add(k);
    else next.delete(k);
    setParams({ open: [...next].join(",") || "none" });
  };
  return html`
    <${ErrorBox} error=${error} />
    ${shown.map(
      ([k, list, isOpen]) => html`<details class="metric-group" open=${isOpen} data-group=${k}
        onToggle=${(e) => e.target.open !== isOpen && toggle(k, e.target.open)}>
        <summary>${k} <span class="muted">(${list.length})</span></summary>
        ${isOpen && html`<div class="grid">${list.map((n) => html`<${MetricChart} name=${n} runs=${runs} data=${data} opts=${opts} />`)}</div>`}
      </details>`,
    )}
    ${lastStep !== null && Object.keys(data).length > 0 && html`<${Distributions} run=${runs[0]} params=${params} lastStep=${lastStep} />`}
  `;
}

const FIELDS = ["reward", "advantage", "completion_tokens", "off_policy_steps"];

function Distributions({ run, params, lastStep }) {
  const field = params.dist || "reward";
  const step = params.hstep || String(Math.max(0, lastStep)); // the newest step unless one is asked for
  const env = params.env || "";
  const hist = useApi(`runs/${enc(run)}/histogram`, { field, step, envs: env });
  const heat = useApi(`runs/${enc(run)}/distribution`, { field, envs: env });
  return html`<details class="metric-group" open data-group="distributions">
    <summary>distributions of ${run}</summary>
    <div class="toolbar">
      <label>of <select value=${field} onChange=${(e) => setParams({ dist: e.target.value })} data-testid="dist-field">
        ${FIELDS.map((f) => html`<option value=${f}>${f}</option>`)}</select></label>
      <label>histogram at step <input type="number" min="0" value=${step} onChange=${(e) => setParams({ hstep: e.target.value || undefined })} /></label>
    </div>
    <${ErrorBox} error=${hist.error || heat.error} />
    <div class="grid">
      ${hist.data && html`<${Histogram} title=${`${field} at step ${step}`} edges=${hist.data.edges} counts=${hist.data.counts} />`}
      ${heat.data && html`<${Heatmap} title=${`${field} over steps`} steps=${heat.data.steps} edges=${heat.data.edges} counts=${heat.data.counts} />`}
    </div>
  </details>`;
}
