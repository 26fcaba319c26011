// Hash routing: `#/<page>?key=value&...`. Every page's state (runs, step, filters, window) lives in
// the query, so a URL can be bookmarked and shared.
import { useEffect, useState } from "preact/hooks";

export function parseHash() {
  const raw = window.location.hash.replace(/^#\/?/, "");
  const [page, query = ""] = raw.split("?");
  return { page: page || "runs", params: Object.fromEntries(new URLSearchParams(query)) };
}

export function href(page, params = {}) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "" && v !== false) query.set(k, v === true ? "1" : v);
  }
  const qs = query.toString();
  return `#/${page}${qs ? "?" + qs : ""}`;
}

// Replace some query keys of the current page (undefined removes a key).
export function setParams(changes, push = false) {
  const { page, params } = parseHash();
  const next = href(page, { ...params, ...changes });
  if (push) window.location.hash = next;
  else history.replaceState(null, "", next);
  window.dispatchEvent(new Event("hashchange"));
}

export function useRoute() {
  const [route, setRoute] = useState(parseHash());
  useEffect(() => {
    const on = () => setRoute(parseHash());
    window.addEventListener("hashchange", on);
    return () => window.removeEventListener("hashchange", on);
  }, []);
  return route;
}

export function listParam(value) {
  return (value || "").split(",").filter(Boolean);
}
