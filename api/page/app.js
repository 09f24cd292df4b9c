// The status page: the REST API with the key the user entered, refreshed every few seconds.
// Only this server is contacted; every value from it is shown with textContent, never as HTML.
"use strict";

const KEY_STORAGE = "harvest-api-key";
const REFRESH_MS = 2000;
const PAGE_SIZE = 50;

const $ = (id) => document.getElementById(id);
let timer = null;
let pages = 1;

function key() {
  return sessionStorage.getItem(KEY_STORAGE);
}

/** Calls the API; an error answer throws with the server's own message. */
async function api(method, path) {
  const response = await fetch(path, {
    method,
    headers: { Authorization: `Bearer ${key()}` },
    cache: "no-store",
  });
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    body = null;
  }
  if (!response.ok) {
    const error = body && body.error ? body.error : null;
    const text = error
      ? `${error.message} (${error.code}, HTTP ${response.status})`
      : `HTTP ${response.status} from ${path}`;
    const failure = new Error(text);
    failure.status = response.status;
    throw failure;
  }
  return body;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function when(iso) {
  if (!iso) return "—";
  const at = new Date(iso);
  return at.toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" });
}

function count(n) {
  return n === null || n === undefined ? "—" : Number(n).toLocaleString();
}

function bytes(n) {
  const units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
  let value = Number(n);
  let i = 0;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i += 1;
  }
  return i === 0 ? `${value} bytes` : `${value.toFixed(1)} ${units[i]}`;
}

function amount(n, unit) {
  return unit === "bytes" ? bytes(n) : `${count(n)} ${unit}`;
}

function measure(label, m, unit) {
  const wrap = document.createElement("div");
  const dt = document.createElement("dt");
  dt.textContent = label;
  const dd = document.createElement("dd");
  dd.textContent =
    m.limit === null
      ? `${amount(m.used, unit)} (no limit)`
      : `${count(m.used)} of ${amount(m.limit, unit)}`;
  if (unit === "bytes" && m.limit !== null) dd.textContent = `${bytes(m.used)} of ${bytes(m.limit)}`;
  wrap.append(dt, dd);
  if (m.limit !== null) {
    const meter = document.createElement("meter");
    meter.min = 0;
    meter.max = Math.max(m.limit, 1);
    meter.value = Math.min(m.used, meter.max);
    meter.high = meter.max * 0.8;
    meter.setAttribute("aria-label", `${label}: ${dd.textContent}`);
    wrap.append(meter);
  }
  return wrap;
}

function renderUsage(usage) {
  $("account-name").textContent = usage.account;
  const list = $("usage");
  list.replaceChildren(
    measure("Small lane (running jobs)", usage.lanes.small, "jobs"),
    measure("Large lane (running jobs)", usage.lanes.large, "jobs"),
    measure("Tokens today", usage.tokens.daily, "tokens"),
    measure("Tokens this month", usage.tokens.monthly, "tokens"),
    measure("Tokens in all", usage.tokens.total, "tokens"),
    measure("This key's jobs this month", usage.key_jobs_this_month, "jobs"),
  );
  if (usage.storage_bytes) {
    list.append(measure("Stored files", usage.storage_bytes, "bytes"));
  }
  $("account-section").hidden = false;
}

function progressCell(job) {
  const cell = document.createElement("td");
  const p = job.progress;
  if (job.status === "running" && p && p.prompts_total > 0) {
    const bar = document.createElement("progress");
    bar.max = p.prompts_total;
    bar.value = p.prompts_done;
    bar.setAttribute("aria-label", `job ${job.job_id}: ${p.prompts_done} of ${p.prompts_total} prompts`);
    const text = document.createElement("span");
    text.className = "progress-text";
    text.textContent = ` ${p.prompts_done} / ${p.prompts_total}`;
    cell.append(bar, text);
  } else if (job.status === "done") {
    cell.textContent = `${job.n_prompts} / ${job.n_prompts}`;
  } else {
    cell.textContent = "—";
  }
  return cell;
}

function actionsCell(job) {
  const cell = document.createElement("td");
  if (job.status === "pending" || job.status === "running") {
    const cancel = document.createElement("button");
    cancel.type = "button";
    cancel.className = "cancel";
    cancel.textContent = "Cancel";
    cancel.setAttribute("aria-label", `Cancel job ${job.job_id}`);
    cancel.addEventListener("click", () => cancelJob(job.job_id, cancel));
    cell.append(cancel);
  } else if (job.status === "done") {
    const files = document.createElement("button");
    files.type = "button";
    files.className = "files";
    files.textContent = "Files";
    files.setAttribute("aria-label", `Files of job ${job.job_id}`);
    files.addEventListener("click", () => showFiles(job.job_id));
    cell.append(files);
  }
  return cell;
}

function row(job) {
  const tr = document.createElement("tr");
  tr.dataset.jobId = job.job_id;
  tr.dataset.status = job.status;
  const text = (value, className) => {
    const td = document.createElement("td");
    td.textContent = value;
    if (className) td.className = className;
    return td;
  };
  const id = text(job.job_id.slice(0, 8), "id");
  id.title = job.job_id;
  const status = text(job.status, `status status-${job.status}`);
  if (job.error) {
    const why = document.createElement("div");
    why.className = "job-error";
    why.textContent = job.error;
    status.append(why);
  }
  tr.append(
    id,
    text(job.model),
    status,
    progressCell(job),
    text(count(job.n_prompts)),
    text(count(job.tokens === null ? job.reserved_tokens : job.tokens)),
    text(when(job.created_at)),
    text(when(job.completed_at)),
    actionsCell(job),
  );
  return tr;
}

/**
 * Puts the rows in place, keeping each row whose job has not changed (so a refresh does not
 * take the keyboard focus away), and moving the focus to the same control of a replaced row.
 */
function renderRows(jobs) {
  const body = $("job-rows");
  const old = new Map([...body.children].map((tr) => [tr.dataset.jobId, tr]));
  const focused = document.activeElement;
  const focusedRow = focused && body.contains(focused) ? focused.closest("tr") : null;
  const rows = jobs.map((job) => {
    const signature = JSON.stringify([job.status, job.progress, job.tokens, job.completed_at, job.error]);
    const existing = old.get(job.job_id);
    if (existing && existing.dataset.signature === signature) return existing;
    const fresh = row(job);
    fresh.dataset.signature = signature;
    return fresh;
  });
  rows.forEach((tr, i) => {
    if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
  });
  while (body.children.length > rows.length) body.lastElementChild.remove();
  if (focusedRow && !focusedRow.isConnected) {
    const again = body.querySelector(`tr[data-job-id="${focusedRow.dataset.jobId}"] button.${focused.className}`);
    if (again) again.focus();
  }
}

async function refresh() {
  if (!key()) return;
  try {
    const status = $("status-filter").value;
    let jobs = [];
    let after = null;
    let hasMore = false;
    for (let page = 0; page < pages; page++) {
      const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
      if (status) query.set("status", status);
      if (after) query.set("after", after);
      const list = await api("GET", `/v1/harvest?${query}`);
      jobs = jobs.concat(list.data);
      hasMore = list.has_more;
      after = list.next_after;
      if (!hasMore) break;
    }
    const usage = await api("GET", "/v1/account");
    renderUsage(usage);
    renderRows(jobs);
    $("no-jobs").hidden = jobs.length > 0;
    $("more").hidden = !hasMore;
    $("jobs-section").hidden = false;
    $("updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
    clearError();
  } catch (error) {
    showError(error.message);
    if (error.status === 401) stop();
  }
}

async function cancelJob(id, button) {
  button.disabled = true;
  try {
    await api("DELETE", `/v1/harvest/${id}`);
    await refresh();
  } catch (error) {
    showError(error.message);
    button.disabled = false;
  }
}

async function showFiles(id) {
  try {
    const job = await api("GET", `/v1/harvest/${id}`);
    const list = $("files");
    $("files-job").textContent = id;
    if (!job.result) {
      list.replaceChildren();
      $("files-expire").textContent = "—";
      showError(`the files of job ${id} are no longer kept`);
      return;
    }
    const link = (name, url) => {
      const li = document.createElement("li");
      const a = document.createElement("a");
      a.href = url;
      a.textContent = name;
      a.rel = "noreferrer";
      li.append(a);
      return li;
    };
    const items = [link("manifest.json", job.result.manifest_url), link("stats.safetensors", job.result.stats_url)];
    job.result.shard_urls.forEach((url, i) => {
      items.push(link(`shard_${String(i).padStart(5, "0")}.safetensors`, url));
    });
    list.replaceChildren(...items);
    $("files-expire").textContent = when(job.urls_expire_at);
    $("files-section").hidden = false;
    $("files-heading").focus();
  } catch (error) {
    showError(error.message);
  }
}

function start() {
  $("key-forget").hidden = false;
  $("key-input").value = "";
  $("key-input").required = false;
  $("key-input").placeholder = "connected (enter another key to switch)";
  stop();
  refresh();
  timer = setInterval(refresh, REFRESH_MS);
}

function stop() {
  if (timer !== null) clearInterval(timer);
  timer = null;
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const entered = $("key-input").value.trim();
    if (!entered && !key()) {
      showError("enter an API key: harvest-api create-key prints one");
      return;
    }
    if (entered) sessionStorage.setItem(KEY_STORAGE, entered);
    pages = 1;
    start();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    stop();
    for (const id of ["account-section", "jobs-section", "files-section", "key-forget"]) $(id).hidden = true;
    $("key-input").required = true;
    $("key-input").placeholder = "sk-hv-…";
    clearError();
  });
  $("refresh").addEventListener("click", refresh);
  $("status-filter").addEventListener("change", () => {
    pages = 1;
    refresh();
  });
  $("more").addEventListener("click", () => {
    pages += 1;
    refresh();
  });
  if (key()) start();
});
