// The coordinator's page: a playground that streams from the API, and a
// live view of the cluster from /v1/workers and /metrics. Plain browser
// JavaScript, no build step and no CDN, so it works offline.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "tinyvllm-api-key";
const POLL_MS = 2000;

const state = {
  model: null,
  chat: [],          // the conversation so far, for chat mode
  abort: null,       // the running request's AbortController
  lastTokens: null,  // [time, tokens generated] from the previous poll
  workerNames: null, // names seen in the previous poll
  redispatches: null,
  events: [],        // recent joins, departures and failovers
};

function headers() {
  const h = { "content-type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.authorization = "Bearer " + key;
  return h;
}

async function api(path, body) {
  const init = body === undefined ? { headers: headers() } : { method: "POST", headers: headers(), body: JSON.stringify(body) };
  const resp = await fetch(path, init);
  if (resp.status === 401) throw new Error("this server needs an API key: enter it above");
  return resp;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return resp.status + " " + resp.statusText;
  }
}

// ---- Playground -----------------------------------------------------------

function addTurn(who, cls) {
  const turn = document.createElement("div");
  turn.className = "turn " + cls;
  const name = document.createElement("span");
  name.className = "who";
  name.textContent = who;
  const thinking = document.createElement("span");
  thinking.className = "thinking";
  thinking.hidden = true;
  const text = document.createElement("span");
  text.className = "text";
  const meta = document.createElement("span");
  meta.className = "meta";
  turn.append(name, thinking, text, meta);
  $("transcript").append(turn);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return { turn, thinking, text, meta };
}

function samplingFields() {
  const fields = {
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Math.max(1, Math.floor(Number($("max-tokens").value))),
    stream: true,
    stream_options: { include_usage: true },
  };
  const stop = $("stop").value.replace(/\\n/g, "\n");
  if (stop) fields.stop = [stop];
  return fields;
}

// Reads an SSE response, calling onData with each `data:` JSON payload.
async function readEvents(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || state.abort) return;
  const chat = $("mode").value === "chat";
  const user = addTurn(chat ? "you" : "prompt", "user");
  user.text.textContent = prompt;
  const reply = addTurn(state.model || "model", "assistant");
  const body = samplingFields();
  let path;
  if (chat) {
    state.chat.push({ role: "user", content: prompt });
    body.messages = state.chat;
    path = "/v1/chat/completions";
  } else {
    body.prompt = prompt;
    path = "/v1/completions";
  }
  $("prompt").value = "";
  state.abort = new AbortController();
  $("send").disabled = true;
  $("stop-button").disabled = false;
  $("status").textContent = "generating...";
  const started = performance.now();
  let answer = "";
  let finish = null;
  let usage = null;
  try {
    const resp = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.abort.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    await readEvents(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      if (choice.finish_reason) finish = choice.finish_reason;
      const delta = chat ? choice.delta || {} : { content: choice.text };
      if (delta.reasoning_content) {
        reply.thinking.hidden = false;
        reply.thinking.textContent += delta.reasoning_content;
      }
      if (delta.content) {
        answer += delta.content;
        reply.text.textContent = answer;
        $("transcript").scrollTop = $("transcript").scrollHeight;
      }
    });
    if (chat) state.chat.push({ role: "assistant", content: answer });
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage ? usage.completion_tokens : null;
    reply.meta.textContent = [
      finish && "finish: " + finish,
      tokens !== null && tokens + " tokens",
      tokens && (tokens / seconds).toFixed(1) + " tokens/s",
    ].filter(Boolean).join(" · ");
    $("status").textContent = "";
  } catch (err) {
    if (err.name === "AbortError") {
      reply.meta.textContent = "stopped";
      if (chat) state.chat.push({ role: "assistant", content: answer });
      $("status").textContent = "";
    } else {
      if (chat) state.chat.pop();
      reply.meta.textContent = "error";
      $("status").textContent = err.message;
      $("status").className = "error";
    }
  } finally {
    state.abort = null;
    $("send").disabled = false;
    $("stop-button").disabled = true;
  }
}

// Chat needs a chat template; a model without one (the built-in
// stories260K) continues text instead.
async function chooseMode() {
  try {
    const resp = await api("/tokenize", { messages: [{ role: "user", content: "hi" }] });
    $("mode").value = resp.ok ? "chat" : "completion";
    if (!resp.ok) $("status").textContent = "This model has no chat template: the playground continues text.";
  } catch (err) {
    $("status").textContent = err.message;
  }
}

// ---- Cluster view ---------------------------------------------------------

function cell(row, content) {
  const td = document.createElement("td");
  if (content instanceof Node) td.append(content);
  else td.textContent = content;
  row.append(td);
  return td;
}

function bar(fraction) {
  const outer = document.createElement("div");
  outer.className = "bar";
  const inner = document.createElement("span");
  inner.style.width = Math.round(Math.min(1, Math.max(0, fraction)) * 100) + "%";
  outer.append(inner);
  return outer;
}

function percent(part, whole) {
  return whole > 0 ? Math.round((100 * part) / whole) + "%" : "-";
}

function note(text) {
  state.events.unshift(new Date().toLocaleTimeString() + " " + text);
  state.events = state.events.slice(0, 5);
}

function renderWorkers(list) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of list.data) {
    const row = document.createElement("tr");
    row.dataset.worker = w.name;
    const stats = w.stats || {};
    const load = w.load || {};
    const who = document.createElement("div");
    who.textContent = w.name;
    if (w.joined_by) {
      const how = document.createElement("span");
      how.className = "stage muted";
      how.textContent = "joined by " + w.joined_by;
      who.append(how);
    }
    cell(row, who);
    cell(row, w.state);
    cell(row, w.device || "");
    const stages = document.createElement("div");
    const kinds = (w.stages || []).length > 1 ? "pipeline of " + w.stages.length + " stages" : "";
    if (kinds) {
      const label = document.createElement("span");
      label.className = "stage muted";
      label.textContent = kinds;
      stages.append(label);
    }
    for (const s of w.stages || []) {
      const line = document.createElement("span");
      line.className = "stage";
      line.textContent = s.name + ": layers " + s.layers;
      stages.append(line);
    }
    cell(row, stages);
    const kv = document.createElement("div");
    const used = stats.kv_blocks_used || 0;
    const total = stats.kv_blocks_total || 0;
    kv.append(bar(total ? used / total : 0));
    const kvText = document.createElement("span");
    kvText.className = "muted";
    kvText.textContent = used + " / " + total + " blocks (" + (w.kv_cache_dtype || "") + ")";
    kv.append(kvText);
    cell(row, kv);
    cell(row, String(load.running ?? stats.num_running ?? 0));
    cell(row, String(load.waiting ?? stats.num_waiting ?? 0));
    cell(row, percent(stats.prefix_cache_hits || 0, stats.prefix_cache_queries || 0));
    body.append(row);
  }
  for (const p of list.preparing || []) body.append(preparingRow(p));
  const names = new Set(list.data.map((w) => w.name));
  if (state.workerNames) {
    for (const n of names) if (!state.workerNames.has(n)) note("worker " + n + " joined");
    for (const n of state.workerNames) if (!names.has(n)) note("worker " + n + " left");
  }
  state.workerNames = names;
  if (state.redispatches !== null && list.redispatches > state.redispatches) {
    note((list.redispatches - state.redispatches) + " request(s) failed over to another worker");
  }
  state.redispatches = list.redispatches;
  return list;
}

function megabytes(bytes) {
  return (bytes / 1e6).toFixed(1) + " MB";
}

// A worker still fetching or loading its weights: its download's progress.
function preparingRow(p) {
  const row = document.createElement("tr");
  row.dataset.worker = p.name;
  row.className = "preparing";
  const who = document.createElement("div");
  who.textContent = p.name;
  const how = document.createElement("span");
  how.className = "stage muted";
  how.textContent = "joined by " + p.joined_by;
  who.append(how);
  cell(row, who);
  const progress = document.createElement("div");
  progress.textContent = p.phase;
  if (p.phase === "downloading") {
    const file = p.file;
    progress.append(bar(file && file.bytes_total ? file.bytes_done / file.bytes_total : 0));
    const detail = document.createElement("span");
    detail.className = "muted";
    detail.textContent =
      "file " + Math.min(p.files_done + 1, p.files_total) + " of " + p.files_total +
      (file ? " (" + file.name + ", " + percent(file.bytes_done, file.bytes_total) + ")" : "") +
      ", " + megabytes(p.downloaded_bytes) + " so far";
    progress.append(detail);
  }
  cell(row, progress);
  cell(row, "");
  const stages = document.createElement("span");
  stages.className = "stage";
  stages.textContent = "layers " + p.layers;
  cell(row, stages);
  for (let i = 0; i < 4; i++) cell(row, "");
  return row;
}

function metricValue(text, name) {
  let sum = 0;
  let found = false;
  for (const line of text.split("\n")) {
    if (line.startsWith(name + " ") || line.startsWith(name + "{")) {
      sum += Number(line.slice(line.lastIndexOf(" ") + 1));
      found = true;
    }
  }
  return found ? sum : null;
}

function renderSummary(list, metrics) {
  const now = performance.now();
  const tokens = metrics === null ? null : metricValue(metrics, "tinyvllm_generation_tokens_total");
  let rate = "-";
  if (tokens !== null && state.lastTokens) {
    const [then, before] = state.lastTokens;
    rate = ((tokens - before) / ((now - then) / 1000)).toFixed(1);
  }
  if (tokens !== null) state.lastTokens = [now, tokens];
  const ready = list.data.filter((w) => w.state === "ready").length;
  const items = [
    ["workers ready", ready + " / " + list.data.length],
    ["requests in flight", list.in_flight],
    ["tokens/s", rate],
    ["failovers", list.redispatches],
  ];
  const summary = $("summary");
  summary.replaceChildren();
  for (const [label, value] of items) {
    const div = document.createElement("div");
    const b = document.createElement("b");
    b.textContent = value;
    div.append(b, label);
    summary.append(div);
  }
  if (state.events.length) {
    const events = document.createElement("div");
    events.className = "muted";
    events.id = "events";
    events.textContent = state.events.join(" · ");
    summary.append(events);
  }
}

async function poll() {
  try {
    const resp = await api("/v1/workers");
    if (!resp.ok) throw new Error(await errorText(resp));
    const list = renderWorkers(await resp.json());
    const metrics = await fetch("/metrics").then((r) => (r.ok ? r.text() : null)).catch(() => null);
    renderSummary(list, metrics);
    $("cluster-error").textContent = "";
  } catch (err) {
    $("cluster-error").textContent = err.message;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

async function loadModel() {
  try {
    const resp = await api("/v1/models");
    if (!resp.ok) throw new Error(await errorText(resp));
    const models = await resp.json();
    state.model = models.data[0] && models.data[0].id;
    $("model").textContent = state.model ? "serving " + state.model : "";
  } catch (err) {
    $("status").textContent = err.message;
  }
}

function start() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadModel();
    chooseMode();
  });
  $("prompt-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop-button").addEventListener("click", () => state.abort && state.abort.abort());
  $("clear").addEventListener("click", () => {
    state.chat = [];
    $("transcript").replaceChildren();
  });
  loadModel();
  chooseMode();
  poll();
}

start();
