// The console's bulk retry (docs/retry.md, "Many at once"): the turns that ended error or
// aborted in a window, of an agent, listed by a dry run, then retried once each; each
// outcome says what became of its turn. Uses keyHeaders(), el(), errorText() (app.js) and
// q(), openTurn() (console.js), loaded first.
"use strict";

const SINCE_UNITS = { s: 1, m: 60, h: 3600, d: 86400 };

// "1h" -> 3600; null for what is not a duration.
function sinceSeconds(text) {
  const m = /^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$/i.exec(text);
  return m ? Number(m[1]) * SINCE_UNITS[m[2].toLowerCase()] : null;
}

function turnLink(id) {
  const a = el("a", "mono", id.slice(0, 12));
  a.href = "#console";
  a.title = id;
  a.dataset.turnId = id;
  a.addEventListener("click", (e) => { e.preventDefault(); openTurn(id); });
  return a;
}

const OUTCOME_TEXT = {
  would_start: "would start a retry",
  started: "retried: ",
  retried_already: "retried already by ",
  refused: "refused: ",
};

function outcomeItem(o) {
  const li = el("li", o.outcome);
  li.dataset.source = o.source;
  li.dataset.outcome = o.outcome;
  li.append(turnLink(o.source), el("span", "", " " + OUTCOME_TEXT[o.outcome]));
  if (o.turn_id) li.append(turnLink(o.turn_id));
  if (o.error) li.append(el("span", "", o.error));
  return li;
}

async function bulkRetry(dryRun) {
  const state = q("#bulk-state");
  const since = sinceSeconds(q("#b-since").value);
  if (since === null) {
    state.textContent = "Since: a duration such as 30m, 1h or 2d.";
    return;
  }
  const body = { status: q("#b-status").value, since_s: since, dry_run: dryRun };
  const agent = q("#b-agent").value.trim();
  if (agent) body.agent = agent;
  state.textContent = dryRun ? "Looking…" : "Retrying…";
  q("#bulk-outcomes").replaceChildren();
  for (const b of document.querySelectorAll("#bulk-form button")) b.disabled = true;
  try {
    const res = await fetch("/v1/console/turns/retry",
      { method: "POST", headers: keyHeaders(), body: JSON.stringify(body) });
    if (!res.ok) {
      state.textContent = await errorText(res);
      return;
    }
    const turns = (await res.json()).turns;
    q("#bulk-outcomes").replaceChildren(...turns.map(outcomeItem));
    const started = turns.filter((t) => t.outcome === "started").length;
    if (!turns.length) state.textContent = "No turn matches.";
    else if (dryRun) state.textContent = turns.length + " turn(s) match: Retry starts what it lists.";
    else state.textContent = started + " of " + turns.length + " retried now.";
  } finally {
    for (const b of document.querySelectorAll("#bulk-form button")) b.disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  q("#bulk-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const dry = e.submitter ? e.submitter.value === "dry" : true;
    bulkRetry(dry).catch((err) => { q("#bulk-state").textContent = String(err.message || err); });
  });
});
