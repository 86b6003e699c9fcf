// epochstream dashboard: polls /ui/data (ui.model.dashboard) and draws it with uPlot.
"use strict";
const COLORS = ["#2b6cb0", "#dd6b20", "#2f855a", "#b83280", "#805ad5", "#c53030", "#319795", "#975a16"];
const charts = {};
const TRACKER_KINDS = ["report", "promise", "neoss", "tracker"];
let view = null, last = null;
const live = [];  // the live per-task samples this page has seen: {t, m: task_metrics}

const $ = (id) => document.getElementById(id);
const fmt = (v, d = 2) => v == null ? "-" : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(d)) : String(v));
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));

function chart(id, labels, xs, ys, opts = {}) {
  // (re)draw chart `id`: one series per label; a new set of labels builds a new plot
  const key = labels.join("|") + (opts.bars ? "|b" : "");
  const el = $(id), data = [xs, ...ys];
  if (charts[id] && charts[id].key === key) { charts[id].plot.setData(data); return; }
  if (charts[id]) charts[id].plot.destroy();
  const bars = opts.bars ? uPlot.paths.bars({size: [0.7, 40]}) : undefined;
  const series = [{label: opts.x || "epoch"}, ...labels.map((l, i) => ({
    label: l, stroke: COLORS[i % COLORS.length], width: bars ? 0 : 1.5,
    fill: bars ? COLORS[i % COLORS.length] : undefined, paths: bars, points: {show: !bars},
    value: opts.value ? ((u, v, si, idx) => opts.value(si - 1, idx)) : undefined,
  }))];
  const plot = new uPlot({width: Math.max(el.clientWidth || 560, 360), height: 220, series,
    scales: {x: {time: false}}, axes: [{label: opts.x || "epoch", incrs: opts.x ? undefined : [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]}, {size: 60}], legend: {live: true}}, data, el);
  charts[id] = {key, plot};
}

function graph(g) {
  if (!g) { $("graph").textContent = "(no graph recorded)"; return; }
  const depth = {}, byId = {};
  g.chains.forEach((c) => { byId[c.id] = c; depth[c.id] = 0; });
  for (let i = 0; i < g.chains.length; i++)
    g.edges.forEach((e) => { if (!e.phantom) depth[e.dst] = Math.max(depth[e.dst], depth[e.src] + 1); });
  const seg = {};
  (g.segments || []).forEach((s, i) => s.forEach((c) => { seg[c] = i; }));
  const stages = [];
  g.chains.forEach((c) => { (stages[depth[c.id]] = stages[depth[c.id]] || []).push(c); });
  const html = stages.map((cs) => `<div class="stage">${cs.map((c) =>
    `<div class="chain ${c.source ? "source" : ""} ${c.loop_head ? "loop" : ""}" data-chain="${c.id}">` +
    `<div><b>chain ${c.id}</b> x${g.parallelism} <span class="seg">segment ${seg[c.id] ?? "-"}</span></div>` +
    c.operators.map((o) => `<div class="op">${esc(o.name)} <i>${esc(o.kind)}${o.uid ? " · " + esc(o.uid) : ""}</i></div>`).join("") +
    `</div>`).join("")}</div>`).join("");
  const edges = g.edges.map((e) => `chain ${e.src} → chain ${e.dst} (${e.phantom ? "loop back edge" : e.partition})`).join("<br>");
  const loops = (g.loops || []).map((l) => `loop ${esc(l.uid)}: ${l.members.map(esc).join(", ")}`).join("<br>");
  $("graph").innerHTML = html + `<div class="edges">${edges}${loops ? "<br>" + loops : ""}<br>max parallelism ${g.max_parallelism}</div>`;
}

function table(id, head, rows) {
  $(id).innerHTML = "<tr>" + head.map(([h, cls]) => `<th class="${cls || ""}">${h}</th>`).join("") + "</tr>" +
    rows.map((r) => "<tr>" + r.map(([v, cls]) => `<td class="${cls || ""}">${esc(v)}</td>`).join("") + "</tr>").join("");
}

function render(d) {
  last = d;
  const job = d.job, tracker = (view || job.mode) === "tracker";
  if (view === null) setView(job.mode === "tracker" ? "tracker" : "aligned", false);
  $("job-name").textContent = job.name || "job"; $("job-id").textContent = job.id || "";
  $("state").textContent = job.state || "?"; $("state").className = "badge " + (job.state || "");
  document.querySelectorAll("[data-k]").forEach((el) => { el.textContent = fmt(job[el.dataset.k]); });
  if (!charts.graphDone) { graph(d.graph); charts.graphDone = true; }

  const done = d.epochs.filter((e) => e.state === "completed");
  const xs = done.map((e) => e.epoch);
  // timeline: phases stacked (cumulative series drawn tallest first, so each bar shows every phase)
  const phases = [["alignment_seconds_max", tracker ? "hold (max task)" : "alignment (max task)"],
    ["write_seconds_max", "snapshot write (max task)"], ["prepare_seconds", "rest until all acks"],
    ["manifest_seconds", "manifest"], ["commit_seconds", "sink commit"]];
  const own = phases.map(([k], i) => done.map((e) => {
    const v = e[k] || 0;
    return i === 2 ? Math.max(0, v - (e.alignment_seconds_max || 0) - (e.write_seconds_max || 0)) : v;
  }));
  const cum = own.map((_, i) => done.map((_, j) => own.slice(0, i + 1).reduce((a, s) => a + s[j], 0)));
  chart("c-timeline", phases.map((p) => p[1]).reverse(), xs, cum.slice().reverse(),
    {bars: true, value: (si, idx) => idx == null ? "-" : fmt(own[phases.length - 1 - si][idx], 4)});

  const tasks = [...new Set(done.flatMap((e) => Object.keys(e.tasks)))].sort();
  $("t-per-task").textContent = tracker ? "trAcker hold time per task (ms)" : "Alignment time per task (ms)";
  chart("c-per-task", tasks, xs, tasks.map((t) => done.map((e) => 1000 * ((e.tasks[t] || {}).alignment_seconds || 0))));
  chart("c-held", tasks, xs, tasks.map((t) => done.map((e) => (e.tasks[t] || {}).held_records || 0)));
  const rt = Object.keys(d.task_rates).sort();
  chart("c-rates", rt, xs, rt.map((t) => d.task_rates[t]));
  const kinds = [...new Set(done.flatMap((e) => Object.keys(e.service_messages || {})))]
    .filter((k) => tracker ? k !== "markers" : k !== "tracker").sort();
  chart("c-traffic", kinds, xs, kinds.map((k) => done.map((e) => (e.service_messages || {})[k] || 0)));
  const unaligned = done.some((e) => e.channel_state_bytes);
  chart("c-bytes", unaligned ? ["state", "channel state"] : ["bytes"], xs,
    unaligned ? [done.map((e) => e.bytes), done.map((e) => e.channel_state_bytes || 0)] : [done.map((e) => e.bytes)],
    {bars: !unaligned});  // two series as lines: bars would hide each other

  taskTable(d);
  const tk = Object.entries(d.traffic).filter(([k]) => tracker || !TRACKER_KINDS.includes(k));
  table("traffic", [["kind", "l"], ["messages"], ["bytes"]], tk.map(([k, t]) => [[k, "l"], [t.messages], [t.bytes]]));
  table("restarts", [["at (s)"], ["reason", "l"], ["recovery (s)"]],
    d.restarts.map((r) => [[fmt(r.time)], [r.reason, "err"], [fmt(r.recovery_seconds)]]));
  table("checkpoints", [["epoch"], ["status", "l"], ["kind", "l"], ["type", "l"], ["bytes"], ["files"], ["duration (s)"], ["failure cause", "l"]],
    d.checkpoints.slice().reverse().map((c) => [[c.epoch], [c.status, "l"], [c.kind, "l"],
      [c.status === "completed" ? (c.incremental ? "incremental" : "full") : "-", "l"], [c.bytes], [c.files],
      [fmt(c.duration_seconds, 3)], [c.error || "", "err"]]));
  table("epochs", [["epoch"], ["state", "l"], ["kind", "l"], ["records"], ["duration (s)"], [tracker ? "hold max (s)" : "alignment max (s)"], ["bytes"], ["channel state (records)"], ["reason", "l"]],
    d.epochs.slice(-30).reverse().map((e) => [[e.epoch], [e.state, "l"], [e.kind || "", "l"], [fmt(e.records)],
      [fmt(e.duration_seconds, 3)], [fmt(e.alignment_seconds_max, 4)], [fmt(e.bytes)],
      [fmt(e.channel_state_records || 0)], [e.reason || "", "err"]]));
  $("updated").textContent = (d.live ? "live, updated " : "finished job, read from its manifests at ") + new Date().toLocaleTimeString();
  document.body.dataset.epochs = String(done.length);
}

function taskTable(d) {
  // throughput and backpressure per task (ui.model.task_metrics), a row per task, and its live charts
  const names = {};
  ((d.graph || {}).chains || []).forEach((c) => { names[c.id] = c.operators.map((o) => o.name).join(" → "); });
  const tm = d.task_metrics || {}, ids = Object.keys(tm).sort();
  table("tasks", [["task", "l"], ["operators", "l"], ["records in"], ["records out"], ["in/s"], ["out/s"],
    ["busy ms/s"], ["backpressured ms/s"], ["idle ms/s"], ["backpressure", "l"]],
    ids.map((t) => { const m = tm[t]; return [[t, "l"], [names[t.split(".")[0]] || "", "l"], [m.records_in], [m.records_out],
      [fmt(m.records_in_per_second, 0)], [fmt(m.records_out_per_second, 0)], [fmt(m.busy_ms_per_second, 0)],
      [fmt(m.backpressured_ms_per_second, 0)], [fmt(m.idle_ms_per_second, 0)], [m.backpressure || "-", "l bp-" + m.backpressure]]; }));
  if (!ids.length) $("tasks").insertAdjacentHTML("beforeend", `<tr><td class="l" colspan="10">${d.live ?
    "(waiting for the workers' first heartbeat)" : "(per-task counters come from a live job's workers)"}</td></tr>`);
  if (d.live && ids.length) { live.push({t: Date.now() / 1000, m: tm}); if (live.length > 300) live.shift(); }
  const t0 = live.length ? live[0].t : 0, xs = live.map((s) => s.t - t0);
  chart("c-task-out", ids, xs, ids.map((t) => live.map((s) => (s.m[t] || {}).records_out_per_second ?? null)), {x: "seconds"});
  chart("c-task-bp", ids, xs, ids.map((t) => live.map((s) => (s.m[t] || {}).backpressured_ms_per_second ?? null)), {x: "seconds"});
}

function setView(v, redraw = true) {
  view = v;
  document.querySelectorAll("nav button").forEach((b) => b.classList.toggle("on", b.dataset.view === v));
  document.body.dataset.view = v;
  if (redraw && last) render(last);
}

async function poll() {
  try {
    const r = await fetch("/ui/data", {cache: "no-store"});
    if (r.ok) {
      render(await r.json());
      document.body.dataset.fetches = String(Number(document.body.dataset.fetches || 0) + 1);
    }
  } catch (e) { $("updated").textContent = "job unreachable: " + e; }
  if (!last || last.live) setTimeout(poll, 1000);
}

document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => setView(b.dataset.view)));
poll();
