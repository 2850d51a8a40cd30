// cronlease dashboard: reads /api/status, /api/nodes and /api/history of
// the daemon that served it, every 2 s. No other host is ever asked.
"use strict";

const REFRESH_MS = 2000;
const TIMELINE_RUNS = 400;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}

function time(t) {
  if (!t) return "-";
  return t.replace("T", " ").replace(/\.\d+/, "").replace("Z", " UTC");
}

function outcomeClass(o) {
  return ["ok", "skipped", "failed", "timeout", "not_started", "killed", "lease_lost", "cancelled", "replaced", "dispatched"].includes(o) ? "o-" + o : "o-other";
}

// An audit entry in words: "pause by alice@web-1 at 12:00:03: disk full".
function saidAction(a) {
  return `${a.action} by ${a.by} at ${time(a.at)}` + (a.reason ? `: ${a.reason}` : " (no reason given)");
}

// The Paused cell: PAUSED (by whom, and why, from the audit) and a pending
// manual run's request, with its age.
function flags(r) {
  const out = [];
  if (r.paused) {
    const by = r.paused_by;
    out.push(el("span", { class: "paused", title: by ? saidAction(by) : "paused (who paused it is not among the audit's newest entries)" },
      by ? `PAUSED by ${by.by}` : "PAUSED"));
  }
  const p = r.pending_trigger;
  if (p) {
    if (out.length) out.push(" ");
    const age = p.age_ms == null ? "" : ` (${Math.round(p.age_ms / 1000)} s)`;
    const what = p.redelivered ? `redelivery of attempt ${p.attempt} pending` : p.resumed ? "catch-up after resume pending" : p.attempt ? `attempt ${p.attempt} due ${time(p.due_at)}` : "trigger pending" + age;
    out.push(el("span", { class: "paused", title: `trigger ${p.id}: cronlease trigger --cancel ${r.job} withdraws it` }, what));
  }
  const runOn = r.run_on || [];
  if (runOn.length && r.eligible_nodes) {
    if (out.length) out.push(" ");
    const able = r.eligible_nodes;
    out.push(able.length
      ? el("span", { class: "run-on", title: "run_on: only nodes with every one of these tags run it" }, `run on ${runOn.join(", ")}: ${able.join(", ")}`)
      : el("span", { class: "bad run-on", title: "no live node has every one of these tags: the job is not run until one does" }, `run on ${runOn.join(", ")}: no live node`));
  }
  const on = r.defined_otherwise_on || [];
  if (on.length) {
    if (out.length) out.push(" ");
    out.push(el("span", { class: "bad defined-otherwise", title: "each node runs its own definition at the instants of its own schedule until one definition is deployed to every node" },
      "defined otherwise on " + on.join(", ")));
  }
  return out.length ? out : ["-"];
}

// The Running cell: each run going now (node, for how long, what kind),
// from the live nodes' last beats.
function running(r) {
  const runs = r.running || [];
  if (!runs.length) return ["-"];
  return runs.map((g, i) => el("span", {
    class: "running",
    title: `fence ${g.fence}, occurrence ${time(g.occurrence)}, started ${time(g.started_at)}` + (g.trigger ? `, trigger ${g.trigger}` : ""),
  }, (i ? " " : "") + `on ${g.node} for ${Math.round(g.elapsed_ms / 1000)} s` + (g.kind === "scheduled" ? "" : ` (${g.kind.replace("_", "-")}${g.attempt > 1 ? " " + g.attempt : ""})`)));
}

// The token for this tab (sessionStorage: gone with the tab), sent as a
// header on every request, never a cookie: another site cannot make this
// browser act with it.
const TOKEN_KEY = "cronlease-token";
function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}
function headers() {
  const t = token();
  return t ? { Authorization: "Bearer " + t } : {};
}

// The job's action buttons: run now, pause or resume, cancel (a run going
// or a request pending).
function actions(r) {
  const button = (action, label, title) =>
    el("button", { type: "button", "data-action": action, "data-job": r.job, title }, label);
  const out = [button("trigger", "Run now", "run it once now on one node")];
  out.push(r.paused ? button("resume", "Resume", "resume it cluster-wide") : button("pause", "Pause", "pause it cluster-wide"));
  if ((r.running || []).length || r.pending_trigger) out.push(button("cancel", "Cancel", "stop its running run (or withdraw its pending request)"));
  return out;
}

// An action's answer, said in the notice line.
function notice(text, bad) {
  const n = document.getElementById("notice");
  n.textContent = text;
  n.className = "notice" + (bad ? " bad" : "");
  n.hidden = false;
}

async function act(action, job) {
  const reason = document.getElementById("reason").value.trim();
  const body = JSON.stringify(reason ? { reason } : {});
  try {
    const res = await fetch(`/api/jobs/${encodeURIComponent(job)}/${action}`, {
      method: "POST", cache: "no-store", body,
      headers: { ...headers(), "Content-Type": "application/json" },
    });
    const type = res.headers.get("content-type") || "";
    const answer = type.includes("application/json") ? await res.json() : { error: (await res.text()).trim() };
    if (!res.ok) {
      notice(`${action} ${job}: refused (${res.status}): ${answer.error || res.statusText}`, true);
      return;
    }
    const said = action === "trigger" ? `requested (trigger ${answer.trigger})`
      : action === "cancel" ? (answer.asked ? `asked ${answer.asked.map((a) => a.node + " (fence " + a.fence + ")").join(", ")} to stop its run` : answer.message)
      : action === "pause" ? "paused" : ["resumed", ...(answer.catch_up || [])].join("; ");
    notice(`${action} ${job}: ${said}`, false);
  } catch (e) {
    notice(`${action} ${job}: ${e.message}`, true);
  }
}

// Who this tab acts as (`/api/whoami` with its token).
async function whoami() {
  const who = document.getElementById("who");
  try {
    const me = await fetchJson("/api/whoami");
    who.textContent = me.token ? `token ${me.token} (${me.scope})`
      : me.writes.startsWith("no") ? "read-only: this listener has no [http] tokens_file"
      : "no token: actions need one of scope operate";
    who.title = me.writes;
  } catch (e) {
    who.textContent = e.message;
  }
  document.getElementById("forget-token").hidden = !token();
}

function renderJobs(rows) {
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren(...rows.map((r) => {
    const alive = r.holder_alive === null || r.holder_alive === undefined ? el("span", { class: "muted" }, "-")
      : r.holder_alive ? el("span", { class: "ok" }, "yes" + (r.holder_clock_offset_ms != null ? ` (${r.holder_clock_offset_ms >= 0 ? "+" : ""}${r.holder_clock_offset_ms} ms)` : ""))
      : el("span", { class: "bad" }, "no heartbeat");
    const last = r.last_run ? el("span", { class: ["ok", "dispatched", "replaced"].includes(r.last_run.outcome) ? "ok" : "bad" },
      `${r.last_run.outcome}${r.last_run.exit_code != null ? " (" + r.last_run.exit_code + ")" : ""} on ${r.last_run.node}`) : "-";
    return el("tr", { "data-job": r.job },
      el("td", {}, el("a", { href: "#job=" + encodeURIComponent(r.job), class: "job-link" }, r.job), r.shard_of ? ` (shard of ${r.shard_of})` : r.configured ? "" : " (not configured here)"),
      el("td", { class: "holder" }, r.holder_node || "-"),
      el("td", {}, alive),
      el("td", { class: "fence" }, r.fence),
      el("td", {}, r.holder ? (r.lease_remaining_ms / 1000).toFixed(1) + " s" : "-"),
      el("td", { class: "running" }, ...running(r)),
      el("td", {}, ...flags(r)),
      el("td", {}, last),
      el("td", {}, time(r.last_occurrence)),
      el("td", {}, time(r.next_fire)),
      el("td", { class: "actions" }, ...actions(r)));
  }));
}

// The nodes this page has seen live, by name: a node gone from the
// registry stays listed, greyed, with when it was last seen, for
// GONE_SHOWN_MS (a restarted node's new owner replaces it at once).
const GONE_SHOWN_MS = 10 * 60 * 1000;
const seenNodes = new Map();

function renderNodes(nodes) {
  const now = Date.now();
  const live = new Set(nodes.map((n) => n.node));
  for (const n of nodes) seenNodes.set(n.node, { record: n, at: now });
  for (const [name, seen] of seenNodes) {
    if (!live.has(name) && now - seen.at > GONE_SHOWN_MS) seenNodes.delete(name);
  }
  const gone = [...seenNodes.entries()].filter(([name]) => !live.has(name)).map(([, seen]) => seen);
  const row = (n, goneAt) => el("tr", { "data-node": n.node, class: goneAt ? "gone" : "" },
    el("td", {}, n.node + (goneAt ? " (gone)" : "")), el("td", {}, n.owner),
    el("td", { class: "tags" }, (n.tags || []).join(", ") || "-"), el("td", {}, n.version),
    el("td", {}, time(n.started_at)),
    el("td", { class: "last-seen" }, goneAt ? `${time(n.last_seen)}; no heartbeat since ${time(new Date(goneAt).toISOString())}` : time(n.last_seen)),
    el("td", {}, n.clock_offset_ms == null ? "-" : `${n.clock_offset_ms >= 0 ? "+" : ""}${n.clock_offset_ms} ms`),
    el("td", {}, goneAt ? "-" : n.jobs_held),
    el("td", { class: "definitions" }, n.definitions ? n.definitions.digest + (n.definitions.differ_count ? ` (${n.definitions.differ_count} differ)` : "") : "-"));
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren(...nodes.map((n) => row(n, null)), ...gone.map((g) => row(g.record, g.at)));
}

// A colour per node name (stable across refreshes), for the runs' marks in
// the job lanes.
const NODE_COLOURS = ["#3b5bdb", "#e8590c", "#2b8a3e", "#ae3ec9", "#1098ad", "#d6336c", "#5c940d", "#862e9c"];
function nodeColour(node) {
  let h = 0;
  for (const c of node) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return NODE_COLOURS[h % NODE_COLOURS.length];
}

function renderTimeline(runs) {
  const box = document.getElementById("timeline");
  if (runs.length === 0) {
    box.replaceChildren(el("p", { class: "muted" }, "no runs recorded yet"));
    document.getElementById("timeline-range").textContent = "";
    return;
  }
  const starts = runs.map((r) => Date.parse(r.started_at));
  const ends = runs.map((r) => Date.parse(r.finished_at));
  const from = Math.min(...starts);
  const to = Math.max(Date.now(), ...ends);
  const span = Math.max(to - from, 1000);
  // One lane per job, so a failing job shows beside a long one; each run
  // marked with its node's colour.
  const byJob = new Map();
  for (const r of runs) {
    if (!byJob.has(r.job)) byJob.set(r.job, []);
    byJob.get(r.job).push(r);
  }
  const lanes = [...byJob.keys()].sort().map((job) => {
    const track = el("div", { class: "track" });
    for (const r of byJob.get(job)) {
      const s = Date.parse(r.started_at), e = Date.parse(r.finished_at);
      const bar = el("div", {
        class: "run " + outcomeClass(r.outcome) + (r.trigger && !(r.attempt > 1) ? " manual" : ""),
        title: `${r.job} fence ${r.fence} on ${r.node}: ${r.outcome} (${r.attempt > 1 ? "attempt " + r.attempt + " of occurrence " + time(r.occurrence) : r.trigger ? "manual run, trigger " + r.trigger : "occurrence " + time(r.occurrence)}, ${Math.max(e - s, 0)} ms)${r.takeover ? ", takeover" : ""}${r.cpu_ms != null ? ", CPU " + r.cpu_ms + " ms" : ""}${r.memory_peak != null ? ", peak memory " + (r.memory_peak / 1048576).toFixed(1) + " MiB" : ""}`,
        "data-job": r.job, "data-fence": r.fence, "data-node": r.node,
      });
      bar.style.borderTop = "3px solid " + nodeColour(r.node);
      bar.style.left = ((s - from) / span * 100).toFixed(3) + "%";
      bar.style.width = (Math.max(e - s, 0) / span * 100).toFixed(3) + "%";
      track.append(bar);
    }
    return el("div", { class: "lane", "data-job": job }, el("div", { class: "name" }, job), track);
  });
  const nodes = [...new Set(runs.map((r) => r.node))].sort();
  // Colours set through the style object: the page's CSP allows no style
  // attribute.
  const mark = (n) => {
    const i = el("i", { class: "swatch" });
    i.style.background = nodeColour(n);
    return el("span", { class: "node-mark", "data-node": n }, i, n);
  };
  const nodeLegend = el("div", { class: "legend muted" }, "nodes: ", ...nodes.map(mark));
  const legend = el("div", { class: "legend muted" }, ...[["o-ok", "ok"], ["o-failed", "failed / timeout"], ["o-killed", "killed / lease lost"], ["o-skipped", "skipped / replaced"], ["o-dispatched", "dispatched (every node)"], ["o-cancelled", "cancelled"], ["manual", "manual run (trigger)"]]
    .map(([c, t]) => el("span", {}, el("i", { class: "swatch " + c }), t)));
  box.replaceChildren(...lanes, legend, nodeLegend);
  document.getElementById("timeline-range").textContent =
    `last ${runs.length} runs, ${time(new Date(from).toISOString())} to ${time(new Date(to).toISOString())}`;
}

const TIMEOUT_MS = 10000;

// One endpoint's JSON; an error names the endpoint and what went wrong.
async function fetchJson(path) {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
  try {
    const res = await fetch(path, { cache: "no-store", signal: abort.signal, headers: headers() });
    const type = res.headers.get("content-type") || "";
        const body = type.includes("application/json") ? await res.json() : { error: (await res.text()).trim() };
    if (res.status === 401 && token()) {
      // Revoked (or the tokens file reloaded without it): dropped, so the
      // refreshes do not go on failing with it.
      sessionStorage.removeItem(TOKEN_KEY);
      notice("the token was refused (401) and is forgotten: enter a valid one", true);
      whoami();
    }
    if (!res.ok) throw new Error(body.error || res.statusText);
    return body;
  } catch (e) {
    throw new Error(path + ": " + (e.name === "AbortError" ? "no answer within " + TIMEOUT_MS / 1000 + " s" : e.message));
  } finally {
    clearTimeout(timer);
  }
}

// The job page (`#job=NAME`): `/api/jobs/NAME`, its runs' durations as a
// chart, and a run's output tail (sent to operate tokens only).
function pageJob() {
  const m = location.hash.match(/^#job=(.+)$/);
  return m ? decodeURIComponent(m[1]) : null;
}
let shownOutput = null;
function renderJobPage(page) {
  const s = page.status;
  document.getElementById("job-title").textContent = page.job;
  const going = (s.running || []).map((g) => `running on ${g.node} for ${Math.round(g.elapsed_ms / 1000)} s`);
  document.getElementById("job-summary").textContent = [
    s.holder_node ? "held by " + s.holder_node : "not held",
    s.paused ? (s.paused_by ? "PAUSED: " + saidAction(s.paused_by) : "PAUSED") : null, ...going,
    s.pending_trigger ? "request pending: trigger " + s.pending_trigger.id : null,
    "fence " + s.fence, "next fire " + time(s.next_fire),
    "definition " + (page.definition_digest || "not configured here"),
  ].filter(Boolean).join(" · ");
  const runs = page.runs || [];
  const longest = Math.max(1, ...runs.map((r) => r.duration_ms));
  document.getElementById("job-chart").replaceChildren(...runs.slice().reverse().map((r) => {
    const bar = el("div", { class: "bar " + outcomeClass(r.outcome), title: `fence ${r.fence} on ${r.node}: ${r.outcome}, ${r.duration_ms} ms` });
    bar.style.height = Math.max(2, r.duration_ms / longest * 100).toFixed(1) + "%";
    return bar;
  }));
  document.querySelector("#job-runs tbody").replaceChildren(...runs.map((r) => el("tr", { "data-fence": r.fence },
    el("td", {}, r.fence), el("td", {}, r.node),
    el("td", { class: r.outcome === "ok" ? "ok" : "bad" }, r.outcome + (r.exit_code != null ? ` (${r.exit_code})` : "")),
    el("td", {}, time(r.started_at)), el("td", {}, r.duration_ms + " ms"),
    el("td", {}, r.cpu_ms == null ? "-" : r.cpu_ms + " ms"),
    el("td", {}, r.memory_peak == null ? "-" : (r.memory_peak / 1048576).toFixed(1) + " MiB"),
    el("td", {}, r.attempt > 1 ? "attempt " + r.attempt : r.trigger ? "manual" : "scheduled"),
    el("td", {}, el("button", { type: "button", "data-output": r.fence }, "show")))));
  const acted = page.actions || [];
  document.querySelector("#job-actions tbody").replaceChildren(...(acted.length ? acted.map((a) => el("tr", {},
    el("td", {}, time(a.at)), el("td", {}, a.action), el("td", {}, a.by),
    el("td", {}, a.reason || "-"), el("td", {}, a.detail || "-")))
    : [el("tr", {}, el("td", { colspan: 5, class: "muted" }, "nobody has paused, resumed, triggered or cancelled it yet"))]));
  const chosen = runs.find((r) => r.fence === shownOutput) || runs[0];
  document.getElementById("job-output-of").textContent = chosen ? `(fence ${chosen.fence})` : "";
  document.getElementById("job-output").textContent = !chosen ? "no runs yet"
    : chosen.output ? chosen.output : "(empty, or shown to a token of scope operate only)";
}

// Each part is drawn from its own answer: one failing endpoint leaves the
// others current and is named in the header.
async function refresh() {
  const job = pageJob();
  document.getElementById("overview").hidden = job !== null;
  document.getElementById("job-page").hidden = job === null;
  const parts = job !== null ? [["/api/jobs/" + encodeURIComponent(job), renderJobPage]] : [
    ["/api/status", renderJobs],
    ["/api/nodes", renderNodes],
    ["/api/history?limit=" + TIMELINE_RUNS, renderTimeline],
  ];
  const results = await Promise.allSettled(parts.map(([path]) => fetchJson(path)));
  const errors = [];
  results.forEach((r, i) => {
    if (r.status === "fulfilled") parts[i][1](r.value);
    else errors.push(r.reason.message);
  });
  const error = document.getElementById("error");
  error.textContent = errors.join("; ");
  error.hidden = errors.length === 0;
  if (errors.length === 0) {
    document.getElementById("updated").textContent = "updated " + time(new Date().toISOString());
    document.body.dataset.loaded = "yes";
  }
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refresh, REFRESH_MS);
}
let refreshTimer = null;

// A token is kept only once the listener knows it: a mistyped one would
// be refused at every refresh, and count against this address's limit of
// failed attempts.
document.getElementById("access").addEventListener("submit", async (e) => {
  e.preventDefault();
  const input = document.getElementById("token");
  const typed = input.value.trim();
  input.value = "";
  if (!typed) return;
  const res = await fetch("/api/whoami", { cache: "no-store", headers: { Authorization: "Bearer " + typed } });
  if (res.ok) {
    sessionStorage.setItem(TOKEN_KEY, typed);
    notice("token accepted", false);
  } else {
    notice(`token refused (${res.status}): ` + ((await res.text()).trim() || res.statusText), true);
  }
  whoami();
});
document.getElementById("forget-token").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  whoami();
});
document.querySelector("#jobs tbody").addEventListener("click", (e) => {
  const b = e.target.closest("button[data-action]");
  if (b) act(b.dataset.action, b.dataset.job);
});

document.querySelector("#job-runs tbody").addEventListener("click", (e) => {
  const b = e.target.closest("button[data-output]");
  if (b) {
    shownOutput = Number(b.dataset.output);
    refresh();
  }
});
window.addEventListener("hashchange", () => {
  shownOutput = null;
  refresh();
});

whoami();
refresh();
