// Eval metrics per step (pass@k and pass^k included) and the eval completions, browsable like
// rollouts.
import { useMemo } from "preact/hooks";
import { enc } from "../api.js";
import { useApi } from "../hooks.js";
import { setParams } from "../route.js";
import { ErrorBox, html, Loading, Message } from "../ui.js";
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
    ${evalNames.length > 0 && html`<h3>Eval completions</h3>
      <div class="toolbar"><label>eval <select value=${params.eval || evalNames[0]} onChange=${(e) => setParams({ eval: e.target.value, step: undefined })}>
        ${evalNames.map((e) => html`<option value=${e}>${e}</option>`)}</select></label></div>
      <${RolloutBrowser} run=${run} runs=${runs} params=${{ ...params, env: params.eval || evalNames[0] }} tabs=${false} evalSteps=${evalSteps} />`}`;
}
