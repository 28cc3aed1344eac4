// The agentq web page: one turn at a time over POST /v1/turns and its SSE stream.
// Event data is only ever put in the page with textContent, never as HTML.
"use strict";

const EVENT_TYPES = [
  "turn_started", "turn_resumed", "llm_started", "llm_queued", "llm_delta", "llm_retry", "llm_finished",
  "tool_started", "tool_progress", "tool_finished", "tool_waiting", "interaction_requested",
  "interaction_answered", "interaction_timed_out", "tool_denied", "subturn_started", "turn_aborted",
  "turn_finished", "turn_error", "turn_queued", "message_injected",
];
const TERMINAL = new Set(["turn_finished", "turn_aborted", "turn_error"]);
const MAX_RECONNECTS = 10;
const RELAY_DEPTH = 8; // the gateway's most: every level of sub-agents

const $ = (sel, root = document) => root.querySelector(sel);
const conversationId = "web-" + Array.from(crypto.getRandomValues(new Uint8Array(8)),
  (b) => b.toString(16).padStart(2, "0")).join("");
// The turns this page follows that have not ended: the running one and any queued behind it.
const active = new Set();
// A key-protected conversation is bound to the key; without keys, to this token.
let conversationToken = null;
// The key lives in this tab's sessionStorage only: never in the URL, never in a cookie.
const KEY_SLOT = "agentq.key";
let pendingPrompt = null;

function apiKey() {
  return sessionStorage.getItem(KEY_SLOT);
}

function keyHeaders() {
  const key = apiKey();
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

function askForKey(message) {
  const form = $("#keyform");
  $("#keymsg").textContent = message;
  form.hidden = false;
  $("#apikey").focus();
  setStatus("error", message);
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmtSeconds(s) {
  if (s < 60) return s.toFixed(1) + "s";
  return Math.floor(s / 60) + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
}

// Same bands as `agentq run`: green under 10 s, yellow to 30 s, red beyond.
function durationBand(s) {
  return s < 10 ? "d-green" : s < 30 ? "d-yellow" : "d-red";
}

// The server's clock stamps events; estimate when, on our monotonic clock, `ts` was.
function localTime(tsSeconds) {
  const age = Math.max(0, Date.now() - tsSeconds * 1000);
  return performance.now() - age;
}

function setStatus(state, text) {
  const node = $("#status");
  node.dataset.state = state;
  node.textContent = text;
}

function setConn(state) {
  const node = $("#conn");
  node.className = "conn " + state;
  node.textContent = state;
}

function authHeaders(token) {
  return { "Authorization": "Bearer " + token, "Content-Type": "application/json" };
}

async function errorText(res) {
  try {
    const body = await res.json();
    return body.error ? body.error.message : res.statusText;
  } catch (_) {
    return res.status + " " + res.statusText;
  }
}

class ToolChip {
  constructor(parent, callId, tool) {
    this.callId = callId;
    this.startedAt = null;
    this.finishedS = null;
    this.node = el("span", "chip queued");
    this.node.dataset.callId = callId;
    this.node.append(el("span", "name", tool), el("span", "elapsed", "–"),
      el("span", "status", "queued"), el("span", "progress", ""));
    parent.append(this.node);
  }

  // What the tool reported with ctx.progress(message, pct): shown while it runs.
  progress(message, pct) {
    if (this.finishedS !== null) return;
    const parts = [];
    if (message) parts.push(String(message).slice(0, 80));
    if (typeof pct === "number" && isFinite(pct)) {
      parts.push(Math.max(0, Math.min(100, Math.round(pct))) + "%");
    }
    $(".progress", this.node).textContent = parts.join(" ");
    if (typeof pct === "number" && isFinite(pct)) this.node.dataset.pct = String(pct);
  }

  // A call waiting on its waitpoint: a button that completes it with JSON typed here, as
  // the system it waits for would POST to its callback URL.
  waitpoint(callbackUrl) {
    if (this.finishedS !== null || !callbackUrl) return;
    const button = el("button", "complete", "Complete…");
    button.type = "button";
    button.addEventListener("click", async () => {
      const text = window.prompt("The call's result, as JSON", "{}");
      if (text === null) return;
      const res = await fetch(callbackUrl, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: text,
      });
      if (!res.ok) $(".progress", this.node).textContent = await errorText(res);
    });
    this.node.append(button);
    this.completeButton = button;
  }

  start(atLocal) {
    if (this.finishedS !== null) return;
    this.startedAt = atLocal;
    this.node.classList.replace("queued", "running");
    $(".status", this.node).textContent = "running";
    this.tick();
  }

  tick() {
    if (this.startedAt === null || this.finishedS !== null) return;
    this.showElapsed((performance.now() - this.startedAt) / 1000);
  }

  showElapsed(s) {
    const span = $(".elapsed", this.node);
    span.textContent = fmtSeconds(s);
    span.className = "elapsed " + durationBand(s);
  }

  finish(status, durationMs, detail) {
    const s = durationMs != null ? durationMs / 1000
      : this.startedAt !== null ? (performance.now() - this.startedAt) / 1000 : null;
    this.finishedS = s === null ? 0 : s;
    if (s !== null) this.showElapsed(s);
    this.node.classList.remove("queued", "running");
    this.node.classList.add("done", "st-" + status);
    this.node.dataset.status = status;
    $(".status", this.node).textContent = status;
    $(".progress", this.node).textContent = "";
    if (this.completeButton) this.completeButton.remove();
    if (detail) this.node.title = detail;
  }
}

// The form of a question for the user (`input`), from its JSON Schema: a choice for an
// enum, a field per property for an object, else one line of text. `value()` is the
// answer as the API takes it (JSON text; plain text for a free-text question).
function answerForm(schema) {
  const node = el("span", "answer-form");
  const error = el("span", "answer-error");
  const field = (sub, name) => {
    let input;
    if (sub && Array.isArray(sub.enum)) {
      input = el("select", "choice");
      for (const v of sub.enum) input.append(el("option", null, String(v)));
    } else {
      input = el("input", "text");
      input.placeholder = name || (sub && sub.description) || "answer";
    }
    node.append(input);
    return () => {
      if (sub && Array.isArray(sub.enum)) return sub.enum[input.selectedIndex];
      if (sub && (sub.type === "number" || sub.type === "integer")) return Number(input.value);
      if (sub && sub.type === "boolean") return input.value === "true";
      return input.value;
    };
  };
  if (schema && schema.type === "object" && schema.properties) {
    const reads = Object.entries(schema.properties).map(([n, sub]) => [n, field(sub, n)]);
    node.append(error);
    const value = () => JSON.stringify(Object.fromEntries(reads.map(([n, r]) => [n, r()])));
    return { node, error, value };
  }
  const read = field(schema, null);
  node.append(error);
  const free = !schema || (schema.type === "string" && !Array.isArray(schema.enum));
  return { node, error, value: () => (free ? read() : JSON.stringify(read())) };
}

class Ask {
  // `who`: the agent call a relayed sub-agent request comes from; it is answered on the
  // sub-agent's own turn, with the parent's token (it opens the turns it started).
  constructor(turn, ev, who) {
    this.turn = turn;
    this.turnId = ev.turn_id || turn.turnId;
    this.requestId = ev.request_id;
    this.deadline = localTime(ev.created_at || ev.ts) + ev.timeout_ms;
    this.node = el("div", "ask pending");
    this.node.dataset.requestId = ev.request_id;
    this.countdown = el("span", "countdown");
    const head = el("div", "ask-head");
    head.append(el("span", "kind", ev.kind));
    if (who) head.append(el("span", "who", who));
    head.append(el("span", "prompt", ev.prompt), this.countdown);
    this.node.append(head);
    const row = el("div", "ask-actions");
    if (ev.kind === "input") {
      this.form = answerForm(ev.answer_schema);
      row.append(this.form.node);
    } else if (ev.kind === "password") {
      this.input = el("input", "secret");
      this.input.type = "password";
      this.input.autocomplete = "current-password";
      this.input.placeholder = "password";
      row.append(this.input);
    }
    const approve = el("button", "approve",
      ev.kind === "password" || ev.kind === "input" ? "Submit" : "Approve");
    const deny = el("button", "deny", ev.kind === "input" ? "Decline" : "Deny");
    approve.type = deny.type = "button";
    approve.addEventListener("click", () => this.answer("approve"));
    deny.addEventListener("click", () => this.answer("deny"));
    row.append(approve, deny);
    this.node.append(row);
    this.buttons = [approve, deny];
    this.tick();
  }

  tick() {
    if (!this.node.classList.contains("pending")) return;
    const left = Math.max(0, (this.deadline - performance.now()) / 1000);
    this.countdown.textContent = Math.ceil(left) + "s left";
    this.countdown.classList.toggle("urgent", left < 10);
  }

  async answer(decision) {
    this.buttons.forEach((b) => { b.disabled = true; });
    const body = { decision };
    if (this.input && decision === "approve") body.value = this.input.value;
    if (this.form && decision === "approve") body.value = this.form.value();
    const url = `/v1/turns/${this.turnId}/interactions/${encodeURIComponent(this.requestId)}`;
    const res = await fetch(url, {
      method: "POST", headers: authHeaders(this.turn.token), body: JSON.stringify(body),
    });
    if (this.input) this.input.value = "";
    if (res.status === 422 && this.form) {
      // The answer does not fit the question's schema: the question stays open.
      this.form.error.textContent = await errorText(res);
      this.buttons.forEach((b) => { b.disabled = false; });
      return;
    }
    if (!res.ok) this.close("closed", await errorText(res));
  }

  close(state, text) {
    this.node.classList.remove("pending");
    this.node.classList.add(state);
    this.buttons.forEach((b) => { b.disabled = true; });
    if (this.input) this.input.disabled = true;
    this.countdown.textContent = text;
  }
}

// A sub-agent's activity (its model text, its tools, its own sub-agents), nested under the
// chip of the agent call that started it; fed by the events relayed with a `path`.
class SubAgent {
  constructor(chip, childTurnId, name) {
    this.turnId = childTurnId;
    this.name = name;
    this.chips = new Map();
    this.children = new Map();
    this.node = el("div", "subagent");
    this.node.dataset.childTurnId = childTurnId;
    this.text = el("div", "sub-text");
    this.tools = el("div", "tools");
    this.node.append(this.text, this.tools);
    chip.node.after(this.node);
  }
}

class TurnView {
  constructor(handle, prompt) {
    this.turnId = handle.turn_id;
    this.token = handle.token;
    this.eventsUrl = handle.events_url;
    this.lastId = null;
    this.lastSeqs = new Map();
    this.done = false;
    this.reconnects = 0;
    this.chips = new Map();
    this.children = new Map();
    this.asks = new Map();
    this.node = el("article", "turn");
    this.node.dataset.turnId = this.turnId;
    this.node.append(el("div", "user", prompt));
    if (handle.injected) this.node.classList.add("joining");
    this.reasoning = el("details", "reasoning");
    this.reasoning.append(el("summary", "", "reasoning"), el("pre", ""));
    this.reasoning.hidden = true;
    this.text = el("div", "answer");
    this.tools = el("div", "tools");
    this.askList = el("div", "asks");
    this.notes = el("div", "notes");
    this.outcome = el("div", "outcome");
    this.node.append(this.reasoning, this.tools, this.askList, this.text, this.notes,
      this.outcome);
    $("#transcript").append(this.node);
    this.timer = setInterval(() => this.tick(), 100);
    active.add(this);
  }

  connect() {
    // Every level of sub-agents: their work shows nested, their approvals are answered here.
    const params = new URLSearchParams({ token: this.token, depth: String(RELAY_DEPTH) });
    // EventSource resends Last-Event-ID itself; ?after= covers a fresh EventSource.
    if (this.lastId) params.set("after", this.lastId);
    const es = new EventSource(`${this.eventsUrl}?${params}`);
    for (const type of EVENT_TYPES) es.addEventListener(type, (e) => this.onMessage(e));
    es.onopen = () => { this.reconnects = 0; setConn("live"); };
    es.onerror = () => {
      if (this.done) return;
      if (es.readyState === EventSource.CLOSED) {
        setConn("offline");
        if (this.reconnects++ < MAX_RECONNECTS) {
          setTimeout(() => { if (!this.done) this.connect(); }, 1000 * this.reconnects);
        } else {
          setStatus("error", "lost the event stream; reload to try again");
        }
      } else {
        setConn("reconnecting");
      }
    };
    this.es = es;
  }

  onMessage(e) {
    const ev = JSON.parse(e.data);
    // A replayed copy after a reconnect; seq counts per turn, and sub-agents relay theirs.
    if (ev.seq <= (this.lastSeqs.get(ev.turn_id) || 0)) return;
    this.lastSeqs.set(ev.turn_id, ev.seq);
    this.lastId = e.lastEventId || this.lastId;
    if (ev.path && ev.path.length) this.applyRelayed(ev);
    else this.apply(ev);
  }

  chip(ev, scope = this) {
    let chip = scope.chips.get(ev.call_id);
    if (!chip) {
      chip = new ToolChip(scope.tools, ev.call_id, ev.tool || "?");
      scope.chips.set(ev.call_id, chip);
    }
    if (ev.child_turn_id && !scope.children.has(ev.child_turn_id)) {
      scope.children.set(ev.child_turn_id, new SubAgent(chip, ev.child_turn_id, ev.tool || "?"));
    }
    return chip;
  }

  // The chip events, the same for the turn and for each sub-agent.
  applyTool(ev, scope) {
    switch (ev.type) {
      case "tool_started":
        this.chip(ev, scope).start(localTime(ev.ts));
        return true;
      case "tool_progress": {
        const chip = this.chip(ev, scope);
        if (ev.state !== "queued" && ev.elapsed_ms != null) {
          // The server measured elapsed time; re-anchor on it to cancel clock skew.
          chip.start(performance.now() - ev.elapsed_ms);
        }
        if (ev.source === "tool" || ev.source === "agent") chip.progress(ev.message, ev.pct);
        return true;
      }
      case "tool_waiting": {
        const chip = this.chip(ev, scope);
        chip.progress(`waiting on ${ev.waitpoint_id} (${ev.timeout_s}s)`);
        chip.waitpoint(ev.callback_url);
        return true;
      }
      case "tool_finished":
        this.chip(ev, scope).finish(ev.status, ev.duration_ms, ev.error || ev.reason);
        return true;
      case "tool_denied":
        if (!scope.chips.get(ev.call_id)) this.chip(ev, scope).finish("denied", null, ev.reason);
        return true;
      case "interaction_requested": {
        const ask = new Ask(this, ev, scope === this ? null : scope.name);
        this.asks.set(`${ev.turn_id}/${ev.request_id}`, ask);
        this.askList.append(ask.node);
        return true;
      }
      case "interaction_answered": {
        const ask = this.asks.get(`${ev.turn_id}/${ev.request_id}`);
        if (ask) ask.close(ev.decision === "approve" ? "approved" : "denied",
          `${ev.decision === "approve" ? "approved" : "denied"} (${ev.by})`);
        return true;
      }
      case "interaction_timed_out": {
        const ask = this.asks.get(`${ev.turn_id}/${ev.request_id}`);
        if (ask) ask.close("timed-out", "timed out: denied");
        return true;
      }
      default:
        return false;
    }
  }

  // A sub-agent's event: into the view nested under the agent call that started it.
  applyRelayed(ev) {
    let scope = this;
    for (const id of ev.path) {
      scope = scope.children.get(id);
      if (!scope) return;
    }
    if (this.applyTool(ev, scope)) return;
    switch (ev.type) {
      case "llm_started":
        if (scope.text.textContent && !scope.text.textContent.endsWith("\n")) {
          scope.text.textContent += "\n";
        }
        break;
      case "llm_delta":
        if (ev.kind !== "reasoning") scope.text.textContent += ev.text;
        break;
      case "turn_finished":
      case "turn_aborted":
      case "turn_error":
        scope.node.dataset.state = ev.type.slice(5);
        break;
      default:
        break;
    }
  }

  apply(ev) {
    if (this.applyTool(ev, this)) return;
    switch (ev.type) {
      case "turn_started":
        this.node.classList.remove("queued-turn", "joining");
        setStatus("running", "running…");
        break;
      case "turn_queued":
        // Another turn of this conversation runs: this one starts when it ends.
        this.node.classList.add("queued-turn");
        this.notes.append(el("div", "note queued-note",
          `queued behind turn ${String(ev.behind).slice(0, 12)} (position ${ev.position})`));
        if (!this.node.classList.contains("joining")) {
          setStatus("running", active.size > 1 ? "running… (a message waits behind it)"
            : "queued…");
        }
        break;
      case "message_injected":
        this.notes.append(el("div", "note injected-note",
          `a message joined this turn (turn ${String(ev.message_turn_id).slice(0, 12)})`));
        break;
      case "llm_queued": {
        const bits = [];
        if (ev.position != null) bits.push("position " + ev.position);
        if (ev.wait_s != null) bits.push("about " + Math.ceil(ev.wait_s) + " s");
        setStatus("queued", "waiting for model capacity" + (bits.length ? " (" + bits.join(", ") + ")" : ""));
        break;
      }
      case "llm_started":
        setStatus("running", "running…");
        if (this.text.textContent && !this.text.textContent.endsWith("\n")) {
          this.text.textContent += "\n";
        }
        this.roundStart = this.text.textContent.length;
        break;
      case "llm_delta":
        if (ev.kind === "reasoning") {
          this.reasoning.hidden = false;
          $("pre", this.reasoning).textContent += ev.text;
        } else {
          this.text.textContent += ev.text;
        }
        break;
      case "llm_retry":
        this.notes.append(el("div", "note", `model retry ${ev.attempt}: ${ev.error}`));
        if (ev.restart) {
          // The round starts over on another stream worker: drop the dead attempt's text.
          this.text.textContent = this.text.textContent.slice(0, this.roundStart || 0);
        }
        break;
      case "subturn_started":
        this.notes.append(el("div", "note", `agent ${ev.agent} runs as turn ${ev.child_turn_id}`));
        break;
      case "turn_finished":
        if (ev.reason === "injected") {
          // Its message went into the running turn's next round: the answer is there.
          this.node.classList.remove("joining", "queued-turn");
          this.node.classList.add("injected");
          this.end("finished", `joined turn ${String(ev.into).slice(0, 12)}`);
          break;
        }
        if (!this.text.textContent && ev.content) this.text.textContent = ev.content;
        this.end("finished", ev.reason && ev.reason !== "stop" ? `finished (${ev.reason})`
          : "finished");
        break;
      case "turn_aborted":
        this.end("aborted", `aborted (${ev.reason})`);
        break;
      case "turn_error":
        this.end("error", `error: ${ev.error}` + (ev.code ? ` [${ev.code}]` : ""));
        break;
      default:
        break;
    }
  }

  tick(scope = this) {
    scope.chips.forEach((chip) => chip.tick());
    scope.children.forEach((sub) => this.tick(sub));
    if (scope === this) this.asks.forEach((ask) => ask.tick());
  }

  end(state, text) {
    this.done = true;
    if (this.es) this.es.close();
    this.tick();
    clearInterval(this.timer);
    this.outcome.textContent = text;
    this.outcome.dataset.state = state;
    this.asks.forEach((ask) => {
      if (ask.node.classList.contains("pending")) ask.close("closed", "turn over");
    });
    active.delete(this);
    if (active.size === 0) {
      setStatus(state, text);
      setConn("idle");
      $("#cancel").disabled = true;
    }
    $("#send").disabled = false;
  }

  async cancel() {
    $("#cancel").disabled = true;
    setStatus("cancelling", "cancelling…");
    const res = await fetch(`/v1/turns/${this.turnId}/abort`, {
      method: "POST", headers: authHeaders(this.token),
    });
    if (!res.ok && !this.done) setStatus("error", "cancel failed: " + await errorText(res));
  }
}

async function send(prompt) {
  $("#send").disabled = true;
  setStatus("starting", "starting…");
  const body = { prompt, conversation_id: conversationId, detach: $("#detach").checked };
  // A message sent while a turn runs: queued after it, added to it, or instead of it.
  if (active.size) body.multitask = $("#multitask").value;
  if (conversationToken) body.conversation_token = conversationToken;
  const agent = $("#agent").value;
  if (agent) body.agent = agent;
  const res = await fetch("/v1/turns", {
    method: "POST", headers: keyHeaders(), body: JSON.stringify(body),
  });
  if (res.status === 401) {
    pendingPrompt = prompt;
    const had = apiKey() !== null;
    sessionStorage.removeItem(KEY_SLOT);
    askForKey(had ? "That key was not accepted; enter a key for this gateway."
      : "This gateway needs a key.");
    $("#send").disabled = false;
    return;
  }
  if (!res.ok) {
    setStatus("error", await errorText(res));
    $("#send").disabled = false;
    return;
  }
  const handle = await res.json();
  if (handle.conversation_token) conversationToken = handle.conversation_token;
  const own = handle.injected
    // Its own turn: it ends "injected" once the running turn took the message in.
    ? { ...handle, turn_id: handle.message_turn_id,
      events_url: `/v1/turns/${handle.message_turn_id}/events` }
    : handle;
  const view = new TurnView(own, prompt);
  if (handle.injected) {
    view.notes.append(el("div", "note joining-note", "joins the running turn at its next round"));
  }
  $("#cancel").disabled = false;
  $("#send").disabled = false;
  if (!handle.queued) setStatus("running", "starting…");
  view.connect();
}

// Asks for a key at once when the gateway needs one (and this tab holds none that works);
// with one, lists the agents the turn workers run, to pick one for the next turn.
async function probeKey() {
  const res = await fetch("/v1/agents", { headers: keyHeaders() });
  if (res.status === 401) {
    const had = apiKey() !== null;
    sessionStorage.removeItem(KEY_SLOT);
    askForKey(had ? "That key was not accepted; enter a key for this gateway."
      : "This gateway needs a key.");
    return;
  }
  if (res.ok) showAgents((await res.json()).agents || []);
}

function showAgents(agents) {
  const select = $("#agent");
  const chosen = select.value;
  select.replaceChildren(el("option", null, "(none)"));
  select.firstChild.value = "";
  for (const a of agents) {
    const opt = el("option", null, a.model ? `${a.name} (${a.model})` : a.name);
    opt.value = a.name;
    opt.title = (a.tools || []).join(", ");
    select.append(opt);
  }
  select.value = agents.some((a) => a.name === chosen) ? chosen : "";
  $("#agent-label").hidden = agents.length === 0;
}

document.addEventListener("DOMContentLoaded", () => {
  $("#keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    const input = $("#apikey");
    const key = input.value.trim();
    input.value = "";
    if (!key) return;
    sessionStorage.setItem(KEY_SLOT, key);
    $("#keyform").hidden = true;
    setStatus("idle", "Ready.");
    const retry = pendingPrompt;
    pendingPrompt = null;
    if (retry && active.size === 0) {
      send(retry).catch((err) => setStatus("error", String(err)));
    } else {
      probeKey().catch(() => {});
    }
  });
  probeKey().catch(() => {});
  const form = $("#composer");
  const prompt = $("#prompt");
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = prompt.value.trim();
    if (!text) return;
    prompt.value = "";
    send(text).catch((err) => {
      setStatus("error", String(err));
      $("#send").disabled = false;
    });
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) form.requestSubmit();
  });
  // Cancel stops every turn of the conversation this page started that has not ended.
  $("#cancel").addEventListener("click", () => { active.forEach((view) => view.cancel()); });
});
