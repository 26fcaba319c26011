// Every run under the runs dirs: status, progress, headline config; compare (colour per run),
// notes, hide from view; one run's config, a diff of two runs' configs, search by config.
import { useEffect, useState } from "preact/hooks";
import { api, put } from "../api.js";
import { useApi } from "../hooks.js";
import { href, listParam, setParams } from "../route.js";
import { ErrorBox, fmt, fmtTime, html, Loading, Message, runColor } from "../ui.js";

export function RunsPage({ params, runs: chosen }) {
  const [tick, setTick] = useState(0);
  useEffect(() => {
    const t = setInterval(() => setTick((n) => n + 1), 3000); // new runs and progress show live
    return () => clearInterval(t);
  }, []);
  const { data, error } = useApi("runs", {}, String(tick));
  const [found, setFound] = useState(null);
  const [searchError, setSearchError] = useState(null);
  const query = params.q || "";
  useEffect(() => {
    if (!query) {
      setFound(null);
      setSearchError(null);
      return;
    }
    api("search", { q: query }).then(
      (d) => {
        setFound(new Set(d.runs));
        setSearchError(null);
      },
      (e) => {
        setFound(null);
        setSearchError(e);
      },
    );
  }, [query]);
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data) return html`<${Loading} what="runs" />`;
  const showHidden = params.hidden === "1";
  let rows = data.runs.filter((r) => showHidden || !r.hidden || chosen.includes(r.id));
  if (found) rows = rows.filter((r) => found.has(r.id));
  const toggle = (id) => {
    const next = chosen.includes(id) ? chosen.filter((r) => r !== id) : [...chosen, id];
    setParams({ runs: next.join(",") || undefined, diff: undefined });
  };
  return html`
    <h2>Runs</h2>
    <div class="toolbar">
      <form
        onSubmit=${(e) => {
          e.preventDefault();
          setParams({ q: e.target.elements.q.value || undefined });
        }}
      >
        <label>search by config <input type="text" name="q" size="40" placeholder="learning_rate=1e-6,loss_type=grpo" value=${query} data-testid="config-search" /></label>
        <button type="submit">search</button>
        ${query && html` <button type="button" onClick=${() => setParams({ q: undefined })}>clear</button>`}
      </form>
      <label><input type="checkbox" checked=${showHidden} onChange=${(e) => setParams({ hidden: e.target.checked ? "1" : undefined })} /> show hidden</label>
      <button disabled=${chosen.length !== 2} onClick=${() => setParams({ diff: chosen.join(","), config: undefined })} data-testid="diff-configs">diff configs of the 2 compared runs</button>
      ${chosen.length > 0 && html`<a href=${href("metrics", { runs: chosen.join(",") })}>metrics of the compared runs →</a>`}
      <span class="muted">runs dirs: ${data.runs_dirs.join(", ")}</span>
    </div>
    <${ErrorBox} error=${searchError} />
    ${found && html`<${Message}>${found.size} run(s) match <code>${query}</code>.<//>`}
    ${data.runs.length === 0 && html`<${Message} kind="empty">No runs under ${data.runs_dirs.join(", ")} yet. Start one with <code>refractor train --config …</code>; it appears here.<//>`}
    <table data-testid="runs-table">
      <thead><tr><th>compare</th><th>run</th><th>status</th><th>created</th><th class="right">steps</th><th class="right">last reward</th><th>model</th><th>algorithm</th><th>engine</th><th>note</th><th></th></tr></thead>
      <tbody>
        ${rows.map((r) => {
          const i = chosen.indexOf(r.id);
          return html`<tr class=${r.hidden ? "hidden-run" : ""} data-run=${r.id}>
            <td><input type="checkbox" checked=${i >= 0} onChange=${() => toggle(r.id)} aria-label=${"compare " + r.id} />
              ${i >= 0 && html` <span class="dot" style=${{ background: runColor(i) }}></span>`}</td>
            <td><a href=${href("metrics", { runs: r.id })}>${r.name}</a>${r.id !== r.name && html` <span class="muted">(${r.id})</span>`}
              ${r.error && html`<div class="message error">${r.error}</div>`}</td>
            <td><span class="badge ${r.status}">${r.status}</span></td>
            <td>${fmtTime(r.created_at)}</td>
            <td class="right">${r.steps ?? "—"}</td>
            <td class="right">${fmt(r.last_reward)}</td>
            <td>${r.model}</td><td>${r.algorithm}</td><td>${r.engine}</td>
            <td><${Note} run=${r.id} note=${r.note} /></td>
            <td>
              ${!r.error && html`<button onClick=${() => setParams({ config: r.id, diff: undefined })}>config</button> `}
              <button onClick=${() => put("state/hidden", { run: r.id, hidden: !r.hidden }).then(() => setParams({}))}>${r.hidden ? "unhide" : "hide"}</button>
            </td>
          </tr>`;
        })}
      </tbody>
    </table>
    ${params.config && html`<${ConfigView} run=${params.config} />`}
    ${params.diff && html`<${ConfigDiff} pair=${listParam(params.diff)} />`}
  `;
}

function Note({ run, note }) {
  const [text, setText] = useState(note || "");
  const [saved, setSaved] = useState(true);
  useEffect(() => {
    if (saved) setText(note || "");
  }, [note]);
  return html`<textarea class="note" rows="1" value=${text} placeholder="note…" aria-label=${"note for " + run}
    onInput=${(e) => {
      setText(e.target.value);
      setSaved(false);
    }}
    onBlur=${() => put("state/notes", { run, text }).then(() => setSaved(true))}></textarea>`;
}

function flatten(obj, prefix = "", out = []) {
  if (obj && typeof obj === "object" && Object.keys(obj).length) {
    for (const [k, v] of Object.entries(obj)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else out.push([prefix, obj]);
  return out;
}

function ConfigView({ run }) {
  const { data, error } = useApi(`runs/${encodeURIComponent(run)}`);
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data) return html`<${Loading} what="config" />`;
  return html`<h3>Config of ${run} <button onClick=${() => setParams({ config: undefined })}>close</button></h3>
    <table data-testid="config-table"><tbody>
      ${flatten(data.config).map(([k, v]) => html`<tr><td><code>${k}</code></td><td><code>${JSON.stringify(v)}</code></td></tr>`)}
    </tbody></table>`;
}

function ConfigDiff({ pair }) {
  const [a, b] = pair;
  const { data, error } = useApi(a && b ? "config-diff" : null, { a, b });
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data) return html`<${Loading} what="config diff" />`;
  return html`<h3>Config: ${a} vs ${b} <button onClick=${() => setParams({ diff: undefined })}>close</button></h3>
    ${data.diff.length === 0 && html`<${Message}>The two resolved configs are identical.<//>`}
    <table data-testid="config-diff"><thead><tr><th>key</th><th>${a}</th><th>${b}</th></tr></thead><tbody>
      ${data.diff.map((d) => html`<tr><td><code>${d.key}</code></td>
        <td class=${d.only === "b" ? "muted" : "diff-del"}>${d.only === "b" ? "(absent)" : JSON.stringify(d.a)}</td>
        <td class=${d.only === "a" ? "muted" : "diff-add"}>${d.only === "a" ? "(absent)" : JSON.stringify(d.b)}</td></tr>`)}
    </tbody></table>`;
}
