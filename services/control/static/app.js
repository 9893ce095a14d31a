// The control service's live page. Plain JS, no build step and no dependencies: the service runs on
// closed clusters, so everything (charts included) is drawn here from the JSON API, polled every second.
"use strict";

const POLL_MS = 1000;
const MAX_ROWS = 2000; // step rows kept in memory (charts show this window)
const PAGE_ROWS = 1000; // rows per /api/v1/metrics request
const MAX_PAGES_PER_TICK = 3; // catch up on a long backlog without stalling the other panels
const TOKEN_KEY = "sparkrl.control.token";
const SAMPLING_KEYS = ["temperature", "top_p"]; // the workers' live values, not in the learner's dict

// Canvas cannot read CSS variables cheaply per frame; these match style.css's palette.
const INK = { grid: "#2a3340", axis: "#8b96a5", empty: "#5b6573" };
const PALETTE = ["#58a6ff", "#f0883e", "#3fb950", "#d2a8ff", "#ff7b72", "#e3b341", "#39c5cf", "#db61a2"];

const CHARTS = [
  { id: "reward", title: "reward", metric: "rollout/reward_mean" },
  { id: "entropy", title: "entropy", metric: "loss/entropy" },
  { id: "loss", title: "loss", metric: "loss/value" },
  { id: "reg-tokens", title: "regularized tokens", metric: "loss/reg_tokens" },
  { id: "sparks", title: "sparks: rare tokens in correct answers", metric: "explore/sparks" },
  // From the in-training evaluator (eval.every), against the policy version it evaluated.
  { id: "heldout", title: "held-out pass@1 (evaluator)", metric: "eval/pass@1", evals: true,
    empty: "no held-out evaluation yet (the evaluator runs when eval.every is set)" },
  { id: "tokens-per-s", title: "tokens/s trained", metric: "time/tokens_per_s" },
  // Multi-turn episodes (rollout.agent): from the learner's step rows.
  { id: "turns", title: "agents: model turns per sample", metric: "rollout/model_turns_mean",
    empty: "no episodes (rollout.agent is not set)" },
  { id: "env-share", title: "agents: environment token share", metric: "rollout/environment_token_share",
    empty: "no episodes (rollout.agent is not set)" },
  { id: "versions", title: "policy versions", versions: true },
];

const $ = (id) => document.getElementById(id);

const page = {
  rows: [], // StepMetrics, oldest first
  evals: [], // EvalRecords as chart rows: {step: policy version, metrics: {"eval/pass@1": ...}}
  lastStep: 0, // newest step seen: the next `since`
  hpKeys: "", // the hyperparameter names the <select> was last built from
  status: null,
  authFailed: false, // a poll already reported the token problem (do not steal focus every second)
  charts: [],
};

// ── API ──────────────────────────────────────────────────────────────────────────────────────────────

class ApiError extends Error {
  constructor(status, body) {
    super(`HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

const savedToken = () => localStorage.getItem(TOKEN_KEY) || "";

async function api(method, path, body) {
  const headers = body === undefined ? {} : { "Content-Type": "application/json" };
  if (savedToken()) headers.Authorization = `Bearer ${savedToken()}`;
  const json = body === undefined ? undefined : JSON.stringify(body);
  const response = await fetch(path, { method, headers, body: json, cache: "no-store" });
  const data = await response.json().catch(() => null); // a non-JSON error: the status code says enough
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

const isAuthError = (err) => err instanceof ApiError && (err.status === 401 || err.status === 403);

// `detail` is a string, or for 422 a list of {loc, msg}; a 504 also carries the answers that arrived.
function describeError(err) {
  if (!(err instanceof ApiError)) return `cannot reach the control service (${err.message})`;
  const body = err.body || {};
  const detail = Array.isArray(body.detail)
    ? body.detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ")
    : body.detail || "no detail";
  const parts = [`HTTP ${err.status}: ${detail}`];
  for (const r of body.results || []) parts.push(`${r.target}: ${r.outcome} (${r.detail})`);
  if (body.waiting_for && body.waiting_for.length) parts.push(`waiting for ${body.waiting_for.join(", ")}`);
  return parts.join(" · ");
}

function describeResponse(resp) {
  const parts = [`${resp.command}: ${resp.outcome}`];
  for (const r of resp.results) parts.push(`${r.target}: ${r.detail || r.outcome}`);
  if (resp.gone && resp.gone.length) parts.push(`gone before answering: ${resp.gone.join(", ")}`);
  return parts.join(" · ");
}

const setText = (id, text, className) => Object.assign($(id), { textContent: text, className });
const showMessage = (text, kind) => setText("message", text, `message ${kind}`);
const setConn = (text, kind) => setText("conn", text, `conn ${kind}`);

function reportAuth(err, fromPoll) {
  const text = err.status === 401
    ? "The token is missing: paste RUN_DIR/control-token into the token field and save it."
    : "The token is wrong: paste RUN_DIR/control-token into the token field and save it.";
  showMessage(text, "error");
  if (!fromPoll || !page.authFailed) $("token").focus();
  if (fromPoll) page.authFailed = true;
}

// ── formatting ───────────────────────────────────────────────────────────────────────────────────────

// Three significant digits are enough to read a value at a glance; integers stay integers.
function fmtNum(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  const a = Math.abs(v);
  if (Number.isInteger(v) || a >= 1e4) return Math.round(v).toLocaleString("en-US");
  if (a >= 100) return v.toFixed(1);
  return a >= 0.001 ? String(Number(v.toPrecision(3))) : v.toExponential(2);
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  if (n >= 1e9) return `${(n / 1e9).toFixed(2)} GB`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)} MB`;
  if (n >= 1e3) return `${(n / 1e3).toFixed(1)} KB`;
  return `${n} B`;
}

function fmtSec(s) {
  return s === null || s === undefined ? "–" : `${s < 10 ? s.toFixed(2) : s.toFixed(1)} s`;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const td = (text, className) => el("td", className, text);

// A table row from [text, className] pairs.
function tableRow(className, cells) {
  const tr = el("tr", className);
  tr.append(...cells.map(([text, cls]) => td(text, cls)));
  return tr;
}

// ── header and hyperparameter form ───────────────────────────────────────────────────────────────────

function renderStatus(s) {
  setText("state", s.state, `state state-${s.state}`);
  $("paused-badge").hidden = !s.paused;
  $("step").textContent = String(s.step); // digits only: tests and scripts read it
  $("max-steps").textContent = s.max_steps ? ` / ${s.max_steps}` : "";
  $("version").textContent = String(s.policy_version);
  $("last-loss").textContent = fmtNum(s.last_loss);
  $("last-reward").textContent = fmtNum(s.last_reward);
  $("last-entropy").textContent = fmtNum(s.last_entropy);
  $("train-tps").textContent = fmtNum(s.tokens_per_s);
  $("gen-tps").textContent = fmtNum(s.generation_tokens_per_s);
  $("workers-live").textContent = String(s.workers_live);
  $("last-checkpoint").textContent = s.last_checkpoint || "–";
  const failure = $("checkpoint-failure");
  failure.hidden = !s.checkpoint_failure;
  failure.textContent = s.checkpoint_failure ? `Checkpoint failed (training goes on): ${s.checkpoint_failure}` : "";
  const disk = $("disk-failure");
  disk.hidden = !s.disk_failure;
  disk.textContent = s.disk_failure ? `Disk: ${s.disk_failure}` : "";
  renderHyperparameterNames(s);
}

// Rebuilt only when the set of names changes, so the operator's choice survives each poll.
function renderHyperparameterNames(s) {
  const numeric = Object.keys(s.hyperparameters).filter((k) => typeof s.hyperparameters[k] === "number");
  const names = [...new Set([...numeric, ...SAMPLING_KEYS])];
  const select = $("hp-name");
  if (names.join(",") !== page.hpKeys) {
    const chosen = select.value;
    select.replaceChildren(...names.map((name) => new Option(name, name)));
    if (names.includes(chosen)) select.value = chosen;
    page.hpKeys = names.join(",");
  }
  const name = select.value;
  const value = name in s.hyperparameters ? s.hyperparameters[name] : s.sampling[name];
  $("hp-value").placeholder = value === undefined ? "new value" : `now ${value}`;
}

// ── weight-sync tables ───────────────────────────────────────────────────────────────────────────────

function renderWorkers(view) {
  $("learner-version").textContent = view.learner_version ?? "–";
  const rows = view.workers.map((w) => {
    // Before the first broadcast (the learner is still starting) or while the worker loads its model,
    // being outside the group is the normal state of things: said, not flagged.
    const early = !view.learner_version || w.state === "starting";
    const waiting = early ? "joins at the next broadcast" : "not in the broadcast group";
    const note = w.dropped_reason || (w.in_broadcast_group ? "" : waiting);
    const tr = tableRow(note && !(early && !w.dropped_reason) ? "flagged" : "", [
      [w.worker_id, "id"], [w.state, `wstate wstate-${w.state}`], [w.policy_version ?? "initial", "version"],
      [w.lag ?? "–", w.lag > 1 ? "lag warn" : "lag"], [fmtSec(w.last_sync_seconds)],
      [fmtBytes(w.last_sync_bytes)], [w.sync_failures, w.sync_failures ? "warn" : ""],
      [fmtSec(w.heartbeat_age_s)], [fmtNum(w.tokens_per_s)], [w.prompts_in_flight], [note, "note"],
    ]);
    tr.dataset.worker = w.worker_id;
    return tr;
  });
  if (!rows.length) {
    rows.push(tableRow("", [["no live workers", "empty"]]));
    rows[0].cells[0].colSpan = 11;
  }
  $("workers").replaceChildren(...rows);
}

// "done 30 · max_turns 2": a tally's counts by kind, largest first.
function byKind(counts) {
  const kinds = Object.entries(counts || {}).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1]);
  return kinds.length ? kinds.map(([kind, n]) => `${kind} ${n}`).join(" · ") : "–";
}

const total = (counts) => Object.values(counts).reduce((a, b) => a + b, 0);

// A panel of one row per worker that reports `key` (its tally since it started); hidden while none does.
function renderTallies(view, key, panel, body, cells) {
  const reporting = view.workers.filter((w) => w[key]);
  $(panel).hidden = !reporting.length;
  $(body).replaceChildren(...reporting.map((w) => tableRow("", [[w.worker_id, "id"], ...cells(w[key])])));
}

// The workers' episodes (rollout.agent).
function renderAgents(view) {
  renderTallies(view, "episodes", "agents", "agent-workers", (e) => {
    const episodes = total(e.episodes);
    const failed = Object.entries(e.tool_calls).some(([kind, n]) => kind !== "ok" && n > 0);
    const latency = e.environment_calls ? e.environment_seconds / e.environment_calls : null;
    return [
      [episodes], [episodes ? fmtNum(e.turns / episodes) : "–"], [byKind(e.episodes), "note"],
      [byKind(e.tool_calls), failed ? "note warn" : "note"], [fmtSec(latency)], [e.splits, e.splits ? "warn" : ""],
    ];
  });
}

// What the LLM judge spent on each worker's groups (reward.judge).
const JUDGE_FAILURES = ["timeout", "error", "unparseable"];
function renderJudge(view) {
  renderTallies(view, "judge", "judge", "judge-workers", (j) => {
    const items = total(j.items);
    const failed = JUDGE_FAILURES.reduce((n, kind) => n + (j.items[kind] || 0), 0);
    return [
      [items], [byKind(j.items), "note"], [failed, failed ? "warn" : ""], [j.calls], [j.cache_hits], [j.tokens],
      [fmtSec(items ? j.seconds / items : null)],
    ];
  });
}

function renderWeights(pageOfSyncs) {
  const rows = pageOfSyncs.items.map((e) => {
    const dropped = Object.entries(e.dropped).map(([id, why]) => `${id}: ${why}`);
    if (e.error) dropped.unshift(`${e.phase || "failed"}: ${e.error}`);
    return tableRow(e.outcome === "failed" ? "failed" : "", [
      [e.version], [e.outcome, `outcome outcome-${e.outcome}`], [fmtSec(e.seconds)], [fmtBytes(e.bytes)],
      [e.members.length ? e.members.join(", ") : "none"], [dropped.join("; ") || "–", "note"],
    ]);
  });
  $("broadcasts").replaceChildren(...rows);
}

// ── metrics and charts ───────────────────────────────────────────────────────────────────────────────

async function pollMetrics(status) {
  // A run resumed from an older checkpoint restarts its step count: the rows we hold are history that
  // was discarded, and `since` would skip the new ones. (Step 0 without a live learner is no evidence.)
  if (status.learner_alive && status.step < page.lastStep) {
    page.rows = [];
    page.lastStep = 0;
  }
  // First load of a long run: only the window we keep, instead of paging through all of it.
  let since = page.rows.length ? page.lastStep : Math.max(page.lastStep, status.step - MAX_ROWS);
  for (let i = 0; i < MAX_PAGES_PER_TICK; i++) {
    const data = await api("GET", `/api/v1/metrics?since=${since}&limit=${PAGE_ROWS}`);
    for (const row of data.rows) if (row.step > page.lastStep) page.rows.push(row);
    page.lastStep = Math.max(page.lastStep, data.last_step);
    since = page.lastStep;
    if (data.rows.length < PAGE_ROWS) break;
  }
  if (page.rows.length > MAX_ROWS) page.rows.splice(0, page.rows.length - MAX_ROWS);
}

// The status is the learner's heartbeat (every 2 s), the step rows are written as each step ends: where
// the newest row is ahead of the status, the header shows that row, never a step behind the charts.
function renderNewestRow(status) {
  const row = page.rows.at(-1);
  if (!row || row.step <= status.step) return;
  $("step").textContent = String(row.step);
  $("version").textContent = String(row.policy_version);
  $("last-loss").textContent = fmtNum(row.metrics["loss/value"] ?? null);
  $("last-reward").textContent = fmtNum(row.metrics["rollout/reward_mean"] ?? null);
  $("last-entropy").textContent = fmtNum(row.metrics["loss/entropy"] ?? null);
}

async function pollEvals() {
  const data = await api("GET", "/api/v1/evals?limit=500");
  page.evals = data.items.map((e) => ({ step: e.policy_version, metrics: { "eval/pass@1": e.pass_at["1"] } }));
}

function drawCharts() {
  for (const chart of page.charts) chart.draw(seriesFor(chart.spec, chart.spec.evals ? page.evals : page.rows));
}

// ── the poll loop ────────────────────────────────────────────────────────────────────────────────────

let timer = null;
let polling = false;

function schedule(ms) {
  clearTimeout(timer);
  timer = setTimeout(tick, ms);
}

// One poll at a time: a slow answer delays the next instead of piling requests onto a busy service.
async function tick() {
  if (polling) return;
  polling = true;
  try {
    const [status, workers, weights] = await Promise.all([
      api("GET", "/api/v1/status"),
      api("GET", "/api/v1/workers"),
      api("GET", "/api/v1/weights?limit=10"),
    ]);
    page.status = status;
    renderStatus(status);
    renderWorkers(workers);
    renderAgents(workers);
    renderJudge(workers);
    renderWeights(weights);
    await pollMetrics(status);
    renderNewestRow(status);
    await pollEvals();
    drawCharts();
    page.authFailed = false;
    setConn(`live · ${new Date().toLocaleTimeString()}`, "ok");
  } catch (err) {
    if (isAuthError(err)) reportAuth(err, true);
    setConn(describeError(err), "error");
  } finally {
    polling = false;
    schedule(POLL_MS);
  }
}

// ── commands ─────────────────────────────────────────────────────────────────────────────────────────

// A command waits for every target's answer (up to control.command_timeout_s): its button stays disabled
// meanwhile, since a second click would only queue it again; the others stay usable (stop while paused).
async function send(button, label, method, path, body) {
  button.disabled = true;
  showMessage(`${label}: sent, waiting for the fleet's answer…`, "pending");
  try {
    const resp = await api(method, path, body);
    showMessage(describeResponse(resp), resp.outcome === "applied" ? "ok" : "warn");
  } catch (err) {
    if (isAuthError(err)) reportAuth(err, false);
    else showMessage(`${label}: ${describeError(err)}`, "error");
  } finally {
    button.disabled = false;
    schedule(0);
  }
}

function setup() {
  $("token").value = savedToken();
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const token = $("token").value.trim();
    if (token) localStorage.setItem(TOKEN_KEY, token);
    else localStorage.removeItem(TOKEN_KEY);
    page.authFailed = false;
    showMessage(token ? "Token saved." : "Token cleared.", "ok");
    schedule(0);
  });

  for (const button of document.querySelectorAll("[data-command]")) {
    button.addEventListener("click", () => {
      const command = button.dataset.command;
      const ask = "Stop the run? The learner writes a final checkpoint and exits; the workers stop too.";
      if (command === "stop" && !confirm(ask)) return;
      send(button, command, "POST", `/api/v1/${command}`);
    });
  }

  $("hp-name").addEventListener("change", () => page.status && renderHyperparameterNames(page.status));
  $("hp-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const [name, raw] = [$("hp-name").value, $("hp-value").value.trim()];
    const value = Number(raw);
    if (!name || raw === "" || !Number.isFinite(value)) {
      showMessage("Choose a hyperparameter and enter a number.", "error");
      return;
    }
    send($("hp-apply"), `set ${name}`, "PATCH", "/api/v1/hyperparameters", { [name]: value });
  });

  const container = $("charts");
  page.charts = CHARTS.map((spec) => new LineChart(container, spec));
  window.addEventListener("resize", drawCharts);
  schedule(0);
}

document.addEventListener("DOMContentLoaded", setup);
