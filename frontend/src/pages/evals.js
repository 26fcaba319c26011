// Eval metrics per step (pass@k and pass^k included) and the eval completions, browsable like
// rollouts.
import { useMemo } from "preact/hooks";
import { enc } from "../api.js";
import { useApi } from "../hooks.js";
import { setParams } from "../route.js";
import { Chart } from "../chart.js";
import { ErrorBox, html, Loading, Message, runColor } from "../ui.js";
import { NoRun, pickRun } from "./common.js";
import { chartOpts, MetricChart, useSeries } from "./metric_data.js";
import { RolloutBrowser } from "./rollouts.js";

export function EvalsPage({ params, runs }) {
  const run = pickRun(params, runs);
  const evals = useApi(run ? `runs/${enc(run)}/evals` : null);
  const names = (evals.data && evals.data.metrics) || [];
  const { data, error } = useSeries(runs, names, "");
  const stepsOf = evals.data ? evals.data.evals[params.eval || Object.keys(evals.data.evals)[0]] : null;
  const evalSteps = useMemo(() => stepsOf || [], [stepsOf && stepsOf.join(",")]);
  if (!run) return html`<${NoRun} />`;
  if (evals.error) return html`<${ErrorBox} error=${evals.error} />`;
  if (!evals.data) return html`<${Loading} what="evals" />`;
  const evalNames = Object.keys(evals.data.evals);
  if (!names.length && !evalNames.length) return html`<h2>Evals</h2><${Message} kind="empty">This run has no evals recorded.<//>`;
  return html`<h2>Evals</h2>
    <${ErrorBox} error=${error} />
    <div class="grid">${names.map((n) => html`<${MetricChart} name=${n} runs=${runs} data=${data} opts=${chartOpts(params)} />`)}</div>
    <${PassAtK} names=${names} data=${data[run] || {}} />
    ${evalNames.length > 0 && html`<h3>Eval completions</h3>
      <div class="toolbar"><label>eval <select value=${params.eval || evalNames[0]} onChange=${(e) => setParams({ eval: e.target.value, step: undefined })}>
        ${evalNames.map((e) => html`<option value=${e}>${e}</option>`)}</select></label></div>
      <${RolloutBrowser} run=${run} runs=${runs} params=${{ ...params, env: params.eval || evalNames[0] }} tabs=${false} evalSteps=${evalSteps} />`}`;
}

// pass@k and pass^k against k at the newest eval step, one curve per eval and metric.
function PassAtK({ names, data }) {
  const curves = useMemo(() => {
    const out = new Map();
    for (const n of names) {
      const m = /^eval\/(.+)\/(pass[@^])(\d+)\/(.+)$/.exec(n);
      const s = data[n];
      if (!m || !s || !s.values.length) continue;
      const key = `${m[1]} ${m[2]}k ${m[4]}`;
      if (!out.has(key)) out.set(key, []);
      out.get(key).push([Number(m[3]), s.values[s.values.length - 1], s.steps[s.steps.length - 1]]);
    }
    return [...out.entries()].map(([label, pts], i) => {
      pts.sort((a, b) => a[0] - b[0]);
      return { label: `${label} (step ${pts[0][2]})`, color: runColor(i), x: pts.map((p) => p[0]), y: pts.map((p) => p[1]) };
    });
  }, [names, data]);
  if (!curves.length) return null;
  return html`<h3>pass@k and pass^k against k (newest eval step)</h3>
    <div class="grid"><${Chart} title="value against k" lines=${curves} opts=${{}} testid="pass-at-k" /></div>`;
}
