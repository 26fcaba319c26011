// Model text as the user wants to read it: Markdown (marked), LaTeX (KaTeX) and <think> blocks
// folded, all sanitised by DOMPurify before it reaches the page; or the raw text as it was.
import DOMPurify from "dompurify";
import katex from "katex";
import { marked } from "marked";
import { html } from "./ui.js";

marked.setOptions({ gfm: true, breaks: true });

const MATH = /\$\$([\s\S]+?)\$\$|\\\[([\s\S]+?)\\\]|\\\(([\s\S]+?)\\\)|\$([^\s$](?:[^$\n]*?[^\s$])?)\$/g;

function renderMath(text, store) {
  return text.replace(MATH, (whole, dd, br, pa, d) => {
    const tex = dd ?? br ?? pa ?? d;
    const display = dd !== undefined || br !== undefined;
    let out;
    try {
      out = katex.renderToString(tex, { displayMode: display, throwOnError: false, output: "html" });
    } catch (_) {
      out = whole;
    }
    store.push(out);
    return `@@MATH${store.length - 1}@@`;
  });
}

function renderBlock(text) {
  const math = [];
  const withPlaceholders = renderMath(text, math);
  let out = marked.parse(withPlaceholders);
  out = out.replace(/@@MATH(\d+)@@/g, (_, i) => math[Number(i)]);
  return out;
}

export function renderModelText(text) {
  const parts = [];
  const re = /<think>([\s\S]*?)(<\/think>|$)/g;
  let last = 0;
  let m;
  while ((m = re.exec(text || "")) !== null) {
    if (m.index > last) parts.push(renderBlock(text.slice(last, m.index)));
    parts.push(`<details class="think"><summary>thinking</summary>${renderBlock(m[1])}</details>`);
    last = re.lastIndex;
    if (m[0].length === 0) break;
  }
  if (last < (text || "").length) parts.push(renderBlock(text.slice(last)));
  return DOMPurify.sanitize(parts.join(""));
}

export function ModelText({ text, raw }) {
  if (raw) return html`<pre class="raw">${text}</pre>`;
  return html`<div class="rendered" dangerouslySetInnerHTML=${{ __html: renderModelText(text) }}></div>`;
}
