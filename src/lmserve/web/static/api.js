// Talking to the lmserve server: the API key (kept in sessionStorage, sent as a Bearer header, never in a URL)
// and Server-Sent Events read from a fetch() body (EventSource cannot send headers).

const KEY_ITEM = "lmserve-api-key";

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  else sessionStorage.removeItem(KEY_ITEM);
}

export function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

export class AuthError extends Error {}

// The key form in the page header: shows the stored key's state, stores a new one, and is opened on a 401.
export function setupKeyForm(form, onChange) {
  const input = form.querySelector("input");
  const status = form.querySelector(".key-status");
  const show = (msg) => { status.textContent = msg || (apiKey() ? "key set" : "no key"); };
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    setApiKey(input.value.trim());
    input.value = "";
    show();
    if (onChange) onChange();
  });
  show();
  return {
    askForKey(msg) {
      form.classList.add("needs-key");
      show(msg || "this server needs an API key");
      input.focus();
    },
    ok() { form.classList.remove("needs-key"); show(); },
  };
}

// POST (or GET) and call onEvent(obj) for every `data:` JSON event until [DONE] or the end of the body.
export async function streamSSE(url, { method = "GET", body, signal } = {}, onEvent) {
  const init = { method, signal, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const resp = await fetch(url, init);
  if (resp.status === 401) throw new AuthError("missing or invalid API key");
  if (!resp.ok) {
    let msg = `${resp.status} ${resp.statusText}`;
    try { msg = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(msg);
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

export function fmtMs(s) {
  return s === null || s === undefined ? "–" : `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms`;
}
