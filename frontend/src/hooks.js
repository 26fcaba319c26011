import { useEffect, useRef, useState } from "preact/hooks";
import { api } from "./api.js";

// Fetch one API path; re-fetches when `key` changes. `path` null: nothing to fetch.
export function useApi(path, params = {}, key = "") {
  const [state, setState] = useState({ data: null, error: null, loading: !!path });
  const depKey = `${path}|${JSON.stringify(params)}|${key}`;
  useEffect(() => {
    if (!path) {
      setState({ data: null, error: null, loading: false });
      return;
    }
    let live = true;
    setState((s) => ({ ...s, loading: true }));
    api(path, params).then(
      (data) => live && setState({ data, error: null, loading: false }),
      (error) => live && setState({ data: null, error, loading: false }),
    );
    return () => {
      live = false;
    };
  }, [depKey]);
  return state;
}

// Poll a run's cursor (its newest step, rollout, event and log) every `ms`; the returned value
// changes only when the run wrote something, so pages re-fetch just then.
export function useCursor(runId, ms = 1500) {
  const [cursor, setCursor] = useState(null);
  const last = useRef("");
  useEffect(() => {
    if (!runId) return;
    let stop = false;
    let timer = null;
    const tick = async () => {
      try {
        const c = await api(`runs/${encodeURIComponent(runId)}/cursor`);
        const sig = JSON.stringify(c);
        if (sig !== last.current) {
          last.current = sig;
          setCursor(c);
        }
      } catch (_) {
        // the page shows errors of its own requests; a missed poll is retried
      }
      if (!stop) timer = setTimeout(tick, ms);
    };
    tick();
    return () => {
      stop = true;
      clearTimeout(timer);
    };
  }, [runId]);
  return cursor;
}

// A key for re-fetching what a page shows of a live run: "0" at first, then a new value each time
// `pick(cursor)` changes after the first cursor seen (so a page's first fetch is not repeated when
// the first cursor arrives).
export function useLiveKey(runId, pick, ms = 1500) {
  const cursor = useCursor(runId, ms);
  const last = useRef(undefined);
  const [key, setKey] = useState(0);
  useEffect(() => {
    if (!cursor) return;
    const value = pick(cursor);
    if (last.current !== undefined && value !== last.current) setKey((k) => k + 1);
    last.current = value;
  }, [cursor]);
  return String(key);
}
