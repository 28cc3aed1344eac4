// The operator console: the list of turns, one turn's timeline and event log, the
// approvals inbox, the fleet's model capacity. It polls the gateway once a second; data
// goes in with textContent only.
// Uses keyHeaders(), el(), fmtSeconds() and errorText() from app.js (loaded first).
"use strict";

const CONSOLE_POLL_MS = 1000;
const consoleState = { open: null, timer: null, before: null, lastInbox: [], capacityRefused: null };

const q = (sel, root = document) => root.querySelector(sel);

function clock(ts) {
  if (typeof ts !== "number") return "-";
  return new Date(ts * 1000).toLocaleTimeString();
}

function countsText(calls) {
  const parts = Object.entries(calls || {}).map(([s, n]) => s + " " + n);
  return parts.length ? parts.join(", ") : "-";
}

async function getJSON(url) {
  const res = await fetch(url, { headers: keyHeaders() });
  if (!res.ok) throw new Error(await errorText(res));
  return res.json();
}

function listUrl() {
  const params = new URLSearchParams({ limit: "50" });
  const status = q("#f-status").value;
  const agent = q("#f-agent").value.trim();
  if (status) params.set("status", status);
  if (agent) params.set("agent", agent);
  return "/v1/turns?" + params.toString();
}

// As the chat page says it (app.js): "waiting for model capacity (position 2, about 4 s)".
function waitText(position, waitS) {
  const bits = [];
  if (position != null) bits.push("position " + position);
  if (waitS != null) bits.push("about " + Math.ceil(waitS) + " s");
  return "waiting for model capacity" + (bits.length ? " (" + bits.join(", ") + ")" : "");
}

function turnRow(t) {
  const tr = el("tr");
  tr.dataset.turnId = t.turn_id;
  tr.dataset.status = t.status;
  tr.tabIndex = 0;
  tr.setAttribute("aria-label", "open turn " + t.turn_id);
  const idCell = el("td", "mono", t.turn_id.slice(0, 12));
  idCell.title = t.turn_id;
  const statusCell = el("td", "st st-" + t.status, t.status);
  if (t.model_wait) {
    tr.dataset.modelWait = "true";
    const mark = el("span", "cap-wait", " · capacity");
    mark.title = waitText(t.model_wait.position, null);
    statusCell.append(mark);
  }
  if (t.conversation_waiting) {
    // Queued behind another turn of its conversation (one runs at a time).
    const mark = el("span", "conv-wait", " · in line");
    mark.title = "waits for the turn before it in conversation " + t.conversation_id;
    statusCell.append(mark);
  }
  if (t.conversation_id) idCell.title += " · conversation " + t.conversation_id;
  tr.append(
    idCell,
    statusCell,
    el("td", null, t.agent || "-"),
    el("td", null, clock(t.started_at)),
    el("td", null, t.duration_s == null ? "-" : fmtSeconds(t.duration_s)),
    el("td", "calls", countsText(t.calls)),
    el("td", t.pending_interactions.length ? "pending" : "muted",
      String(t.pending_interactions.length)),
  );
  if (consoleState.open === t.turn_id) tr.classList.add("selected");
  const open = () => openTurn(t.turn_id);
  tr.addEventListener("click", open);
  tr.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); open(); } });
  return tr;
}

async function refreshList() {
  const body = await getJSON(listUrl());
  const tbody = q("#turns tbody");
  const focused = document.activeElement && document.activeElement.dataset
    ? document.activeElement.dataset.turnId : null;
  tbody.replaceChildren(...body.turns.map(turnRow));
  if (focused) {
    const again = tbody.querySelector(`tr[data-turn-id="${CSS.escape(focused)}"]`);
    if (again) again.focus();
  }
  consoleState.before = body.next_before;
  q("#more").hidden = body.next_before == null;
  const n = body.turns.length;
  q("#list-state").textContent = n + (n === 1 ? " turn · " : " turns · ") + new Date().toLocaleTimeString();
}

async function loadOlder() {
  if (consoleState.before == null) return;
  const body = await getJSON(listUrl() + "&before=" + encodeURIComponent(consoleState.before));
  q("#turns tbody").append(...body.turns.map(turnRow));
  consoleState.before = body.next_before;
  q("#more").hidden = body.next_before == null;
}

function inboxItem(p) {
  const li = el("li", "inbox-item");
  li.dataset.turnId = p.turn_id;
  li.dataset.requestId = p.request_id;
  const head = el("div", "inbox-head");
  head.append(el("strong", null, p.tool || p.kind), el("span", "mono muted", " " + p.turn_id.slice(0, 12)));
  if (p.parent_turn_id) {
    head.append(el("span", "muted", ` sub-agent ${p.agent || ""} of ${p.parent_turn_id.slice(0, 12)}`));
  }
  const countdown = el("span", "countdown");
  countdown.dataset.expiresAt = String(p.expires_at);
  li.append(head, el("div", "prompt", p.prompt), countdown);
  // A question for the user (`input`): its answer, JSON or plain text, typed here.
  const value = p.kind === "input" ? el("input", "answer") : null;
  const refused = el("span", "answer-error");
  if (value) {
    value.placeholder = p.answer_schema ? JSON.stringify(p.answer_schema) : "answer";
    li.append(value, refused);
  }
  const approve = el("button", "approve", value ? "Answer" : "Approve");
  const deny = el("button", "deny", value ? "Decline" : "Deny");
  approve.type = deny.type = "button";
  const answer = async (decision) => {
    approve.disabled = deny.disabled = true;
    const body = value && decision === "approve" ? { decision, value: value.value } : { decision };
    const res = await fetch(
      `/v1/console/turns/${encodeURIComponent(p.turn_id)}/interactions/${encodeURIComponent(p.request_id)}`,
      { method: "POST", headers: keyHeaders(), body: JSON.stringify(body) },
    );
    if (res.status === 422 && value) {
      // It does not fit the question's schema: the question stays open.
      refused.textContent = await errorText(res);
      approve.disabled = deny.disabled = false;
      return;
    }
    li.classList.add(res.ok ? decision === "approve" ? "approved" : "denied" : "failed");
    li.querySelector(".countdown").textContent = res.ok ? decision + "d" : await errorText(res);
  };
  approve.addEventListener("click", () => answer("approve").catch(() => {}));
  deny.addEventListener("click", () => answer("deny").catch(() => {}));
  const buttons = el("div", "inbox-buttons");
  buttons.append(approve, deny);
  li.append(buttons);
  return li;
}

async function refreshInbox() {
  const body = await getJSON("/v1/interactions");
  const list = q("#inbox");
  const key = (p) => p.turn_id + "/" + p.request_id;
  const wanted = new Set(body.interactions.map(key));
  // Keep items in place (and focus on their buttons); add new ones, drop closed ones.
  for (const li of Array.from(list.children)) {
    if (!wanted.has(li.dataset.turnId + "/" + li.dataset.requestId) && !li.classList.contains("approved")
      && !li.classList.contains("denied")) li.remove();
  }
  const have = new Set(Array.from(list.children, (li) => li.dataset.turnId + "/" + li.dataset.requestId));
  for (const p of body.interactions) if (!have.has(key(p))) list.append(inboxItem(p));
  q("#inbox-empty").hidden = list.children.length > 0;
  tickCountdowns();
}

function tickCountdowns() {
  for (const node of document.querySelectorAll("#inbox .inbox-item:not(.approved):not(.denied) .countdown")) {
    const left = Math.max(0, Number(node.dataset.expiresAt) - Date.now() / 1000);
    node.textContent = Math.ceil(left) + "s left";
  }
}

function pct(t, t0, span) {
  return Math.max(0, Math.min(100, ((t - t0) / span) * 100));
}

function timelineRow(label, cls, start, end, t0, span, marks, detail) {
  const row = el("div", "tl-row " + cls);
  const name = el("div", "tl-label", label);
  const track = el("div", "tl-track");
  if (typeof start === "number") {
    const bar = el("div", "tl-bar");
    bar.style.left = pct(start, t0, span) + "%";
    bar.style.width = Math.max(0.5, pct(end, t0, span) - pct(start, t0, span)) + "%";
    bar.title = label + ": " + fmtSeconds(Math.max(0, end - start));
    track.append(bar);
    for (const [kind, seconds] of marks) {
      const m = el("div", "tl-mark " + kind);
      m.style.left = pct(start + seconds, t0, span) + "%";
      m.title = kind + " " + seconds + "s";
      track.append(m);
    }
  }
  row.append(name, track, detail);
  return row;
}

function callDetail(c, flowerUrl) {
  const d = el("div", "tl-detail");
  const took = c.duration_ms == null ? "" : fmtSeconds(c.duration_ms / 1000) + " ";
  d.append(el("span", "st st-" + c.status, c.status + (c.overran ? " · overran" : "")));
  d.append(el("span", "muted", " " + took + "· budget " + (c.budget_s ?? "-") + "s · soft "
    + (c.soft_timeout_s ?? "-") + "s · hard " + (c.timeout_s ?? "-") + "s · "
    + (c.worker || "-") + " pid " + (c.pid ?? "-") + " "));
  if (c.task_id) {
    const a = el("a", "flower", "Flower");
    a.href = flowerUrl + "/task/" + encodeURIComponent(c.task_id);
    a.target = "_blank";
    a.rel = "noopener";
    d.append(a);
  }
  return d;
}

function renderTimeline(view) {
  const t0 = view.started_at || view.created_at || view.now;
  const end = view.ended_at || view.now;
  let span = Math.max(end - t0, 0.001);
  for (const c of view.calls) {
    if (typeof c.started_at === "number" && typeof c.timeout_s === "number") {
      span = Math.max(span, Math.min(c.started_at + c.timeout_s, end + span * 0.25) - t0);
    }
  }
  const rows = [];
  for (const r of view.rounds) {
    const stop = r.finished_at ?? view.now;
    const detail = el("div", "tl-detail");
    const notes = [fmtSeconds(stop - r.started_at)];
    if (r.code) notes.push(r.code);
    if (r.queued_ms) notes.push("waited " + fmtSeconds(r.queued_ms / 1000) + " for model capacity");
    detail.append(el("span", "st st-" + r.status, r.status), el("span", "muted", " " + notes.join(" · ")));
    const fork = el("button", "fork", "fork here");
    fork.type = "button";
    fork.title = "a new turn from the history before round " + r.round;
    fork.addEventListener("click", () => replayOpen("fork", { at_round: r.round }).catch(() => {}));
    detail.append(fork);
    const row = timelineRow("model round " + r.round, "round st-" + r.status, r.started_at, stop, t0, span, [], detail);
    row.dataset.kind = "round";
    row.dataset.status = r.status;
    rows.push(row);
  }
  for (const c of view.calls) {
    const stop = c.finished_at ?? view.now;
    const marks = [];
    if (c.budget_s) marks.push(["budget", c.budget_s]);
    if (c.soft_timeout_s) marks.push(["soft", c.soft_timeout_s]);
    if (c.timeout_s) marks.push(["hard", c.timeout_s]);
    const row = timelineRow(c.tool + " (r" + (c.round ?? "?") + ")", "call st-" + c.status,
      c.started_at, stop, t0, span, marks, callDetail(c, view.flower_url));
    row.dataset.kind = "call";
    row.dataset.status = c.status;
    row.dataset.callId = c.call_id;
    if (c.overran) row.classList.add("overran");
    rows.push(row);
  }
  for (const w of view.waitpoints || []) rows.push(waitpointRow(w));
  if (view.webhook) rows.push(webhookRow(view.webhook));
  q("#timeline").replaceChildren(...rows);
  q("#eventlog").replaceChildren(...view.events.map((e) => {
    const li = el("li", "ev ev-" + e.type);
    const f = e.fields || {};
    const bits = ["tool", "model", "deployment", "status", "code", "reason", "request_id", "decision", "error"]
      .filter((k) => f[k] != null).map((k) => k + "=" + f[k]);
    if (e.type === "llm_queued") bits.unshift(waitText(f.position, f.wait_s));
    if (f.queued_ms) bits.push("waited " + fmtSeconds(f.queued_ms / 1000));
    li.append(el("span", "muted", clock(e.ts) + " #" + e.seq + " "), el("strong", null, e.type), el("span", null, " " + bits.join(" ")));
    return li;
  }));
}

// A call waiting on its waitpoint: how long it has waited, and how long it may still.
function waitpointRow(w) {
  const row = el("div", "tl-waitpoint");
  row.dataset.kind = "waitpoint";
  row.dataset.callId = w.call_id;
  row.append(el("strong", null, "waiting "), el("span", null, w.tool + " on " + w.id),
    el("span", "muted", " · open " + fmtSeconds(w.age_s) + " · " + fmtSeconds(w.left_s) +
      " of " + fmtSeconds(w.timeout_s) + " left"));
  return row;
}

// The turn's webhook delivery: its status, and each attempt's answer.
function webhookRow(w) {
  const row = el("div", "tl-webhook");
  row.dataset.kind = "webhook";
  row.dataset.status = w.status;
  const tries = w.tries.map((a) => "#" + a.n + " " + (a.error || a.status_code) + " in " + a.duration_ms + " ms");
  row.append(el("strong", null, "webhook "), el("span", "st st-" + w.status, w.status),
    el("span", "muted", " " + w.url + " · " + w.attempts + " attempt(s)" + (tries.length ? " · " + tries.join(", ") : "")));
  return row;
}

async function refreshView() {
  const id = consoleState.open;
  if (!id) return;
  const view = await getJSON("/v1/turns/" + encodeURIComponent(id) + "/timeline");
  if (consoleState.open !== id) return;
  const t = view.turn;
  q("#view-title").textContent = "turn " + id.slice(0, 12) + (t.agent ? " · " + t.agent : "");
  const badge = q("#view-status");
  badge.textContent = t.status + (t.abort_reason ? " (" + t.abort_reason + ")" : "");
  badge.className = "badge st-" + t.status;
  badge.dataset.status = t.status;
  q("#view-abort").disabled = !(t.status === "running" || t.status === "queued");
  q("#view-retry").disabled = !(t.status === "error" || t.status === "aborted");
  showWait(t.model_wait, view);
  q("#view-spend").textContent = spendText(view.spend);
  showSource(view.source);
  renderTimeline(view);
}

// A retry's or fork's source turn (docs/retry.md), a link that opens it.
function showSource(source) {
  const p = q("#view-source");
  if (!source) {
    p.replaceChildren();
    return;
  }
  const a = el("a", "source-link", source.turn_id.slice(0, 12));
  a.href = "#";
  a.dataset.turnId = source.turn_id;
  a.addEventListener("click", (ev) => {
    ev.preventDefault();
    openTurn(source.turn_id);
  });
  p.replaceChildren(el("span", null, source.kind + " of "), a,
    el("span", null, " from round " + source.from_round));
}

// A turn's spend with its sub-agents' (docs/spend.md), and its budget.
function spendText(s) {
  if (!s) return "";
  let text = "spend: " + fmtCount(s.total_tokens) + " tokens";
  if (s.cost_usd) text += " · $" + Number(s.cost_usd).toFixed(4);
  const limits = [];
  if (s.max_tokens != null) limits.push(fmtCount(s.max_tokens) + " tokens");
  if (s.max_cost_usd != null) limits.push("$" + s.max_cost_usd);
  return text + (limits.length ? " · budget " + limits.join(", ") : "");
}

// Tokens and cost per key and per model over the last day, from /v1/usage (a key sees its
// own); read every SPEND_POLL_MS, not every second.
const SPEND_POLL_MS = 10000;
let spendReadAt = 0;

function spendTable(rows, by) {
  const table = el("table", "spend");
  const head = el("tr", "");
  for (const name of [by, "turns", "tokens", "cost"]) head.append(el("th", "", name));
  table.append(head);
  for (const r of rows) {
    const tr = el("tr", "");
    tr.append(
      el("td", "", r[by] == null ? "(none)" : String(r[by])),
      el("td", "", fmtCount(r.turns)),
      el("td", "", fmtCount(r.total_tokens)),
      el("td", "", r.cost_usd ? "$" + Number(r.cost_usd).toFixed(4) : "-"),
    );
    table.append(tr);
  }
  return table;
}

async function refreshSpend() {
  if (Date.now() - spendReadAt < SPEND_POLL_MS) return;
  spendReadAt = Date.now();
  const since = String(Math.floor(Date.now() / 1000) - 86400);
  const note = q("#spend-state");
  const tables = [];
  for (const by of ["key", "model"]) {
    const res = await fetch("/v1/usage?group_by=" + by + "&since=" + since, { headers: keyHeaders() });
    if (!res.ok) {
      note.textContent = await errorText(res);
      return;
    }
    const body = await res.json();
    if (body.rows.length) tables.push(spendTable(body.rows, by));
  }
  q("#spend").replaceChildren(...tables);
  note.textContent = tables.length ? "" : "Nothing spent in the last day.";
}

// A round of the turn waits for model capacity: where it stands, from the turn's state and
// its last `llm_queued` event.
function showWait(wait, view) {
  const node = q("#view-wait");
  node.hidden = !wait;
  if (!wait) return;
  const last = view.events.filter((e) => e.type === "llm_queued").pop();
  const f = last ? last.fields : {};
  let text = waitText(wait.position ?? f.position, f.wait_s);
  if (f.model) text += " · " + f.model;
  if (typeof wait.since === "number") text += " · waiting " + fmtSeconds(Math.max(0, view.now - wait.since));
  node.textContent = text;
}

function fmtCount(n) {
  return n == null ? "-" : Number(n).toLocaleString("en-US");
}

function ofLimit(used, limit) {
  return fmtCount(used) + (limit ? " / " + fmtCount(limit) : "");
}

// Times come from Redis' clock (`now_ms`), not this browser's: no skew.
function pausedFor(untilMs, nowMs) {
  return untilMs && untilMs > nowMs ? "paused, " + fmtSeconds((untilMs - nowMs) / 1000) + " left" : null;
}

function capacityStat(cls, label, value) {
  const span = el("span", "cap-stat " + cls);
  span.append(el("span", "muted", label + " "), el("span", "v", value));
  return span;
}

function capacityItem(m) {
  const li = el("li", "cap-model");
  li.dataset.model = m.model;
  const limits = m.limits || {};
  const paused = pausedFor(m.paused_until_ms, m.now_ms);
  li.dataset.paused = String(Boolean(paused));
  const head = el("div", "cap-head");
  head.append(el("strong", "mono", m.model));
  if (paused) head.append(el("span", "badge cap-paused", paused));
  if (!m.configured) head.append(el("span", "muted", "no limits configured"));
  const stats = el("div", "cap-stats");
  stats.append(
    capacityStat("cap-queued-interactive", "queued interactive", fmtCount(m.queued.interactive)),
    capacityStat("cap-queued-background", "background", fmtCount(m.queued.background)),
    capacityStat("cap-streams", "streams", ofLimit(m.streams_in_use, limits.streams)),
    capacityStat("cap-requests", "requests/min", ofLimit(m.requests_last_minute, limits.rpm)),
    capacityStat("cap-tokens", "tokens/min", ofLimit(m.tokens_last_minute, limits.tpm)),
  );
  const deps = el("ul", "cap-deps");
  for (const [name, d] of Object.entries(m.deployments || {})) {
    const item = el("li", "cap-dep breaker-" + d.breaker);
    item.dataset.deployment = name;
    item.dataset.breaker = d.breaker;
    const bits = ["breaker " + d.breaker.replace("_", "-")];
    if (d.breaker === "open" && d.open_until_ms > m.now_ms) {
      bits[0] += " " + fmtSeconds((d.open_until_ms - m.now_ms) / 1000);
    }
    if (d.failures) bits.push(d.failures + " failed" + (d.last_failure ? " (" + d.last_failure + ")" : ""));
    bits.push("streams " + ofLimit(d.streams_in_use, d.limits && d.limits.streams));
    const depPaused = pausedFor(d.paused_until_ms, m.now_ms);
    if (depPaused) bits.push(depPaused);
    item.append(el("span", "mono", name), el("span", null, " · " + bits.join(" · ")));
    deps.append(item);
  }
  li.append(head, stats, deps);
  return li;
}

// The MCP servers of AGENTQ_MCP_SERVERS, as the I/O workers last found them: a server that
// keeps failing shows its failures in a row and its last error (admins only, as above).
function renderMcpServers(servers) {
  const names = Object.keys(servers).sort();
  q("#mcp-title").hidden = q("#mcp-servers").hidden = names.length === 0;
  q("#mcp-servers").replaceChildren(...names.map((name) => {
    const s = servers[name];
    const li = el("li", "mcp-server");
    li.dataset.ok = String(Boolean(s.ok));
    li.append(el("strong", "", name), el("span", "", s.ok ? " ok" : " failing"));
    if (!s.ok) {
      li.append(el("span", "muted", " · " + s.failures + " in a row"));
      if (s.error) li.append(el("div", "muted", s.error));
    }
    // Tools of its listing that are not offered (a bad name or schema, a shared name).
    if (s.refused && s.refused.length) {
      const why = s.refused.map((r) => (r.tool || "(no name)") + ": " + r.why).join("; ");
      li.append(el("div", "muted", s.refused.length + " tool(s) refused · " + why));
    }
    return li;
  }));
}

// Admin keys only (like /metrics): another key sees a note, not an error, and is not
// refused again every second (until the page uses another key).
async function refreshCapacity() {
  const note = q("#capacity-state");
  const headers = keyHeaders();
  const asking = JSON.stringify(headers);
  if (consoleState.capacityRefused === asking) return;
  let res;
  try {
    res = await fetch("/v1/capacity", { headers });
  } catch (err) {
    note.textContent = String(err.message || err);
    return;
  }
  if (res.status === 401 || res.status === 403) {
    consoleState.capacityRefused = asking;
    q("#capacity").replaceChildren();
    note.dataset.state = "forbidden";
    note.textContent = "Model capacity is shown to admin keys only.";
    return;
  }
  if (!res.ok) {
    note.dataset.state = "error";
    note.textContent = await errorText(res);
    return;
  }
  const body = await res.json();
  q("#capacity").replaceChildren(...body.models.map(capacityItem));
  renderMcpServers(body.mcp_servers || {});
  note.dataset.state = "ok";
  note.textContent = body.models.length ? "" : "No model known yet.";
}

function openTurn(id) {
  consoleState.open = id;
  q("#turn-view").hidden = false;
  q("#turn-view").dataset.turnId = id;
  for (const tr of document.querySelectorAll("#turns tbody tr")) {
    tr.classList.toggle("selected", tr.dataset.turnId === id);
  }
  refreshView().catch((err) => { q("#view-status").textContent = String(err.message || err); });
}

// Retry the open turn, or fork it at a round (docs/retry.md); the new turn opens.
async function replayOpen(what, body) {
  const id = consoleState.open;
  if (!id) return;
  const res = await fetch("/v1/console/turns/" + encodeURIComponent(id) + "/" + what,
    { method: "POST", headers: keyHeaders(), body: JSON.stringify(body) });
  if (!res.ok) {
    q("#view-status").textContent = await errorText(res);
    return;
  }
  openTurn((await res.json()).turn_id);
}

async function abortOpen() {
  const id = consoleState.open;
  if (!id) return;
  q("#view-abort").disabled = true;
  const res = await fetch("/v1/console/turns/" + encodeURIComponent(id) + "/abort",
    { method: "POST", headers: keyHeaders() });
  if (!res.ok) q("#view-status").textContent = await errorText(res);
  await refreshView();
}

async function pollConsole() {
  if (q("#console").hidden) return;
  await Promise.all([
    refreshList(), refreshInbox(), refreshView(), refreshCapacity(), refreshSpend(),
  ]);
}

function showTab(name) {
  const consoleOn = name === "console";
  q("#chat").hidden = consoleOn;
  q("#console").hidden = !consoleOn;
  q("#tab-chat").setAttribute("aria-selected", String(!consoleOn));
  q("#tab-console").setAttribute("aria-selected", String(consoleOn));
  if (consoleOn) {
    if (location.hash !== "#console") history.replaceState(null, "", "#console");
    pollConsole().catch((err) => { q("#list-state").textContent = String(err.message || err); });
  } else if (location.hash) {
    history.replaceState(null, "", location.pathname);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  q("#tab-chat").addEventListener("click", () => showTab("chat"));
  q("#tab-console").addEventListener("click", () => showTab("console"));
  q("#filters").addEventListener("submit", (e) => e.preventDefault());
  q("#f-status").addEventListener("change", () => refreshList().catch(() => {}));
  q("#f-agent").addEventListener("input", () => refreshList().catch(() => {}));
  q("#more").addEventListener("click", () => loadOlder().catch(() => {}));
  q("#view-abort").addEventListener("click", () => abortOpen().catch(() => {}));
  q("#view-retry").addEventListener("click", () => replayOpen("retry", {}).catch(() => {}));
  q("#view-close").addEventListener("click", () => {
    consoleState.open = null;
    q("#turn-view").hidden = true;
  });
  setInterval(() => {
    pollConsole().catch((err) => { q("#list-state").textContent = String(err.message || err); });
  }, CONSOLE_POLL_MS);
  setInterval(tickCountdowns, 250);
  if (location.hash === "#console") showTab("console");
});
