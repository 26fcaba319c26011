// Pieces several pages share: picking the run a single-run page shows, and saying plainly when
// no run is chosen or the run lacks the page's data.
import { setParams } from "../route.js";
import { html, Message } from "../ui.js";

export function NoRun() {
  return html`<${Message} kind="empty"
    >No run chosen. Pick one or more runs on the <a href="#/runs">Runs page</a> (tick “compare”).<//
  >`;
}

export function Lacks({ what }) {
  return html`<${Message} kind="empty">This run has no ${what} recorded (an older run, or one that has not written
    any yet).<//>`;
}

// The run a single-run page shows: `run` in the query, else the first compared run.
export function pickRun(params, runs) {
  return params.run && runs.includes(params.run) ? params.run : params.run || runs[0] || "";
}

export function RunPicker({ runs, run }) {
  if (runs.length < 2) return null;
  return html`<label
    >run
    <select value=${run} onChange=${(e) => setParams({ run: e.target.value })} data-testid="run-picker">
      ${runs.map((r) => html`<option value=${r}>${r}</option>`)}
    </select></label
  >`;
}
