// One step's rollouts by group: filters (status, environment, stop reason, reward range, text),
// sort, and one rollout in full: prompts, every turn, tool calls, environment answers, reward,
// advantage, sample metrics coloured by their ranges, versions, server and lane, timings.
import { useMemo } from "preact/hooks";
import { enc } from "../api.js";
import { useApi, useLiveKey } from "../hooks.js";
import { href, setParams } from "../route.js";
import { ErrorBox, fmt, fmtDuration, fmtTime, html, Loading, Message, rangeColor } from "../ui.js";
import { ModelText } from "../markdown.js";
import { NoRun, pickRun, RunPicker } from "./common.js";

const TABS = { kept: "kept", dropped: "discarded,cancelled" };
const SORTS = ["group", "reward", "advantage", "length", "turns", "off_policy", "id"];
const PAGE = 500;

export function RolloutsPage({ params, runs }) {
  const run = pickRun(params, runs);
  if (!run) return html`<${NoRun} />`;
  return html`<h2>Rollouts</h2><${RolloutBrowser} run=${run} runs=${runs} params=${params} tabs=${true} />`;
}

// Shared with the Evals page (tabs false, status eval).
export function RolloutBrowser({ run, runs, params, tabs, evalSteps }) {
  const tab = tabs ? params.tab || "kept" : "eval";
  const status = TABS[tab] || "eval";
  const live = useLiveKey(run, (c) => c.rollout);
  const meta = useApi(`runs/${enc(run)}`);
  const stepList = useApi(tab === "eval" ? null : `runs/${enc(run)}/steps`, { status: tab === "dropped" ? "discarded" : "kept" }, live);
  const steps = evalSteps || (stepList.data && stepList.data.steps) || [];
  const step = params.step !== undefined && params.step !== "" ? Number(params.step) : steps[steps.length - 1];
  const query = {
    status,
    env: params.env,
    stop: params.stop,
    reward_min: params.rmin,
    reward_max: params.rmax,
    q: params.q,
    sort: params.sort,
    desc: params.desc === "1" ? "true" : undefined,
    offset: params.off,
    limit: PAGE,
  };
  const page = useApi(step !== undefined && !Number.isNaN(step) ? `runs/${enc(run)}/steps/${step}/rollouts` : null, query, live);
  if (meta.error) return html`<${ErrorBox} error=${meta.error} />`;
  if (meta.data && !meta.data.has.rollouts && tab !== "eval") return html`<${Message} kind="empty">This run has no rollouts recorded yet.<//>`;
  const i = steps.indexOf(step);
  return html`
    <div class="toolbar">
      <${RunPicker} runs=${runs} run=${run} />
      ${tabs && html`<span>${Object.keys(TABS).map((t) => html`<label><input type="radio" name="tab" checked=${t === tab} onChange=${() => setParams({ tab: t === "kept" ? undefined : t, step: undefined, rollout: undefined })} data-testid=${"tab-" + t} /> ${t === "dropped" ? "discarded & cancelled" : t} </label>`)}</span>`}
      <label>step <input type="number" value=${step ?? ""} onChange=${(e) => setParams({ step: e.target.value, rollout: undefined, off: undefined })} data-testid="step-input" /></label>
      <button disabled=${i <= 0} onClick=${() => setParams({ step: steps[i - 1], rollout: undefined, off: undefined })}>◀</button>
      <button disabled=${i < 0 || i >= steps.length - 1} onClick=${() => setParams({ step: steps[i + 1], rollout: undefined, off: undefined })}>▶</button>
      <span class="muted">${steps.length ? `steps ${steps[0]}–${steps[steps.length - 1]}` : "no steps"}</span>
    </div>
    <${Filters} params=${params} page=${page.data} />
    <${ErrorBox} error=${page.error || stepList.error} />
    ${page.data && page.data.zero_advantage && page.data.zero_advantage.groups && html`<${ZeroAdvantage} z=${page.data.zero_advantage} />`}
    <div class="split">
      <div class="panel" style="overflow:auto; max-height: 80vh">
        ${!page.data ? (page.loading ? html`<${Loading} what="rollouts" />` : html`<${Message} kind="empty">Pick a step.<//>`) : html`<${RolloutTable} data=${page.data} params=${params} />`}
      </div>
      <div class="panel">
        ${params.rollout ? html`<${RolloutDetail} run=${run} id=${params.rollout} raw=${params.raw === "1"} tokens=${params.tokens === "1"} config=${meta.data && meta.data.config} metricRanges=${meta.data && meta.data.metric_ranges} />` : html`<span class="muted">Click a rollout to read it.</span>`}
      </div>
    </div>`;
}

function Filters({ params, page }) {
  const envs = (page && page.envs) || [];
  const stops = (page && page.stop_reasons) || [];
  return html`<form class="toolbar" onSubmit=${(e) => {
    e.preventDefault();
    const f = e.target.elements;
    setParams({ q: f.q.value || undefined, rmin: f.rmin.value || undefined, rmax: f.rmax.value || undefined, rollout: undefined, off: undefined });
  }}>
    <label>environment <select value=${params.env || ""} onChange=${(e) => setParams({ env: e.target.value || undefined })} data-testid="rollout-env">
      <option value="">all</option>${envs.map((e) => html`<option value=${e}>${e}</option>`)}</select></label>
    <label>stop reason <select value=${params.stop || ""} onChange=${(e) => setParams({ stop: e.target.value || undefined })}>
      <option value="">all</option>${stops.map((e) => html`<option value=${e}>${e || "(none)"}</option>`)}</select></label>
    <label>reward ≥ <input type="number" step="any" name="rmin" value=${params.rmin || ""} /></label>
    <label>≤ <input type="number" step="any" name="rmax" value=${params.rmax || ""} /></label>
    <label>text <input type="text" name="q" value=${params.q || ""} placeholder="in prompt or completion" data-testid="rollout-search" /></label>
    <button type="submit">filter</button>
    <label>sort <select value=${params.sort || "group"} onChange=${(e) => setParams({ sort: e.target.value })}>
      ${SORTS.map((s) => html`<option value=${s}>${s}</option>`)}</select></label>
    <label><input type="checkbox" checked=${params.desc === "1"} onChange=${(e) => setParams({ desc: e.target.checked || undefined })} /> descending</label>
  </form>`;
}

function ZeroAdvantage({ z }) {
  return html`<${Message}>Zero-advantage groups this step: ${z.groups} — all rewards zero ${fmt(z.all_zero_pct)}%, all
    positive ${fmt(z.all_positive_pct)}%, mean reward ${fmt(z.mean_reward)}.<//>`;
}

function RolloutTable({ data, params }) {
  const byGroup = params.sort === undefined || params.sort === "group";
  const groups = useMemo(() => {
    const out = new Map();
    for (const r of data.rollouts) {
      const k = byGroup ? r.group_id : "all";
      if (!out.has(k)) out.set(k, []);
      out.get(k).push(r);
    }
    return out;
  }, [data, byGroup]);
  if (!data.rollouts.length) return html`<${Message} kind="empty">No rollouts match at step ${data.step}.<//>`;
  const dropped = data.rollouts.some((r) => r.status !== "kept" && r.status !== "eval");
  const first = data.offset;
  const last = first + data.rollouts.length;
  return html`<div class="muted">${data.total} rollout(s) at step ${data.step}${data.total > data.rollouts.length ? `, ${first + 1}–${last} shown ` : ""}
      ${first > 0 && html`<button onClick=${() => setParams({ off: Math.max(0, first - PAGE) || undefined })}>previous</button>`}
      ${last < data.total && html`<button onClick=${() => setParams({ off: last })} data-testid="next-page">next</button>`}</div>
    <table data-testid="rollouts-table"><thead><tr><th>#</th><th>env</th><th class="right">reward</th><th class="right">adv.</th><th class="right">tokens</th><th class="right">turns</th><th>stop</th><th class="right">off-policy</th>${dropped && html`<th>status / reason</th>`}</tr></thead>
    <tbody>${[...groups.entries()].map(([g, rows]) => html`
      ${byGroup && html`<tr class="group-head"><td colspan="9">group ${g} · ${rows[0].env} · mean reward ${fmt(rows.reduce((a, r) => a + (r.reward ?? 0), 0) / rows.length)}</td></tr>`}
      ${rows.map((r) => html`<tr class=${"sample" + (String(r.rollout_id) === params.rollout ? " selected" : "")} data-rollout=${r.rollout_id}
        onClick=${() => setParams({ rollout: r.rollout_id })}>
        <td>${r.sample_idx}</td><td>${r.env}</td>
        <td class="right" style=${{ background: rangeColor(r.reward) }}>${fmt(r.reward)}</td>
        <td class="right">${fmt(r.advantage)}</td><td class="right">${r.completion_tokens}</td>
        <td class="right">${r.num_turns}</td><td>${r.stop_reason}</td><td class="right">${r.off_policy_steps}</td>
        ${dropped && html`<td>${r.status}${r.reason ? " · " + r.reason : ""}</td>`}
      </tr>`)}`)}
    </tbody></table>`;
}

// the reward's range from the config's environment entry; the sample metrics' from the server
// (each environment's metrics_ranges, [0, 1] without one; an inverted range colours low values green)
function envRanges(config, metricRanges, env) {
  const entry = ((config && config.environments) || []).find((e) => e && e.name === env) || {};
  return { lo: entry.reward_min ?? 0, hi: entry.reward_max ?? 1, metrics: (metricRanges && metricRanges[env]) || {} };
}

function RolloutDetail({ run, id, raw, tokens, config, metricRanges }) {
  const { data, error } = useApi(`runs/${enc(run)}/rollouts/${enc(id)}`);
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data) return html`<${Loading} what="rollout" />`;
  const ranges = envRanges(config, metricRanges, data.env);
  return html`<div data-testid="rollout-detail">
    <div class="toolbar">
      <b>rollout ${data.rollout_id}</b> group ${data.group_id} · sample ${data.sample_idx} · ${data.env}
      <span class="badge">${data.status}${data.reason ? ": " + data.reason : ""}</span>
      <label><input type="checkbox" checked=${raw} onChange=${(e) => setParams({ raw: e.target.checked || undefined })} data-testid="raw-toggle" /> raw text</label>
      <label title="the stored token ids decoded with the run's tokenizer, special tokens kept"><input type="checkbox" checked=${tokens} onChange=${(e) => setParams({ tokens: e.target.checked || undefined })} data-testid="tokens-toggle" /> tokens</label>
      <a href=${href("timeline", { runs: run, at: data.dispatch_time })}>on the timeline</a>
    </div>
    ${data.error && html`<${Message} kind="error">${data.error}<//>`}
    <dl class="kv">
      <dt>reward</dt><dd><span style=${{ background: rangeColor(data.reward, ranges.lo, ranges.hi), padding: "0 4px" }}>${fmt(data.reward)}</span></dd>
      <dt>advantage</dt><dd>${fmt(data.advantage)}</dd>
      <dt>sample metrics</dt><dd>${Object.entries(data.sample_metrics).map(([k, v]) => {
        const { lo, hi, invert } = ranges.metrics[k] || { lo: 0, hi: 1, invert: false };
        return html`<span class="badge" style=${{ background: invert ? rangeColor(v, hi, lo) : rangeColor(v, lo, hi) }}>${k} ${fmt(v)}</span> `;
      })}</dd>
      <dt>golden answers</dt><dd>${Object.entries(data.golden_answers).map(([k, v]) => html`<code>${k}: ${JSON.stringify(v)}</code> `)}</dd>
      <dt>stop reason</dt><dd>${data.stop_reason || "—"}</dd>
      <dt>tokens</dt><dd>prompt ${data.prompt_tokens} · completion ${data.completion_tokens} · total ${data.total_tokens}${data.retokenized ? " · retokenized" : ""}</dd>
      <dt>policy versions</dt><dd>start ${data.start_version ?? "—"} · end ${data.end_version ?? "—"} · off-policy steps ${data.off_policy_steps}</dd>
      <dt>server / lane</dt><dd>${data.server || "—"} / ${data.lane}</dd>
      <dt>timings</dt><dd>dispatched ${fmtTime(data.dispatch_time)} · generation ${fmtDuration(data.generation_end_time - data.dispatch_time)} · reward ${fmtDuration(data.reward_time)}</dd>
    </dl>
    ${tokens && html`<${TokenView} run=${run} id=${id} />`}
    ${data.system_prompt && html`<div class="turn system"><div class="who">system</div><${ModelText} text=${data.system_prompt} raw=${raw} /></div>`}
    <div class="turn"><div class="who">user</div><${ModelText} text=${data.prompt_text} raw=${raw} /></div>
    ${data.turns.map((t) => html`
      <div class="turn assistant" data-turn=${t.turn_idx}>
        <div class="who">assistant · turn ${t.turn_idx} · ${t.completion_tokens} tokens · ${t.finish_reason} · versions ${t.start_version}→${t.end_version} · ${fmtDuration((t.end_time || 0) - (t.start_time || 0))}</div>
        <${ModelText} text=${t.content} raw=${raw} />
        ${t.tool_calls.map((c) => html`<div class=${"tool-call" + (c.success ? "" : " failed")} data-testid="tool-call">
          <b>tool ${c.tool_name}</b> ${c.success ? "✓ success" : "✗ failed"}${c.extra && c.extra.exit_code !== undefined ? ` · exit code ${c.extra.exit_code}` : ""}${c.extra && c.extra.truncated ? " · truncated" : ""}
          <div class="muted">arguments</div><pre>${c.arguments}</pre>
          <div class="muted">result</div><pre>${c.result}</pre>
          ${c.error && html`<div class="muted">error</div><pre>${c.error}</pre>`}
        </div>`)}
      </div>
      ${t.env_messages.map((m) => html`<div class="turn env"><div class="who">${m.role || "environment"}${t.env_time ? ` · ${fmtDuration(t.env_time)}` : ""}</div>
        <${ModelText} text=${typeof m.content === "string" ? m.content : JSON.stringify(m.content)} raw=${raw} /></div>`)}`)}
  </div>`;
}

// The rollout's stored token ids decoded with special tokens kept (text nodes in <pre>, never
// parsed as HTML). Turn 0's prompt ids are not in the run store, so its input is not shown.
function TokenView({ run, id }) {
  const { data, error } = useApi(`runs/${enc(run)}/rollouts/${enc(id)}/tokens`);
  if (error) return html`<div data-testid="tokens-view"><${ErrorBox} error=${error} /></div>`;
  if (!data) return html`<${Loading} what="tokens" />`;
  return html`<div data-testid="tokens-view">
    <div class="muted">decoded with ${data.tokenizer} · turn 0's ${data.prompt_tokens} prompt tokens are not stored${data.split ? "" : " · turns could not be told apart (retokenized), whole sequence shown"}</div>
    ${data.turns.map((t) => html`<div class="turn" data-turn=${t.turn_idx ?? ""}>
      ${t.input_text !== null && html`<div class="who">input · turn ${t.turn_idx} · ${t.input_ids.length} tokens</div><pre data-testid="tokens-input">${t.input_text}</pre>`}
      <div class="who">${t.turn_idx === null ? "completion" : `completion · turn ${t.turn_idx}`} · ${t.completion_ids.length} tokens</div>
      <pre data-testid="tokens-completion">${t.completion_text}</pre>
    </div>`)}
  </div>`;
}
