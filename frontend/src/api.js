// Calls to the dashboard's JSON API. A failed call throws an Error whose message is the server's
// one-line reason, which pages show as they are.
export async function api(path, params = {}) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "") query.set(k, v);
  }
  const qs = query.toString();
  let resp;
  try {
    resp = await fetch(`/api/${path}${qs ? "?" + qs : ""}`);
  } catch (err) {
    throw new Error(`the dashboard server does not answer (${err.message}); is refractor ui still running?`);
  }
  return decode(resp);
}

export async function put(path, body) {
  const resp = await fetch(`/api/${path}`, {
    method: "PUT",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  return decode(resp);
}

async function decode(resp) {
  let data = null;
  try {
    data = await resp.json();
  } catch (_) {
    data = null;
  }
  if (!resp.ok) throw new Error((data && data.error) || `HTTP ${resp.status}`);
  return data;
}

export const enc = encodeURIComponent;
