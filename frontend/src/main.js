// The dashboard's shell: the page bar, the runs being compared (each with its colour) and the
// page of the current hash route.
import "./style.css";
import { render } from "preact";
import { CodePage } from "./pages/code.js";
import { EvalsPage } from "./pages/evals.js";
import { InfraPage } from "./pages/infra.js";
import { LogsPage } from "./pages/logs.js";
import { MetricsPage } from "./pages/metrics.js";
import { RolloutsPage } from "./pages/rollouts.js";
import { RunsPage } from "./pages/runs.js";
import { TimelinePage } from "./pages/timeline.js";
import { TopologyPage } from "./pages/topology.js";
import { href, listParam, useRoute } from "./route.js";
import { html, Message, runColor } from "./ui.js";

const PAGES = {
  runs: ["Runs", RunsPage],
  metrics: ["Metrics", MetricsPage],
  rollouts: ["Rollouts", RolloutsPage],
  timeline: ["Timeline", TimelinePage],
  infra: ["Infra", InfraPage],
  topology: ["Topology", TopologyPage],
  evals: ["Evals", EvalsPage],
  logs: ["Logs", LogsPage],
  code: ["Code", CodePage],
};

function App() {
  const { page, params } = useRoute();
  const runs = listParam(params.runs);
  const entry = PAGES[page];
  const Page = entry && entry[1];
  return html`
    <header class="top">
      <span class="brand">refractor</span>
      <nav class="pages">
        ${Object.entries(PAGES).map(
          ([key, [label]]) =>
            html`<a href=${href(key, { runs: params.runs })} class=${key === page ? "active" : ""} data-page=${key}
              >${label}</a
            >`,
        )}
      </nav>
      <div class="runs-chosen">
        ${runs.map((r, i) => html`<span class="chip"><span class="dot" style=${{ background: runColor(i) }}></span>${r}</span>`)}
      </div>
    </header>
    <main>
      ${Page
        ? html`<${Page} params=${params} runs=${runs} />`
        : html`<${Message} kind="error">There is no page “${page}”. <a href="#/runs">Go to the runs.</a><//>`}
    </main>
  `;
}

const root = document.getElementById("app");
root.textContent = ""; // the "Loading" placeholder of index.html
render(html`<${App} />`, root);
