// The run's code snapshot: its roots (with git state), its files, and a diff against another run.
import { enc } from "../api.js";
import { useApi } from "../hooks.js";
import { setParams } from "../route.js";
import { ErrorBox, html, Loading, Message } from "../ui.js";
import { Lacks, NoRun, pickRun, RunPicker } from "./common.js";

export function CodePage({ params, runs }) {
  const run = pickRun(params, runs);
  const code = useApi(run ? `runs/${enc(run)}/code` : null);
  if (!run) return html`<${NoRun} />`;
  if (code.error) return html`<${ErrorBox} error=${code.error} />`;
  if (!code.data) return html`<${Loading} what="code snapshot" />`;
  if (!code.data.info) return html`<h2>Code</h2><${Lacks} what="code snapshot" />`;
  const others = runs.filter((r) => r !== run);
  return html`<h2>Code</h2>
    <div class="toolbar"><${RunPicker} runs=${runs} run=${run} />
      ${code.data.info.roots.map((r) => html`<span class="chip">${r.label}${r.git ? ` @ ${(r.git.commit || "").slice(0, 10)}${r.git.dirty ? " (dirty)" : ""}` : ""}</span>`)}
      <span class="muted">${code.data.files.length} files</span>
      ${others.length > 0 && html`<label>diff against <select value=${params.against || ""} onChange=${(e) => setParams({ against: e.target.value || undefined })} data-testid="code-against">
        <option value="">—</option>${others.map((r) => html`<option value=${r}>${r}</option>`)}</select></label>`}
    </div>
    ${params.against ? html`<${CodeDiff} a=${params.against} b=${run} />` : html`<div class="split">
      <div class="panel code-files" data-testid="code-files">${code.data.files.map(
        (f) => html`<div class=${params.file === `${f.root}/${f.path}` ? "selected" : ""} onClick=${() => setParams({ file: `${f.root}/${f.path}` })}>${f.root}/${f.path}</div>`,
      )}</div>
      <div class="panel">${params.file ? html`<${CodeFile} run=${run} file=${params.file} files=${code.data.files} />` : html`<span class="muted">Pick a file.</span>`}</div>
    </div>`}`;
}

function CodeFile({ run, file, files }) {
  const f = files.find((x) => `${x.root}/${x.path}` === file);
  const { data, error } = useApi(f ? `runs/${enc(run)}/code/file` : null, f ? { root: f.root, path: f.path } : {});
  if (!f) return html`<${Message} kind="error">The snapshot has no file ${file}.<//>`;
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data) return html`<${Loading} />`;
  return html`<b>${file}</b><pre data-testid="code-text">${data.text}</pre>`;
}

function DiffText({ text }) {
  return html`<pre>${text.split("\n").map((l) => html`<div class=${l.startsWith("@@") ? "diff-hunk" : l.startsWith("+") ? "diff-add" : l.startsWith("-") ? "diff-del" : ""}>${l}</div>`)}</pre>`;
}

function CodeDiff({ a, b }) {
  const { data, error } = useApi("code-diff", { a, b });
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data) return html`<${Loading} what="diff" />`;
  if (data.same) return html`<${Message}>The code snapshots of ${a} and ${b} are the same.<//>`;
  return html`<div data-testid="code-diff">${["changed", "added", "removed"].map(
    (kind) => data[kind].length > 0 && html`<h3>${kind} (${data[kind].length})</h3>${data[kind].map((c) => html`<div class="panel"><b>${c.root}/${c.path}</b><${DiffText} text=${c.diff} /></div>`)}`,
  )}</div>`;
}
