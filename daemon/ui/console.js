// kvaffined's console: reads the daemon's read-only API every two seconds, and explains a
// request by keying its tokens here, in the browser, with kvaffine's core (wasm-bindgen).
import init, { blockKeys } from "/ui/keys/kvaffine_keys.js";

const $ = (id) => document.getElementById(id);
const REFRESH_MS = 2000;

// The token, when the index needs one: from the URL fragment (never sent to a server) or
// typed in, kept for this tab only.
const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.get("token")) {
  sessionStorage.setItem("kvaffine-token", fragment.get("token"));
  // Out of the address bar and the history: a link copied from here carries no token.
  history.replaceState(null, "", location.pathname + location.search);
}
$("token").value = sessionStorage.getItem("kvaffine-token") || "";
$("token").addEventListener("change", () => {
  sessionStorage.setItem("kvaffine-token", $("token").value);
  refresh();
});

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  const token = sessionStorage.getItem("kvaffine-token");
  if (token) headers.authorization = `Bearer ${token}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) throw new Error("this index needs a token (see the field above)");
  const text = await response.text();
  if (!response.ok) {
    let message = text;
    try { message = JSON.parse(text).error || text; } catch { /* plain text */ }
    throw new Error(`${path}: ${response.status} ${message}`);
  }
  return text;
}

const json = async (path, options) => JSON.parse(await api(path, options));

function cell(row, value, className) {
  const td = row.insertCell();
  td.textContent = value === undefined || value === null ? "–" : String(value);
  if (className) td.className = className;
  return td;
}

const number = (n) => (n === undefined || n === null ? "–" : Number(n).toLocaleString("en-US"));
const bytes = (n) => {
  if (!Number.isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let u = 0;
  while (n >= 1024 && u < units.length - 1) { n /= 1024; u++; }
  return `${n.toFixed(u ? 1 : 0)} ${units[u]}`;
};

// Sums every series of a metric in a Prometheus text exposition.
function metric(text, name) {
  let sum = 0, seen = false;
  for (const line of text.split("\n")) {
    if (!line.startsWith(name)) continue;
    const rest = line.slice(name.length);
    if (rest[0] !== " " && rest[0] !== "{") continue;
    const value = Number(line.slice(line.lastIndexOf(" ") + 1));
    if (Number.isFinite(value)) { sum += value; seen = true; }
  }
  return seen ? sum : NaN;
}

// What to do about a replica's problem, next to the daemon's own words.
function problems(status) {
  const out = [];
  if (status.misconfigured) out.push(`misconfigured: ${status.misconfigured} — start vLLM with the settings kvaffined keys with (or kvaffined with vLLM's)`);
  if (status.kv_cache_unsupported) out.push(`KV-cache groups kvaffine cannot follow: ${status.kv_cache_unsupported} — its matches count as 0`);
  if (status.scrape_error) out.push(`unreachable: ${status.scrape_error} — ranked after the others`);
  if (status.incomplete) out.push(`index incomplete: ${status.incomplete}`);
  return out;
}

function renderSummary(endpoints, metrics) {
  const synced = endpoints.filter((e) => e.status.synced).length;
  const cards = [
    ["replicas", `${endpoints.length}`],
    ["synced", `${synced} of ${endpoints.length}`],
    ["index entries", number(metric(metrics, "kvaffined_index_entries"))],
    ["index size", bytes(metric(metrics, "kvaffined_index_bytes"))],
    ["booked keys", number(metric(metrics, "kvaffined_booked_keys"))],
    ["lookups", number(metric(metrics, "kvaffined_lookups_total"))],
    ["outcomes", number(metric(metrics, "kvaffined_outcomes_total"))],
    ["prediction error", `${number(metric(metrics, "kvaffined_outcome_prediction_error_tokens_total") || 0)} tokens`],
  ];
  $("summary").replaceChildren(...cards.map(([label, value]) => {
    const div = document.createElement("div");
    div.className = "card";
    div.innerHTML = "<span class=muted></span><b></b>";
    div.firstChild.textContent = label;
    div.lastChild.textContent = value;
    return div;
  }));
}

function renderReplicas(endpoints) {
  const body = $("replicas").tBodies[0];
  body.replaceChildren();
  for (const e of endpoints) {
    const s = e.status, load = s.load || {};
    const row = body.insertRow();
    row.dataset.endpoint = e.endpoint;
    cell(row, e.rank ? `${e.endpoint} (rank ${e.rank})` : e.endpoint);
    cell(row, s.model);
    cell(row, s.synced ? "synced" : "syncing", s.synced ? "good" : "bad");
    cell(row, s.alignment);
    cell(row, number(s.events_applied), "num");
    cell(row, s.last_event_lag_ms === null || s.last_event_lag_ms === undefined ? "–" : `${s.last_event_lag_ms.toFixed(1)} ms`, "num");
    cell(row, load.running, "num");
    cell(row, load.waiting, "num");
    cell(row, load.kv_cache_usage === undefined ? "–" : `${(100 * load.kv_cache_usage).toFixed(1)}%`, "num");
    cell(row, number(e.index_entries), "num");
    const list = problems(s);
    cell(row, list.length ? list.join("; ") : "none", list.length ? "bad" : "muted");
  }
}

function renderCharts(view) {
  const width = 360, height = 120, pad = 4;
  const span = view.bucket_seconds * 1000 * 90;
  const now = Date.now();
  $("charts").replaceChildren(...view.series.map((series) => {
    const div = document.createElement("div");
    div.className = "chart";
    div.dataset.endpoint = series.endpoint;
    const top = Math.max(1, ...series.buckets.map((b) => Math.max(b.predicted_tokens, b.cached_tokens)));
    const x = (ms) => pad + ((ms - (now - span)) / span) * (width - 2 * pad);
    const y = (v) => (v / top) * (height - 2 * pad);
    // Per bucket, two bars side by side: predicted, then served.
    const step = (width - 2 * pad) / 90;
    const bars = series.buckets.map((b) => {
      const left = x(b.start_ms);
      return ["predicted_tokens", "cached_tokens"].map((field, i) =>
        `<rect x="${(left + (i * step) / 2).toFixed(1)}" y="${(height - pad - y(b[field])).toFixed(1)}" ` +
        `width="${(step / 2).toFixed(1)}" height="${y(b[field]).toFixed(1)}" fill="${i ? "#e07b00" : "#2e6fd8"}"/>`).join("");
    }).join("");
    const total = (field) => series.buckets.reduce((sum, b) => sum + b[field], 0);
    div.innerHTML = `<div><b></b> <span class="muted"></span></div>
      <svg width="${width}" height="${height}" viewBox="0 0 ${width} ${height}">
        <rect x="0" y="0" width="${width}" height="${height}" fill="none" stroke="#d8dde6"/>${bars}
      </svg><div class="muted" style="display:flex;justify-content:space-between"><span>15 min ago</span><span>now</span></div>`;
    div.querySelector("b").textContent = series.endpoint;
    div.querySelector("span").textContent =
      `${number(total("predicted_tokens"))} predicted, ${number(total("cached_tokens"))} served, peak ${number(top)} per ${view.bucket_seconds} s`;
    return div;
  }));
  if (!view.series.length) $("charts").textContent = "No outcomes reported yet.";
}

function renderDecisions(view) {
  const body = $("decisions").tBodies[0];
  body.replaceChildren();
  for (const d of view.recent.slice(0, 50)) {
    const row = body.insertRow();
    cell(row, new Date(d.at_ms).toLocaleTimeString());
    cell(row, d.endpoint);
    cell(row, d.model);
    cell(row, d.reason);
    cell(row, number(d.prompt_tokens), "num");
    cell(row, number(d.predicted_tokens), "num");
    cell(row, number(d.cached_tokens), "num");
    const diff = d.cached_tokens - d.predicted_tokens;
    cell(row, diff === 0 ? "exact" : (diff > 0 ? `+${diff}` : `${diff}`), diff === 0 ? "good" : "bad");
  }
}

async function refresh() {
  try {
    const [endpoints, outcomes, metrics] = await Promise.all([
      json("/v1/endpoints"), json("/v1/outcomes"), api("/metrics"),
    ]);
    renderSummary(endpoints.endpoints, metrics);
    renderReplicas(endpoints.endpoints);
    renderCharts(outcomes);
    renderDecisions(outcomes);
    $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    $("status").className = "status";
  } catch (err) {
    $("status").textContent = err.message;
    $("status").className = "status bad";
  }
}

// ---- explain a request ----

const keysReady = init();

async function explain() {
  const out = $("explain-result");
  out.textContent = "explaining…";
  out.dataset.state = "running";
  try {
    const body = JSON.parse($("explain-body").value);
    const request = { path: $("explain-path").value, body };
    if ($("explain-chat").value) request.chat_tokenize = $("explain-chat").value;
    const tokenized = await json("/v1/explain", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(request),
    });
    await keysReady;
    const options = Object.fromEntries(Object.entries(tokenized.options).filter(([, v]) => v !== null));
    const { hashes } = blockKeys(tokenized.tokens, options);
    // Event keys exceed 2^53: written into the JSON as they are, never through a Number.
    const model = tokenized.model ? `,"model":${JSON.stringify(tokenized.model)}` : "";
    const answer = await json("/v1/lookup", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: `{"keys":[${hashes.map((h) => h.event).join(",")}]${model}}`,
    });
    renderExplained(tokenized, options, hashes, answer);
    out.dataset.state = "done";
  } catch (err) {
    out.textContent = err.message;
    out.className = "bad";
    out.dataset.state = "failed";
  }
}

function renderExplained(tokenized, options, hashes, answer) {
  const out = $("explain-result");
  out.className = "";
  const block = options.blockSize;
  const summary = document.createElement("p");
  summary.id = "explain-summary";
  summary.dataset.blocks = hashes.length;
  summary.dataset.tokens = tokenized.tokens.length;
  summary.textContent = `${number(tokenized.tokens.length)} tokens (tokenized by ${tokenized.tokenized_by}) = ` +
    `${hashes.length} full blocks of ${block}` + (options.cacheSalt ? `, cache_salt ${options.cacheSalt}` : "") +
    (options.loraName ? `, LoRA ${options.loraName}` : "") + `; ranked first: ${answer.ranked[0] || "none"} (${answer.reason}).`;
  const table = document.createElement("table");
  table.id = "explain-table";
  table.innerHTML = `<thead><tr><th>replica</th><th class="num">leading blocks held</th><th class="num">tokens</th>
    <th>first block that misses</th><th>other tiers</th></tr></thead><tbody></tbody>`;
  for (const record of answer.endpoints) {
    const held = record.indexed_blocks ?? record.matched_blocks;
    const row = table.tBodies[0].insertRow();
    row.dataset.endpoint = record.endpoint;
    row.dataset.leadingBlocks = held;
    cell(row, record.endpoint);
    cell(row, `${held} of ${hashes.length}` + (record.matched_blocks > held ? ` (+${record.matched_blocks - held} booked)` : ""), "num");
    cell(row, number(held * block), "num");
    const miss = hashes[held];
    const missCell = cell(row, miss ? `block ${held} (tokens ${held * block}–${(held + 1) * block - 1}), key ${miss.event}` : "none: holds every full block",
      miss ? "" : "good");
    if (miss) missCell.title = miss.full;
    cell(row, Object.entries(record.tiers || {}).map(([tier, n]) => `${tier}: ${n}`).join(", ") || "–", "muted");
  }
  out.replaceChildren(summary, table);
}

$("explain-run").addEventListener("click", explain);

// A shared link: /ui?explain=<url-encoded body>[&path=/v1/responses][&chat_tokenize=render]
const query = new URLSearchParams(location.search);
if (query.get("path")) $("explain-path").value = query.get("path");
if (query.get("chat_tokenize")) $("explain-chat").value = query.get("chat_tokenize");
if (query.get("explain")) {
  $("explain-body").value = query.get("explain");
  explain();
}

refresh();
setInterval(refresh, REFRESH_MS);
