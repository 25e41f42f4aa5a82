// The cluster page: reads /api/cluster every few seconds, fills the tables, plots with uPlot.
// No build step: plain browser JavaScript; uPlot is vendored next to it (vendor/).
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const MAX_VERSION_LINES = 16;  // more fragments: one line of their summed versions

// What a test (or a curious person) can read back: window.clusterPage.
const state = { updates: 0, lossPoints: 0, versionPoints: 0, islands: [], error: null };
window.clusterPage = state;

const charts = {};  // element id -> {plot, key}

function text(value) {
  return value === null || value === undefined ? "-" : String(value);
}

function fixed(value, digits) {
  return typeof value === "number" ? value.toFixed(digits) : "-";
}

function ago(seconds) {
  return typeof seconds === "number" ? `${seconds.toFixed(1)} s ago` : "-";
}

function bytes(n, suffix) {
  if (typeof n !== "number") return "-";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}${suffix || ""}`;
}

function cell(row, value, cls) {
  const td = document.createElement("td");
  td.textContent = value;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fill(tableId, rows, build) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...rows.map(build));
}

function islandRow(island) {
  const tr = document.createElement("tr");
  tr.dataset.island = island.island;
  if (typeof island.inner_loss === "number") tr.dataset.loss = String(island.inner_loss);
  cell(tr, island.island);
  cell(tr, island.live ? "live" : "dead", island.live ? "ok" : "dead");
  cell(tr, ago(island.heard_s_ago));
  cell(tr, ago(island.last_push_s_ago));
  cell(tr, text(island.rounds));
  cell(tr, text(island.staleness));
  cell(tr, typeof island.inner_loss === "number" ? island.inner_loss.toPrecision(4) : "-");
  cell(tr, fixed(island.steps_per_s, 2));
  cell(tr, typeof island.goodput === "number" ? `${(100 * island.goodput).toFixed(1)}%` : "-");
  cell(tr, typeof island.credited_tokens === "number" ? Math.round(island.credited_tokens) : "-");
  return tr;
}

function shardRow(shard) {
  const tr = document.createElement("tr");
  tr.dataset.shard = text(shard.shard);
  cell(tr, text(shard.shard));
  cell(tr, text(shard.endpoint));
  if (!shard.up) {
    cell(tr, "down", "down");
    const why = cell(tr, text(shard.error));
    why.colSpan = 9;
    why.style.textAlign = "left";
    return tr;
  }
  cell(tr, "up", "ok");
  const versions = Object.entries(shard.versions || {}).map(([f, v]) => `${f}:${v}`);
  cell(tr, versions.join(" ") || (shard.initialized ? "-" : "not initialized"));
  cell(tr, text(shard.pending_deltas));
  cell(tr, bytes(shard.pending_bytes));
  cell(tr, text(shard.accepted));
  cell(tr, text(shard.duplicates));
  const rejected = Object.entries(shard.rejected || {}).map(([r, n]) => `${r}: ${n}`);
  cell(tr, rejected.join(", ") || "0");
  cell(tr, bytes(shard.bytes_in_per_s, "/s"));
  cell(tr, bytes(shard.bytes_out_per_s, "/s"));
  cell(tr, (shard.islands_live || []).join(" ") || "-");
  return tr;
}

// One uPlot per element; made again when its series change (an island appears).
function plot(id, names, columns, yLabel) {
  const el = document.getElementById(id);
  const data = columns;
  const key = names.join("\u0000");
  const width = Math.max(300, el.clientWidth || 600);
  let chart = charts[id];
  if (chart && chart.key !== key) {
    chart.plot.destroy();
    chart = null;
  }
  if (!chart) {
    const series = [{}, ...names.map((name, i) => ({
      label: name,
      stroke: COLORS[i % COLORS.length],
      width: 2,
      spanGaps: true,
      points: { show: true, size: 5 },
    }))];
    const opts = {
      width, height: 240,
      scales: { x: { time: true } },
      series,
      axes: [{}, { label: yLabel }],
    };
    chart = charts[id] = { plot: new uPlot(opts, data, el), key };
  } else {
    if (chart.plot.width !== width) chart.plot.setSize({ width, height: 240 });
    chart.plot.setData(data);
  }
}

function countPoints(columns) {
  return columns.reduce((n, col) => n + col.filter((v) => v !== null && v !== undefined).length, 0);
}

function draw(view) {
  const history = view.history;
  const t = history.t;
  const islands = Object.keys(history.loss);
  const losses = islands.map((i) => history.loss[i]);
  plot("loss-chart", islands, [t, ...losses], "train loss");
  let fragments = Object.keys(history.versions);
  let versions = fragments.map((f) => history.versions[f]);
  if (fragments.length > MAX_VERSION_LINES) {
    versions = [t.map((_, k) => versions.reduce((s, col) => s + (col[k] || 0), 0))];
    fragments = ["all fragments (sum)"];
  } else {
    fragments = fragments.map((f) => `fragment ${f}`);
  }
  plot("version-chart", fragments, [t, ...versions], "version");
  state.lossPoints = countPoints(losses);
  state.versionPoints = countPoints(versions);
}

function render(view) {
  const up = view.shards.filter((s) => s.up).length;
  const live = view.islands.filter((i) => i.live).length;
  const when = new Date(view.time * 1000).toLocaleTimeString();
  document.getElementById("summary").textContent =
    `${up} of ${view.shards.length} shard(s) up, ${live} island(s) live; status of ${when}`;
  fill("islands", view.islands, islandRow);
  fill("shards", view.shards, shardRow);
  draw(view);
  state.islands = view.islands.map((i) => ({ island: i.island, live: i.live, loss: i.inner_loss }));
  state.updates += 1;
  state.error = null;
}

async function refresh() {
  let wait = 3000;
  try {
    const response = await fetch("/api/cluster", { cache: "no-store" });
    if (!response.ok) throw new Error(`/api/cluster answered ${response.status}`);
    const view = await response.json();
    wait = Math.max(1000, 1000 * (view.interval_s || 3));
    render(view);
  } catch (err) {
    state.error = String(err);
    document.getElementById("summary").textContent = `cannot read the cluster's status: ${err}`;
  }
  setTimeout(refresh, wait);
}

refresh();
