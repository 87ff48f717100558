// The playground: chat / completion through the /v1 SSE endpoints with logprobs, token by token.
// Model output only ever goes into the page as text (textContent), never as HTML.
import { AuthError, fmtMs, setupKeyForm, streamSSE } from "/static/api.js";

const $ = (id) => document.getElementById(id);
const TOP_LOGPROBS = 5;
let history = []; // chat messages so far
let controller = null;
const keyForm = setupKeyForm($("key-form"));

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function numberOr(id, parse, fallback) {
  const v = $(id).value.trim();
  if (v === "") return fallback;
  const n = parse(v);
  return Number.isFinite(n) ? n : fallback;
}

function samplingFields() {
  const body = {
    temperature: numberOr("temperature", parseFloat, undefined),
    top_p: numberOr("top_p", parseFloat, undefined),
    top_k: numberOr("top_k", (v) => parseInt(v, 10), undefined),
    min_p: numberOr("min_p", parseFloat, undefined),
    max_tokens: numberOr("max_tokens", (v) => parseInt(v, 10), undefined),
    seed: numberOr("seed", (v) => parseInt(v, 10), undefined),
  };
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  for (const k of Object.keys(body)) if (body[k] === undefined) delete body[k];
  return body;
}

function probClass(logprob) {
  const p = Math.exp(logprob);
  return p >= 0.7 ? "p-hi" : p >= 0.3 ? "p-mid" : "p-lo";
}

// One reply: spans appended as chunks arrive, plus its timing line.
class Reply {
  constructor(container, label) {
    this.box = el("div", "message assistant");
    this.box.append(el("div", "role", label));
    this.text = el("div", "text");
    this.stats = el("div", "stats", "waiting for the first token…");
    this.box.append(this.text, this.stats);
    container.append(this.box);
    this.t0 = performance.now();
    this.tFirst = null;
    this.tLast = null;
    this.numTokens = 0;
    this.cached = null;
    this.content = "";
    this.thinking = null; // <details> folded above the answer, made by the first reasoning delta
  }

  // text: new reasoning (delta.reasoning_content), shown folded above the answer
  addReasoning(text, entries) {
    if (!text) return;
    if (this.thinking === null) {
      this.thinking = el("details", "reasoning");
      this.thinking.append(el("summary", null, "reasoning"), el("div", "text"));
      this.box.insertBefore(this.thinking, this.text);
    }
    this.thinking.lastChild.append(el("span", "tok", text));
    this.countTokens(entries.length || 1);
  }

  countTokens(n) {
    const now = performance.now();
    if (this.tFirst === null) this.tFirst = now;
    this.tLast = now;
    this.numTokens += n;
    this.showStats(false);
  }

  // text: the chunk's new text; entries: [{token, logprob, top: [[token, logprob], ...]}]
  add(text, entries) {
    if (!text && !entries.length) return;
    const now = performance.now();
    if (this.tFirst === null) this.tFirst = now;
    this.tLast = now;
    this.numTokens += Math.max(entries.length, text ? 1 : 0);
    this.content += text;
    const span = el("span", "tok", text);
    if (entries.length) {
      span.classList.add(probClass(entries[0].logprob));
      span.tokenInfo = entries;
    }
    this.text.append(span);
    this.box.parentElement.scrollTop = this.box.parentElement.scrollHeight;
    this.showStats(false);
  }

  showStats(done) {
    const ttft = this.tFirst === null ? null : (this.tFirst - this.t0) / 1000;
    const decodeS = this.tFirst === null ? 0 : (this.tLast - this.tFirst) / 1000;
    const itl = this.numTokens > 1 ? decodeS / (this.numTokens - 1) : null;
    const tps = this.numTokens > 1 && decodeS > 0 ? (this.numTokens - 1) / decodeS : null;
    const parts = [`TTFT ${fmtMs(ttft)}`, `mean ITL ${fmtMs(itl)}`, `${tps === null ? "–" : tps.toFixed(1)} tok/s`,
      `${this.numTokens} tokens`];
    if (this.cached !== null) parts.push(`prefix-cache hit ${this.cached} tokens`);
    this.stats.textContent = parts.join(" · ") + (done ? "" : " …");
  }
}

function chatEntries(logprobs) {
  if (!logprobs || !logprobs.content) return [];
  return logprobs.content.map((c) => ({
    token: c.token, logprob: c.logprob, top: (c.top_logprobs || []).map((t) => [t.token, t.logprob]),
  }));
}

function completionEntries(logprobs) {
  if (!logprobs || !logprobs.tokens) return [];
  return logprobs.tokens.map((token, i) => ({
    token,
    logprob: logprobs.token_logprobs[i],
    top: Object.entries((logprobs.top_logprobs || [])[i] || {}).sort((a, b) => b[1] - a[1]),
  }));
}

async function send(ev) {
  ev.preventDefault();
  const prompt = $("prompt").value;
  const mode = $("mode").value;
  if (!prompt.trim() && mode === "chat") return;
  $("error").textContent = "";
  const transcript = $("transcript");
  let url, body;
  const common = { stream: true, stream_options: { include_usage: true }, ...samplingFields() };
  if (mode === "chat") {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    history.push({ role: "user", content: prompt });
    messages.push(...history);
    const user = el("div", "message user");
    user.append(el("div", "role", "user"), el("div", "text", prompt));
    transcript.append(user);
    url = "/v1/chat/completions";
    body = { messages, logprobs: true, top_logprobs: TOP_LOGPROBS, ...common };
  } else {
    const p = el("div", "message user");
    p.append(el("div", "role", "prompt"), el("div", "text", prompt));
    transcript.append(p);
    url = "/v1/completions";
    body = { prompt, logprobs: TOP_LOGPROBS, ...common };
  }
  $("prompt").value = "";
  const reply = new Reply(transcript, mode === "chat" ? "assistant" : "completion");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop-btn").disabled = false;
  try {
    await streamSSE(url, { method: "POST", body, signal: controller.signal }, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage && chunk.usage.prompt_tokens_details) reply.cached = chunk.usage.prompt_tokens_details.cached_tokens;
      for (const choice of chunk.choices || []) {
        if (mode === "chat" && choice.delta && choice.delta.reasoning_content) {
          reply.addReasoning(choice.delta.reasoning_content, chatEntries(choice.logprobs));
        } else if (mode === "chat") reply.add((choice.delta && choice.delta.content) || "", chatEntries(choice.logprobs));
        else reply.add(choice.text || "", completionEntries(choice.logprobs));
      }
    });
    keyForm.ok();
  } catch (e) {
    if (e instanceof AuthError) keyForm.askForKey("this server needs an API key: set it above and send again");
    else if (e.name !== "AbortError") $("error").textContent = String(e.message || e);
    if (mode === "chat" && !reply.content) history.pop();
  } finally {
    if (mode === "chat" && reply.content) history.push({ role: "assistant", content: reply.content });
    reply.showStats(true);
    controller = null;
    $("send").disabled = false;
    $("stop-btn").disabled = true;
  }
}

function showTooltip(ev) {
  const span = ev.target.closest(".tok");
  const tip = $("tooltip");
  if (!span || !span.tokenInfo) { tip.hidden = true; return; }
  tip.replaceChildren();
  for (const e of span.tokenInfo) {
    tip.append(el("div", "tip-head", `${JSON.stringify(e.token)}  logprob ${e.logprob.toFixed(3)}  p=${(100 * Math.exp(e.logprob)).toFixed(1)}%`));
    const table = el("table");
    for (const [tok, lp] of e.top) {
      const row = el("tr");
      row.append(el("td", "", JSON.stringify(tok)), el("td", "num", lp.toFixed(3)), el("td", "num", `${(100 * Math.exp(lp)).toFixed(1)}%`));
      table.append(row);
    }
    tip.append(table);
  }
  tip.hidden = false;
  tip.style.left = `${Math.min(ev.clientX + 12, window.innerWidth - 320)}px`;
  tip.style.top = `${ev.clientY + 16}px`;
}

function setMode() {
  document.body.dataset.mode = $("mode").value;
}

$("prompt-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("prompt-form").requestSubmit(); }
});
$("stop-btn").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { history = []; $("transcript").replaceChildren(); });
$("mode").addEventListener("change", setMode);
$("transcript").addEventListener("mouseover", showTooltip);
$("transcript").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
setMode();
