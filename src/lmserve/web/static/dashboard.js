// The live dashboard: one SSE feed (/v1/dashboard/stream), canvas charts drawn here (no library).
import { AuthError, fmtMs, setupKeyForm, streamSSE } from "/static/api.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 120; // points in the time-series charts
const series = { running: [], waiting: [], prefill: [], decode: [] };
let lastMap = null;
let updates = 0;
let controller = null;
const keyForm = setupKeyForm($("key-form"), () => connect());

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function css(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function push(arr, v) {
  arr.push(v);
  if (arr.length > HISTORY) arr.shift();
}

function lineChart(canvas, lines) {
  const ctx = canvas.getContext("2d");
  const { width: w, height: h } = canvas;
  ctx.clearRect(0, 0, w, h);
  const max = Math.max(1, ...lines.flatMap((l) => l.data));
  ctx.fillStyle = css("--muted");
  ctx.font = "11px sans-serif";
  ctx.fillText(String(max), 2, 11);
  for (const { data, color } of lines) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    data.forEach((v, i) => {
      const x = (i / (HISTORY - 1)) * w;
      const y = h - 2 - (v / max) * (h - 16);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  }
}

function stackedBars(canvas, a, b, colorA, colorB) {
  const ctx = canvas.getContext("2d");
  const { width: w, height: h } = canvas;
  ctx.clearRect(0, 0, w, h);
  const max = Math.max(1, ...a.map((v, i) => v + b[i]));
  const bw = w / HISTORY;
  ctx.fillStyle = css("--muted");
  ctx.font = "11px sans-serif";
  ctx.fillText(String(max), 2, 11);
  a.forEach((va, i) => {
    const ha = (va / max) * (h - 16);
    const hb = (b[i] / max) * (h - 16);
    ctx.fillStyle = colorB;
    ctx.fillRect(i * bw, h - hb, bw - 1, hb);
    ctx.fillStyle = colorA;
    ctx.fillRect(i * bw, h - hb - ha, bw - 1, ha);
  });
}

function histogram(canvas, buckets) {
  const ctx = canvas.getContext("2d");
  const { width: w, height: h } = canvas;
  ctx.clearRect(0, 0, w, h);
  // from the first to the last non-empty bucket
  const first = buckets.findIndex((b) => b[1] > 0);
  if (first < 0) return;
  let last = buckets.length - 1;
  while (buckets[last][1] === 0) last--;
  const shown = buckets.slice(first, last + 1);
  const max = Math.max(...shown.map((b) => b[1]));
  const bw = w / shown.length;
  ctx.fillStyle = css("--c1");
  shown.forEach(([, n], i) => {
    const bh = (n / max) * (h - 2);
    ctx.fillRect(i * bw + 1, h - bh, bw - 2, bh);
  });
  canvas.title = shown.map(([le, n]) => `≤ ${le === null ? "∞" : fmtMs(le)}: ${n}`).join("\n");
}

function ownerColor(i) {
  const hue = (i * 137.508) % 360; // golden angle: neighbouring owners get distant hues
  return `hsl(${hue}, 65%, 55%)`;
}

function blockGeometry(canvas, n) {
  const cols = Math.max(1, Math.ceil(Math.sqrt((n * canvas.width) / canvas.height)));
  const cell = Math.max(2, Math.floor(canvas.width / cols));
  return { cols, cell };
}

function drawBlockMap(map, kv) {
  const canvas = $("blockmap");
  const ctx = canvas.getContext("2d");
  const n = map.owners.length;
  const { cols, cell } = blockGeometry(canvas, n);
  const rows = Math.ceil(n / cols);
  if (canvas.height !== rows * cell) canvas.height = rows * cell;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const gap = cell > 5 ? 1 : 0;
  for (let b = 0; b < n; b++) {
    const x = (b % cols) * cell;
    const y = Math.floor(b / cols) * cell;
    const owner = map.owners[b];
    ctx.fillStyle = owner >= 0 ? ownerColor(owner) : map.cached[b] ? css("--cached") : css("--free");
    ctx.fillRect(x, y, cell - gap, cell - gap);
    if (map.ref_counts[b] > 1) { // shared: a white centre
      ctx.fillStyle = "#fff";
      const s = Math.max(1, Math.floor(cell / 3));
      ctx.fillRect(x + s, y + s, cell - gap - 2 * s, cell - gap - 2 * s);
    }
  }
  const used = map.ref_counts.filter((r) => r > 0).length;
  canvas.dataset.used = String(used);
  canvas.dataset.shared = String(map.ref_counts.filter((r) => r > 1).length);
  $("blockmap-caption").textContent =
    `${n} blocks of ${kv.block_size} tokens (${kv.dtype}) · ${used} used · ${map.request_ids.length} requests`;
}

function blockTooltip(ev) {
  const tip = $("tooltip");
  const canvas = $("blockmap");
  if (!lastMap) { tip.hidden = true; return; }
  const r = canvas.getBoundingClientRect();
  const { cols, cell } = blockGeometry(canvas, lastMap.owners.length);
  const scale = canvas.width / r.width;
  const col = Math.floor(((ev.clientX - r.left) * scale) / cell);
  const row = Math.floor(((ev.clientY - r.top) * scale) / cell);
  const b = row * cols + col;
  if (col >= cols || b >= lastMap.owners.length) { tip.hidden = true; return; }
  const owner = lastMap.owners[b];
  tip.replaceChildren(
    el("div", "tip-head", `block ${b}`),
    el("div", "", owner >= 0 ? `owner ${lastMap.request_ids[owner]}` : "free"),
    el("div", "", `ref count ${lastMap.ref_counts[b]}${lastMap.cached[b] ? " · cached prefix block" : ""}`),
  );
  tip.hidden = false;
  tip.style.left = `${ev.clientX + 12}px`;
  tip.style.top = `${ev.clientY + 16}px`;
}

function renderLatency(lat) {
  const body = $("latency-rows");
  body.replaceChildren();
  for (const [key, label] of [["ttft", "TTFT"], ["tpot", "TPOT"], ["itl", "ITL"], ["e2e", "E2E"], ["queue", "queue"]]) {
    const d = lat[key];
    const row = el("tr");
    row.append(el("th", "", label), el("td", "num", d ? String(d.count) : "0"),
      el("td", "num", fmtMs(d && d.p50)), el("td", "num", fmtMs(d && d.p95)), el("td", "num", fmtMs(d && d.p99)));
    const cell = el("td");
    const canvas = el("canvas", "hist");
    canvas.width = 220;
    canvas.height = 28;
    cell.append(canvas);
    row.append(cell);
    body.append(row);
    if (d && d.buckets) histogram(canvas, d.buckets);
  }
}

function renderDiagnosis(dx) {
  const box = $("diagnosis");
  box.replaceChildren();
  if (!dx.findings.length) {
    box.append(el("p", "healthy", "no bottleneck found"));
  }
  for (const f of dx.findings) {
    const item = el("div", "finding");
    item.append(el("div", "symptom", f.symptom), el("div", "", `most likely cause: ${f.cause}`));
    const ul = el("ul");
    for (const e of f.evidence) ul.append(el("li", "", e));
    item.append(ul, el("div", "change", `change: ${f.change}`));
    box.append(item);
  }
  const summary = el("p", "summary", dx.summary.join(" · "));
  box.append(summary);
}

function render(u) {
  updates++;
  document.body.dataset.updates = String(updates);
  $("running").textContent = String(u.running);
  // LoRA: running sequences per adapter ("" = the base model), only when the server has adapters
  $("running-sub").textContent = u.running_by_lora ? Object.entries(u.running_by_lora)
    .map(([name, n]) => `${name || "base"} ${n}`).join(" · ") : "";
  $("waiting").textContent = String(u.waiting);
  $("step-tokens").textContent = `${u.step.prefill_tokens} / ${u.step.decode_tokens}`;
  // a mixture-of-experts model: each layer group's busiest expert over the mean (1.0 = even routing)
  $("step-sub").textContent = u.moe_imbalance ? "expert load max/mean " + Object.entries(u.moe_imbalance)
    .map(([g, r]) => `L${g} ${r.toFixed(2)}`).join(" · ") : "";
  $("kv-blocks").textContent = `${u.kv.used} / ${u.kv.free}`;
  const disk = u.kv.disk ? ` · disk ${(u.kv.disk.used_bytes / 2 ** 30).toFixed(2)} / ` +
    `${(u.kv.disk.capacity_bytes / 2 ** 30).toFixed(1)} GiB, ${u.kv.disk.num_blocks} blocks, ` +
    `${u.kv.disk.hit_tokens} tokens served` : "";
  $("kv-sub").textContent = (u.kv.cached_free === null ? `of ${u.kv.num_blocks}` :
    `of ${u.kv.num_blocks} · ${u.kv.cached_free} free but cached · ${u.kv.shared} shared`) + disk;
  $("hit-rate").textContent = u.prefix_hit_rate === null ? "–" : `${(100 * u.prefix_hit_rate).toFixed(1)} %`;
  $("preemptions").textContent = `${u.preemptions_window} / ${u.preemptions_total}`;
  $("throughput").textContent = u.throughput.generation_tok_s.toFixed(1);
  $("throughput-sub").textContent =
    `prefill ${u.throughput.prefill_tok_s.toFixed(0)} · decode ${u.throughput.decode_tok_s.toFixed(0)} tok/s · ${u.throughput.steps_s.toFixed(1)} steps/s`;
  $("window").textContent = u.window_s.toFixed(0);
  push(series.running, u.running);
  push(series.waiting, u.waiting);
  push(series.prefill, u.step.prefill_tokens);
  push(series.decode, u.step.decode_tokens);
  lineChart($("chart-requests"), [{ data: series.running, color: css("--c1") }, { data: series.waiting, color: css("--c2") }]);
  stackedBars($("chart-tokens"), series.prefill, series.decode, css("--c3"), css("--c1"));
  renderLatency(u.latency);
  if (u.block_map) {
    lastMap = u.block_map;
    drawBlockMap(u.block_map, u.kv);
  }
  renderDiagnosis(u.diagnosis);
}

async function connect() {
  if (controller) controller.abort();
  controller = new AbortController();
  const mine = controller;
  $("conn").textContent = "connecting…";
  try {
    await streamSSE("/v1/dashboard/stream", { signal: mine.signal }, (u) => {
      $("conn").textContent = `live · ${u.model}`;
      $("conn").className = "conn live";
      keyForm.ok();
      render(u);
    });
    $("conn").textContent = "feed ended";
  } catch (e) {
    if (mine.signal.aborted) return;
    $("conn").className = "conn";
    if (e instanceof AuthError) {
      keyForm.askForKey("the dashboard needs the server's API key");
      $("conn").textContent = "needs an API key";
      return;
    }
    $("conn").textContent = `disconnected (${e.message}); retrying`;
  }
  if (!mine.signal.aborted) setTimeout(connect, 2000);
}

$("blockmap").addEventListener("mousemove", blockTooltip);
$("blockmap").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
connect();
