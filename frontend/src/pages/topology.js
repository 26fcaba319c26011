// What ran where: nodes, GPUs, inference servers, trainer ranks, placement groups, versions, model.
import { enc } from "../api.js";
import { useApi } from "../hooks.js";
import { ErrorBox, html, Loading } from "../ui.js";
import { Lacks, NoRun, pickRun, RunPicker } from "./common.js";

function Table({ rows, columns, testid }) {
  if (!rows || !rows.length) return html`<span class="muted">none</span>`;
  return html`<table data-testid=${testid}><thead><tr>${columns.map((c) => html`<th>${c}</th>`)}</tr></thead>
    <tbody>${rows.map((r) => html`<tr>${columns.map((c) => html`<td>${fmtCell(r[c])}</td>`)}</tr>`)}</tbody></table>`;
}

function fmtCell(v) {
  if (v === undefined || v === null) return "—";
  if (typeof v === "object") return html`<code>${JSON.stringify(v)}</code>`;
  return String(v);
}

export function TopologyPage({ params, runs }) {
  const run = pickRun(params, runs);
  const { data, error } = useApi(run ? `runs/${enc(run)}/topology` : null);
  if (!run) return html`<${NoRun} />`;
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data) return html`<${Loading} what="topology" />`;
  const t = data.topology;
  if (!t) return html`<h2>Topology</h2><${Lacks} what="topology" />`;
  const machines = t.machines || [];
  return html`<h2>Topology</h2><div class="toolbar"><${RunPicker} runs=${runs} run=${run} /></div>
    <h3>Machines</h3>
    <${Table} testid="machines" rows=${machines} columns=${["address", "hostname", "platform", "python", "cpu_count", "cpu_model", "memory_gb", "driver_version", "cuda_driver_version"]} />
    ${machines.map((m) => html`<h3>GPUs of ${m.hostname || m.address}</h3>
      <${Table} rows=${m.gpus} columns=${["index", "name", "uuid", "memory_gb"]} />
      <h3>Versions on ${m.hostname || m.address}</h3>
      <${Table} rows=${Object.entries(m.packages || {}).map(([k, v]) => ({ package: k, version: v }))} columns=${["package", "version"]} />`)}
    <h3>Inference servers (${(t.inference && t.inference.engine) || "?"})</h3>
    <${Table} testid="servers" rows=${(t.inference && t.inference.servers) || []} columns=${["name", "url", "node", "gpu_ids"]} />
    <h3>Trainer ranks</h3>
    <${Table} rows=${(t.trainer && t.trainer.ranks) || []} columns=${["rank", "device", "node", "gpu_ids", "num_parameters", "impl"]} />
    <h3>Placement groups</h3>
    <${Table} rows=${t.placement_groups || []} columns=${["name", "strategy", "bundles"]} />
    <h3>Model</h3>
    <pre data-testid="model">${JSON.stringify(t.model || {}, null, 2)}</pre>`;
}
