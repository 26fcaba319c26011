// Step-metric data shared by the metrics page and its custom view: the overview's names, the
// series of several runs (refreshed live), chart options from the query string.
import { useEffect, useMemo, useState } from "preact/hooks";
import { api, enc } from "../api.js";
import { Chart } from "../chart.js";
import { useLiveKey } from "../hooks.js";
import { html, runColor } from "../ui.js";

export const OVERVIEW = [
  "reward_sum_mean", "loss", "entropy", "grad_norm", "kl_divergence_inference", "length_completion_mean",
  "advantage_std", "stop_reason_length_pct", "reward_gini_mean", "group_length_gini_mean", "discarded_count",
  "timing_step_total",
];

// Series of `names` for every run: {run: {name: {steps, values}}}; refreshed when the first run
// writes a new step. With `env` or `normalise`, rollout-derived metrics come from the server's
// recomputation (`normalise`: sample metrics normalised by their environments' ranges).
export function useSeries(runs, names, env, normalise = false) {
  const [data, setData] = useState({});
  const [error, setError] = useState(null);
  const live = useLiveKey(runs[0], (c) => c.step);
  const key = `${runs.join(",")}|${names.join(",")}|${env}|${normalise}|${live}`;
  useEffect(() => {
    if (!runs.length || !names.length) return;
    let live = true;
    Promise.all(
      runs.map(async (run) => {
        const got = (await api(`runs/${enc(run)}/metrics`, { names: names.join(",") })).series;
        if (env || normalise) {
          const derived = (await api(`runs/${enc(run)}/derived`, { envs: env, normalise: normalise ? 1 : undefined })).series;
          for (const n of names) if (derived[n]) got[n] = derived[n];
        }
        return [run, got];
      }),
    ).then(
      (pairs) => {
        if (!live) return;
        setData(Object.fromEntries(pairs));
        setError(null);
      },
      (e) => live && setError(e),
    );
    return () => {
      live = false;
    };
  }, [key]);
  return { data, error };
}

export function chartOpts(params) {
  return {
    smooth: Number(params.smooth || 0),
    log: params.log === "1",
    skipFirst: params.skip === "1",
    outliers: params.outliers === "1",
    normalise: params.norm === "1",
  };
}

export function MetricChart({ name, runs, data, opts, testid }) {
  const lines = useMemo(
    () =>
      runs
        .map((run, i) => {
          const s = data[run] && data[run][name];
          return s ? { label: run, color: runColor(i), x: s.steps, y: s.values } : null;
        })
        .filter(Boolean),
    [data, name, runs.join(",")],
  );
  return html`<${Chart} title=${name} lines=${lines} opts=${opts} testid=${testid || "chart-" + name} />`;
}

