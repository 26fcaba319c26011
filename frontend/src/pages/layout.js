// The custom metrics view: sections the user builds from the metric catalogue, charts reordered by
// drag and drop (within and across sections), saved by the dashboard server in its state folder
// so the layout is there again after a restart.
import { useEffect, useState } from "preact/hooks";
import { api, put } from "../api.js";
import { ErrorBox, html, Loading, Message } from "../ui.js";
import { MetricChart, OVERVIEW, useSeries } from "./metric_data.js";

export function CustomView({ runs, catalogue, params, opts }) {
  const [layout, setLayout] = useState(null);
  const [error, setError] = useState(null);
  useEffect(() => {
    api("state/layout").then(
      (d) => setLayout(d.layout || { sections: [{ title: "My charts", metrics: OVERVIEW.slice(0, 4) }] }),
      setError,
    );
  }, []);
  const save = (next) => {
    setLayout(next);
    put("state/layout", next).then(() => setError(null), setError);
  };
  const names = layout ? [...new Set(layout.sections.flatMap((s) => s.metrics))] : [];
  const { data, error: dataError } = useSeries(runs, names, params.env || "", opts.normalise);
  const [drag, setDrag] = useState(null);
  if (!layout) return error ? html`<${ErrorBox} error=${error} />` : html`<${Loading} what="layout" />`;
  const move = (to) => {
    if (!drag) return;
    const next = { sections: layout.sections.map((s) => ({ ...s, metrics: [...s.metrics] })) };
    const [name] = next.sections[drag.section].metrics.splice(drag.index, 1);
    next.sections[to.section].metrics.splice(to.index, 0, name);
    setDrag(null);
    save(next);
  };
  const edit = (i, change) => save({ sections: layout.sections.map((s, j) => (j === i ? { ...s, ...change } : s)) });
  return html`
    <${ErrorBox} error=${error || dataError} />
    <${Message}>Drag charts to reorder them; the layout is saved by the dashboard and comes back after a restart.<//>
    <datalist id="metric-names">${catalogue.map((n) => html`<option value=${n.name} />`)}</datalist>
    ${layout.sections.map(
      (s, i) => html`<div class="layout-section" data-section=${i}
        onDragOver=${(e) => e.preventDefault()}
        onDrop=${(e) => {
          e.preventDefault();
          move({ section: i, index: s.metrics.length });
        }}>
        <div class="toolbar">
          <input type="text" value=${s.title} onChange=${(e) => edit(i, { title: e.target.value })} aria-label="section title" />
          <form onSubmit=${(e) => {
            e.preventDefault();
            const name = e.target.elements.metric.value;
            if (name && !s.metrics.includes(name)) edit(i, { metrics: [...s.metrics, name] });
            e.target.reset();
          }}>
            <input type="text" name="metric" list="metric-names" placeholder="add a metric…" data-testid="add-metric" />
            <button type="submit">add</button>
          </form>
          <button onClick=${() => save({ sections: layout.sections.filter((_, j) => j !== i) })}>remove section</button>
        </div>
        <div class="grid">
          ${s.metrics.map(
            (name, k) => html`<div draggable="true" data-metric=${name}
              onDragStart=${() => setDrag({ section: i, index: k })}
              onDragOver=${(e) => e.preventDefault()}
              onDrop=${(e) => {
                e.preventDefault();
                e.stopPropagation();
                move({ section: i, index: k });
              }}>
              <${MetricChart} name=${name} runs=${runs} data=${data} opts=${opts} testid=${"custom-" + name} />
              <button onClick=${() => edit(i, { metrics: s.metrics.filter((m) => m !== name) })}>remove</button>
            </div>`,
          )}
        </div>
      </div>`,
    )}
    <button onClick=${() => save({ sections: [...layout.sections, { title: "New section", metrics: [] }] })} data-testid="add-section">add a section</button>
  `;
}
