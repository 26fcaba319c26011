// System metrics over wall time: GPUs (per GPU and node), CPU and memory per node, and each
// inference server's metrics; sampled by the server to ~600 points a chart.
import { useMemo } from "preact/hooks";
import { enc } from "../api.js";
import { Chart } from "../chart.js";
import { useApi, useLiveKey } from "../hooks.js";
import { setParams } from "../route.js";
import { ErrorBox, html, Loading, Message, runColor } from "../ui.js";
import { NoRun, pickRun, RunPicker } from "./common.js";

function section(m) {
  if (m.source.startsWith("inference:")) return "inference servers";
  if (m.source.startsWith("gpu") || m.name.startsWith("gpu_") || m.name.startsWith("torch_")) return "GPU";
  return "CPU and memory";
}

export function InfraPage({ params, runs }) {
  const run = pickRun(params, runs);
  const live = useLiveKey(run, (c) => `${Math.floor((c.system_time || 0) / 10)}|${c.step}`, 3000);
  const names = useApi(run ? `runs/${enc(run)}/system-names` : null);
  const bounds = useApi(run ? `runs/${enc(run)}/time-bounds` : null, {}, live);
  const groups = useMemo(() => {
    const out = new Map();
    for (const m of (names.data && names.data.metrics) || []) {
      if (/^cpu_core_\d+_/.test(m.name)) continue; // per-core rows: too many charts for an overview
      const s = section(m);
      if (!out.has(s)) out.set(s, new Set());
      out.get(s).add(m.name);
    }
    return out;
  }, [names.data]);
  if (!run) return html`<${NoRun} />`;
  if (names.error || bounds.error) return html`<${ErrorBox} error=${names.error || bounds.error} />`;
  if (!names.data || !bounds.data) return html`<${Loading} what="system metrics" />`;
  const filter = params.q || "";
  return html`<h2>Infra</h2>
    <div class="toolbar"><${RunPicker} runs=${runs} run=${run} />
      <label>find <input type="text" value=${filter} onInput=${(e) => setParams({ q: e.target.value || undefined })} placeholder="metric name" /></label></div>
    <${TimeShares} run=${run} live=${live} />
    ${!names.data.metrics.length && html`<${Message} kind="empty">This run has no system metrics recorded.<//>`}
    ${["GPU", "CPU and memory", "inference servers"].filter((s) => groups.has(s)).map(
      (s) => html`<h3>${s}</h3><div class="grid">
        ${[...groups.get(s)].filter((n) => n.includes(filter)).sort().map((n) => html`<${SystemChart} run=${run} name=${n} bounds=${bounds.data} />`)}
      </div>`,
    )}`;
}

function SystemChart({ run, name, bounds }) {
  const { data, error } = useApi(`runs/${enc(run)}/system`, { name, start: bounds.system_start, end: bounds.system_end + 1, points: 600 });
  const lines = useMemo(
    () =>
      data
        ? Object.entries(data.series)
            .sort()
            .map(([k, s], i) => ({ label: k, color: runColor(i), x: s.time, y: s.value }))
        : [],
    [data],
  );
  if (error) return html`<${ErrorBox} error=${error} />`;
  return html`<${Chart} title=${name} lines=${lines} opts=${{ time: true }} testid=${"sys-" + name} />`;
}

const PHASE_ORDER = ["forward", "backward", "loss_computation", "optimizer", "grad_norm", "zero_grad", "data_to_device", "ref_logprobs", "weight_sync", "waiting_for_data", "idle"];

// Where each training step's time went: the trainer's spans, the weight sync, waiting for data, idle.
function TimeShares({ run, live }) {
  const { data, error } = useApi(`runs/${enc(run)}/time-shares`, {}, live);
  const lines = useMemo(
    () =>
      data
        ? PHASE_ORDER.filter((p) => data.series[p]).map((p, i) => ({ label: p, color: runColor(i), x: data.series[p].steps, y: data.series[p].values }))
        : [],
    [data],
  );
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data || !lines.length) return null;
  return html`<h3>Trainer time breakdown (% of each step)</h3>
    <div class="grid"><${Chart} title="share of the step (%)" lines=${lines} opts=${{ height: 240 }} testid="time-shares" /></div>`;
}
