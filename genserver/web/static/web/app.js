// The genserver page: a thin client of the job API (session auth + CSRF). No business rule lives here:
// limits and defaults come from GET /api/v1/models/, queue state from /queues/, refusals from the API's bodies.
"use strict";

const API = "/api/v1";
const TERMINAL = new Set(["succeeded", "failed", "cancelled", "expired"]);
const POLL_MS = 250;  // until the event stream: a job's state, four times a second
const $ = (id) => document.getElementById(id);

// ---- 1. Talking to the API ------------------------------------------------------------------

function csrfToken() {
  const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
  return match ? decodeURIComponent(match[1]) : "";
}

// One request; resolves {status, body, retryAfter} for every HTTP answer (refusals are data, not exceptions).
async function call(method, path, body) {
  const init = {method, credentials: "same-origin", headers: {Accept: "application/json"}};
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  if (method !== "GET") init.headers["X-CSRFToken"] = csrfToken();
  const response = await fetch(API + path, init);
  if (response.status === 401 || (response.status === 403 && method === "GET")) {
    window.location.assign("/login/?next=/");  // the session ended: sign in again
  }
  let data = null;
  try { data = await response.json(); } catch (_) { data = null; }
  return {status: response.status, body: data, retryAfter: response.headers.get("Retry-After")};
}

// A refusal or error body as one sentence a person can act on.
function describeRefusal(result) {
  const body = result.body || {};
  let text = body.detail || `The server answered ${result.status}.`;
  if (typeof text !== "string") text = JSON.stringify(text);
  const retry = result.retryAfter || body.retry_after;
  if (result.status === 429 || result.status === 503) {
    // What it is and when to come back first, then the server's own words.
    let what = body.duration_class ? `The ${body.duration_class} queue is full right now` : "Refused";
    if (result.status === 503) what = "The service is unavailable";
    text = `${what}${retry ? `, retry in ${retry} s` : ""}. (${text})`;
  }
  return text;
}

// ---- 2. Watching a job: the one function to swap for EventSource when the event stream exists ----

// Calls onJob(job) on every change until the job is terminal; returns a function that stops watching.
function watchJob(jobId, onJob) {
  let stopped = false;
  let timer = null;
  async function poll() {
    if (stopped) return;
    const result = await call("GET", `/jobs/${jobId}/`);
    if (stopped) return;
    if (result.status !== 200) {
      onJob(null, result);
      return;
    }
    onJob(result.body);
    if (!TERMINAL.has(result.body.status)) timer = setTimeout(poll, POLL_MS);
  }
  poll();
  return () => { stopped = true; clearTimeout(timer); };
}

// ---- 3. The form: fields shown and limited by the chosen model ---------------------------------

let models = [];
const FIELDS = ["model", "prompt", "negative_prompt", "width", "height", "num_frames", "steps", "guidance_scale",
  "seed", "num_outputs", "preview_every"];

function chosenModel() {
  return models.find((m) => m.name === $("f-model").value);
}

function applyModel(keepValues) {
  const m = chosenModel();
  if (!m) return;
  const lim = m.limits, dflt = m.defaults;
  $("f-model-desc").textContent = `${m.kind} · ${m.description || m.family}`;
  const set = (id, attrs, value) => {
    const el = $(id);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (!keepValues) el.value = value;
  };
  set("f-width", {min: lim.min_size, max: lim.max_width, step: lim.size_multiple}, dflt.width);
  set("f-height", {min: lim.min_size, max: lim.max_height, step: lim.size_multiple}, dflt.height);
  set("f-steps", {max: lim.max_steps}, dflt.steps);
  set("f-guidance_scale", {max: lim.max_guidance}, dflt.guidance_scale);
  set("f-num_outputs", {max: lim.max_outputs}, 1);
  set("f-num_frames", {min: 1, max: lim.max_frames, step: lim.frames_step}, dflt.num_frames);
  $("f-prompt").setAttribute("maxlength", lim.max_prompt_chars);
  $("f-negative_prompt").setAttribute("maxlength", lim.max_prompt_chars);
  $("field-num_frames").hidden = m.kind !== "video";
}

function readForm() {
  const m = chosenModel();
  const request = {model: $("f-model").value, prompt: $("f-prompt").value};
  if ($("f-negative_prompt").value) request.negative_prompt = $("f-negative_prompt").value;
  const numbers = ["width", "height", "steps", "guidance_scale", "seed", "num_outputs", "preview_every"];
  if (m && m.kind === "video") numbers.push("num_frames");
  for (const name of numbers) {
    const raw = $(`f-${name}`).value.trim();
    if (raw !== "") request[name] = Number(raw);
  }
  return request;
}

function fillForm(job) {
  $("f-model").value = job.model;
  applyModel(true);
  for (const name of FIELDS.slice(1)) {
    const el = $(`f-${name}`);
    if (el && job[name] !== undefined && job[name] !== null) el.value = job[name];
  }
  $("f-steps").value = job.steps_requested ?? job.steps;
}

function clearErrors() {
  document.querySelectorAll("#submit-form .error").forEach((el) => { el.textContent = ""; });
  document.querySelectorAll("#submit-form [aria-invalid]").forEach((el) => el.removeAttribute("aria-invalid"));
  $("form-message").hidden = true;
}

function showFormMessage(text) {
  $("form-message").textContent = text;
  $("form-message").hidden = false;
}

// 400 bodies map field → [messages]: each goes next to its field; the rest above the button.
function showFieldErrors(body) {
  const general = [];
  for (const [field, messages] of Object.entries(body || {})) {
    const text = Array.isArray(messages) ? messages.join(" ") : String(messages);
    const slot = $(`err-${field}`);
    if (slot && FIELDS.includes(field)) {
      slot.textContent = text;
      $(`f-${field}`).setAttribute("aria-invalid", "true");
    } else {
      general.push(field === "non_field_errors" || field === "detail" ? text : `${field}: ${text}`);
    }
  }
  if (general.length) showFormMessage(general.join(" "));
  const first = document.querySelector("#submit-form [aria-invalid]");
  if (first) first.focus();
}

async function submitJob(request) {
  clearErrors();
  $("submit-button").disabled = true;
  try {
    const result = await call("POST", "/jobs/", request);
    if (result.status === 201 || result.status === 200) {
      openJob(result.body.id);
      refreshHistory();
    } else if (result.status === 400) {
      showFieldErrors(result.body);
    } else {
      showFormMessage(describeRefusal(result));
    }
  } finally {
    $("submit-button").disabled = false;
  }
}

// ---- 4. The live job ------------------------------------------------------------------------------

let stopWatching = () => {};
let liveJob = null;

function openJob(jobId) {
  stopWatching();
  liveJob = null;
  $("live-empty").hidden = true;
  $("live-job").hidden = false;
  $("live-error").hidden = true;
  $("live-outputs").replaceChildren();
  $("live-preview-box").hidden = true;
  $("live-status").textContent = "loading";
  if (window.location.hash !== `#job=${jobId}`) history.replaceState(null, "", `#job=${jobId}`);
  stopWatching = watchJob(jobId, renderLive);
}

function seconds(value) {
  if (value === null || value === undefined) return "unknown";
  return value < 10 ? `${value.toFixed(1)} s` : `${Math.round(value)} s`;
}

function outputElement(output, index, job) {
  const box = document.createElement("figure");
  if (output.content_type.startsWith("video/")) {
    const video = document.createElement("video");
    video.controls = true;
    video.loop = true;
    video.src = output.url;
    video.setAttribute("aria-label", `Video ${index + 1} of the job: ${job.prompt}`);
    box.append(video);
  } else {
    const img = document.createElement("img");
    img.src = output.url;
    img.alt = `Output ${index + 1}: ${job.prompt}`;
    box.append(img);
  }
  const link = document.createElement("a");
  link.href = output.url;
  link.download = `${job.id}-${index}.${output.content_type.split("/")[1] || "bin"}`;
  link.textContent = "Download";
  link.className = "download";
  const caption = document.createElement("figcaption");
  caption.append(link);
  box.append(caption);
  return box;
}

function renderLive(job, failure) {
  if (!job) {
    $("live-status").textContent = failure.status === 404 ? "not found" : "unavailable";
    $("live-error").textContent = failure.status === 404
      ? "No such job of yours." : describeRefusal(failure);
    $("live-error").hidden = false;
    return;
  }
  const previous = liveJob;
  liveJob = job;
  $("live-prompt").textContent = job.prompt;
  $("live-status").textContent = job.status;
  $("live-status").dataset.status = job.status;
  $("live-model").textContent = `${job.model} · ${job.width}×${job.height}` +
    (job.kind === "video" ? ` · ${job.num_frames} frames` : "") + ` · ${job.duration_class}`;
  const waiting = job.status === "queued" || job.status === "encoding";
  $("live-queue-label").textContent = waiting ? "In queue" : "Time";
  $("live-queue").textContent = waiting
    ? `position ${job.queue_position ?? "?"} · starts in about ${seconds(job.eta_seconds)}`
    : `estimated ${seconds(job.estimated_seconds)}`;
  const {step, total_steps: total} = job.progress;
  $("live-progress").max = Math.max(total, 1);
  $("live-progress").value = step;
  $("live-progress-label").textContent = `Progress: step ${step} of ${total}`;
  if (job.preview_url && !job.outputs.length) {
    const src = `${job.preview_url}?step=${job.preview_step}`;
    if ($("live-preview").getAttribute("src") !== src) $("live-preview").src = src;
    $("live-preview-caption").textContent = `Latest preview, step ${job.preview_step}`;
    $("live-preview-box").hidden = false;
  } else if (job.outputs.length) {
    $("live-preview-box").hidden = true;
  }
  const outputsChanged = !previous || previous.id !== job.id || previous.outputs.length !== job.outputs.length ||
    (previous.segments || []).length !== (job.segments || []).length;
  if (outputsChanged) {
    const shown = job.outputs.length ? job.outputs : (job.segments || []);
    $("live-outputs").replaceChildren(...shown.map((out, i) => outputElement(out, i, job)));
  }
  $("live-error").hidden = !job.error;
  $("live-error").textContent = job.error || "";
  const active = !TERMINAL.has(job.status);
  $("cancel-button").hidden = !active || job.cancel_requested;
  $("steps-form").hidden = job.status !== "denoising" && job.status !== "queued" && job.status !== "encoding";
  if (!previous || previous.id !== job.id) $("steps-input").value = job.steps;
  if (previous && previous.id === job.id && previous.status !== job.status && TERMINAL.has(job.status)) {
    refreshHistory();
  }
}

async function cancelLive() {
  if (!liveJob) return;
  const result = await call("POST", `/jobs/${liveJob.id}/cancel/`);
  if (result.status === 202) {
    renderLive(result.body);
  } else {
    $("live-error").textContent = describeRefusal(result);
    $("live-error").hidden = false;
  }
}

async function changeSteps(event) {
  event.preventDefault();
  if (!liveJob) return;
  $("err-steps-change").textContent = "";
  const result = await call("POST", `/jobs/${liveJob.id}/steps/`, {steps: Number($("steps-input").value)});
  if (result.status === 202) {
    renderLive(result.body);
  } else if (result.status === 400) {
    $("err-steps-change").textContent = Object.values(result.body || {}).flat().join(" ");
  } else {
    $("err-steps-change").textContent = describeRefusal(result);
  }
}

// ---- 5. History: the user's jobs, newest first -------------------------------------------------------

function thumbnail(job) {
  const out = job.outputs.find((o) => o.content_type.startsWith("image/"));
  const url = out ? out.url : (job.segments && job.segments.length ? job.segments[0].poster_url : job.preview_url);
  if (!url) {
    const blank = document.createElement("span");
    blank.className = "thumb blank";
    blank.textContent = job.kind === "video" ? "video" : "—";
    return blank;
  }
  const img = document.createElement("img");
  img.className = "thumb";
  img.src = url;
  img.alt = "";  // decorative: the prompt next to it says what it is
  img.loading = "lazy";
  return img;
}

function historyItem(job) {
  const item = document.createElement("li");
  item.dataset.jobId = job.id;
  item.append(thumbnail(job));
  const text = document.createElement("div");
  text.className = "what";
  const open = document.createElement("a");
  open.href = `#job=${job.id}`;
  open.textContent = job.prompt || "(no prompt)";
  open.className = "open";
  const meta = document.createElement("span");
  meta.className = "hint";
  meta.textContent = ` ${job.model} · ${new Date(job.created_at).toLocaleString()}`;
  const badge = document.createElement("span");
  badge.className = "badge";
  badge.dataset.status = job.status;
  badge.textContent = job.status;
  text.append(badge, " ", open, meta);
  const actions = document.createElement("div");
  actions.className = "actions";
  const rerun = document.createElement("button");
  rerun.type = "button";
  rerun.className = "rerun";
  rerun.textContent = "Re-run";
  rerun.setAttribute("aria-label", `Re-run with the same settings: ${job.prompt}`);
  rerun.addEventListener("click", () => { fillForm(job); submitJob(readForm()); });
  actions.append(rerun);
  job.outputs.forEach((out, i) => {
    const link = document.createElement("a");
    link.href = out.url;
    link.download = `${job.id}-${i}.${out.content_type.split("/")[1] || "bin"}`;
    link.textContent = job.outputs.length > 1 ? `Download ${i + 1}` : "Download";
    actions.append(link);
  });
  item.append(text, actions);
  return item;
}

async function refreshHistory() {
  const wanted = $("history-filter").value;
  const result = await call("GET", `/jobs/?limit=30${wanted ? `&status=${encodeURIComponent(wanted)}` : ""}`);
  if (result.status !== 200) return;
  const jobs = result.body.results || [];
  const list = $("history");
  if (!jobs.length) {
    const empty = document.createElement("li");
    empty.className = "hint";
    empty.textContent = wanted ? `No ${wanted} jobs.` : "No jobs yet.";
    list.replaceChildren(empty);
    return;
  }
  list.replaceChildren(...jobs.map(historyItem));
}

// ---- 6. Staff: the queues panel ------------------------------------------------------------------------

async function refreshQueues() {
  const result = await call("GET", "/queues/");
  if (result.status !== 200) return;
  const rows = result.body.map((q) => {
    const tr = document.createElement("tr");
    tr.dataset.queue = q.name;
    const cells = [q.name, q.depth, q.running, q.backlog_seconds, q.expected_wait_seconds ?? "∞",
      q.live_workers ? q.live_workers.length : "?", q.accepting ? "yes" : "no (refusing)"];
    cells.forEach((value, i) => {
      const cell = document.createElement(i === 0 ? "th" : "td");
      if (i === 0) cell.scope = "row";
      cell.textContent = value;
      tr.append(cell);
    });
    if (!q.accepting) tr.className = "refusing";
    return tr;
  });
  document.querySelector("#queues tbody").replaceChildren(...rows);
}

// ---- 7. Start --------------------------------------------------------------------------------------------

function openFromHash() {
  const match = window.location.hash.match(/^#job=([0-9a-f-]{36})$/);
  if (match && (!liveJob || liveJob.id !== match[1])) openJob(match[1]);
}

async function start() {
  const result = await call("GET", "/models/");
  models = result.status === 200 ? result.body : [];
  $("f-model").replaceChildren(...models.map((m) => {
    const option = document.createElement("option");
    option.value = m.name;
    option.textContent = `${m.name} (${m.kind})`;
    return option;
  }));
  applyModel(false);
  $("f-model").addEventListener("change", () => { clearErrors(); applyModel(false); });
  $("submit-form").addEventListener("submit", (event) => { event.preventDefault(); submitJob(readForm()); });
  $("cancel-button").addEventListener("click", cancelLive);
  $("steps-form").addEventListener("submit", changeSteps);
  $("history-filter").addEventListener("change", refreshHistory);
  $("history-refresh").addEventListener("click", refreshHistory);
  window.addEventListener("hashchange", openFromHash);
  openFromHash();
  refreshHistory();
  if ($("app").dataset.staff === "1") {
    refreshQueues();
    setInterval(refreshQueues, 3000);
  }
  document.body.dataset.ready = "1";  // the models are loaded: the form can be used
}

start();
