"""`lanes timeline --html`: one self-contained page (no external assets) with the job's swimlanes.

The page is built from the same JSON as `lanes job --json` / `lanes demo --json` (a job object with its
attempts and `timeline` rows), embedded in the page; a small script draws the lanes as horizontal bands
on one time axis, each event as a mark (details on hover and on click), attempts and waits as spans, the
first error and the missing evidence called out, and filters by lane and node.
"""

from __future__ import annotations

import html
import json
from typing import Any

from lanes_console.rows import missing_by_lane  # the live console's job page says it the same way

LANE_ORDER = ("algorithm", "platform", "host", "network")


def first_error(job: dict[str, Any]) -> dict[str, Any] | None:
    """The first error of the job: a telemetry finding's when there is one, else the first failed rank exit."""
    findings = [
        row
        for row in job.get("timeline", [])
        if str(row.get("type")).endswith(".finding.v1") and isinstance((row.get("data") or {}).get("first_error"), dict)
    ]
    if findings:  # a later version of the finding supersedes an earlier one
        latest = max(findings, key=lambda row: (row["data"].get("version", 0), row["seq"]))
        data = latest["data"]
        cause = data["first_error"]
        return {
            "seq": latest["seq"],
            "id": latest.get("id"),
            **cause,
            "detail": cause.get("summary") or cause.get("category"),
            "owner": data.get("owner"),
            "missing_evidence": missing_by_lane(data.get("missing_evidence") or []),
        }
    for row in job.get("timeline", []):
        data = row.get("data") or {}
        if str(row.get("type", "")).endswith("rank_exited.v1") and (data.get("exit_code") or data.get("signal")):
            how = f"signal {data['signal']}" if data.get("signal") else f"exit code {data['exit_code']}"
            return {
                "seq": row["seq"],
                "id": row.get("id"),
                "rank": row.get("rank"),
                "node": row.get("node"),
                "lane": row.get("lane"),
                "category": "process_exit",
                "detail": f"rank {row.get('rank')} ended with {how}",
            }
    return None


def render_page(job: dict[str, Any]) -> str:
    """The whole page as a string."""
    payload = {"job": job, "lanes": LANE_ORDER, "firstError": first_error(job)}
    # Event text is data, never markup: with no `<` left in the JSON, nothing in it can end the script element
    # or open an HTML comment inside it (`<!--<script>` would make the page's own `</script>` text).
    data = json.dumps(payload, separators=(",", ":"))
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = html.escape(f"Lanes timeline: {job.get('job_id', '?')}")
    return _TEMPLATE.replace("{{TITLE}}", title).replace("{{DATA}}", data)


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{TITLE}}</title>
<style>
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#1d2330;background:#fafbfc}
h1{font-size:18px;margin:0 0 4px} .sub{color:#5b6475;margin-bottom:10px}
.controls{display:flex;gap:16px;align-items:center;margin:8px 0 12px;flex-wrap:wrap}
.callout{border-left:4px solid #d33;background:#fff1f0;padding:6px 10px;margin:6px 0}
.callout.missing{border-color:#c80;background:#fff8e6}
svg{background:#fff;border:1px solid #d8dde6;border-radius:4px}
.band{fill:#f3f5f9} .band.alt{fill:#e9edf3} .lane-label{font-weight:600;fill:#39414f}
.mark{stroke:#fff;stroke-width:1;cursor:pointer} .mark.first-error{stroke:#d33;stroke-width:3}
.span-attempt{fill:#4a7bd0;opacity:.18} .span-wait{fill:#c80;opacity:.25}
.axis{stroke:#aab2c0} .tick{font-size:10px;fill:#6b7385}
#detail{white-space:pre-wrap;font:12px/1.35 ui-monospace,monospace;background:#fff;border:1px solid #d8dde6;
padding:8px;margin-top:10px;min-height:40px}
</style></head><body>
<h1 id="title"></h1><div class="sub" id="summary"></div>
<div id="callouts"></div>
<div class="controls"><span id="lane-filters"></span>
<label>node <select id="node-filter"><option value="">all nodes</option></select></label></div>
<svg id="chart" xmlns="http://www.w3.org/2000/svg"></svg>
<div id="detail">Click a mark for its event.</div>
<script id="lanes-data" type="application/json">{{DATA}}</script>
<script>
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const data = JSON.parse(document.getElementById("lanes-data").textContent);
  const job = data.job, rows = job.timeline || [], lanes = data.lanes, first = data.firstError;
  const colors = {algorithm: "#8e44ad", platform: "#2d6cdf", host: "#d35400", network: "#16a085"};
  const hidden = new Set();
  let nodeFilter = "";
  document.getElementById("title").textContent = "Job " + job.job_id;
  const attempts = (job.attempts || []).map(a => "#" + a.number + " " + a.state).join(", ");
  document.getElementById("summary").textContent =
    "state " + (job.state || "unknown") + " \\u00b7 attempts " + (attempts || "-") +
    " \\u00b7 " + rows.length + " events";
  const callouts = document.getElementById("callouts");
  function callout(cls, text) {
    const div = document.createElement("div"); div.className = "callout " + cls; div.textContent = text;
    callouts.appendChild(div);
  }
  if (first) {
    callout("first-error", "First error: " + (first.detail || first.category || "") + " (rank " + first.rank +
      ", node " + first.node + ", " + first.lane + " lane, event #" + first.seq + ")");
    const missing = first.missing_evidence;
    if (missing && Object.keys(missing).length) {
      callout("missing", "Missing evidence: " + JSON.stringify(missing));
    } else {
      callout("missing", "Missing evidence: none reported");
    }
  } else {
    callout("missing", "No error on this timeline.");
  }
  const times = rows.map(r => Date.parse(r.time)).filter(t => !isNaN(t));
  const t0 = Math.min(...times), t1 = Math.max(...times, t0 + 1);
  const W = 1100, left = 110, right = 20, bandH = 56, top = 30;
  const H = top + bandH * lanes.length + 30;
  const x = t => left + (W - left - right) * (t - t0) / (t1 - t0);
  const svg = document.getElementById("chart");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    (parent || svg).appendChild(e); return e;
  }
  lanes.forEach((lane, i) => {
    el("rect", {x: 0, y: top + i * bandH, width: W, height: bandH, class: "band" + (i % 2 ? " alt" : ""),
      "data-lane": lane});
    const label = el("text", {x: 8, y: top + i * bandH + bandH / 2 + 4, class: "lane-label"});
    label.textContent = lane;
  });
  el("line", {x1: left, x2: W - right, y1: H - 24, y2: H - 24, class: "axis"});
  for (let k = 0; k <= 5; k++) {
    const t = t0 + (t1 - t0) * k / 5;
    const tick = el("text", {x: x(t) - 20, y: H - 8, class: "tick"});
    tick.textContent = "+" + ((t - t0) / 1000).toFixed(3) + "s";
  }
  (job.attempts || []).forEach(a => {
    const s = Date.parse(a.started_at), e = Date.parse(a.ended_at);
    if (isNaN(s)) return;
    const end = isNaN(e) ? t1 : e;
    const span = el("rect", {x: x(s), y: top - 14, width: Math.max(2, x(end) - x(s)), height: 10,
      class: "span-attempt", "data-attempt": a.number});
    el("title", {}, span).textContent = "attempt " + a.number + " " + a.state;
  });
  const platform = lanes.indexOf("platform");
  let waitStart = null;
  rows.forEach(r => {
    if (r.type.endsWith(".waiting.v1") && waitStart === null) waitStart = r;
    if (r.type.endsWith(".placed.v1") && waitStart) {
      const w = el("rect", {x: x(Date.parse(waitStart.time)), y: top + platform * bandH + 4,
        width: Math.max(2, x(Date.parse(r.time)) - x(Date.parse(waitStart.time))), height: bandH - 8,
        class: "span-wait"});
      el("title", {}, w).textContent = "waiting: " + (waitStart.data && waitStart.data.reason);
      waitStart = null;
    }
  });
  const nodes = new Set();
  const marks = rows.filter(r => r.lane).map((r, i) => {
    if (r.node) nodes.add(r.node);
    const lane = lanes.indexOf(r.lane);
    const jitter = ((i * 7) % 5 - 2) * 7;
    const m = el("circle", {cx: x(Date.parse(r.time)), cy: top + lane * bandH + bandH / 2 + jitter, r: 6,
      fill: colors[r.lane] || "#777", class: "mark" + (first && first.seq === r.seq ? " first-error" : ""),
      "data-lane": r.lane, "data-node": r.node || "", "data-seq": r.seq});
    el("title", {}, m).textContent = "#" + r.seq + " " + r.type + " node=" + (r.node || "-") + " rank=" +
      (r.rank === null || r.rank === undefined ? "-" : r.rank) + " source=" + r.source + " signer=" +
      (r.signer || "unsigned") + (r.signature && r.signature !== "verified" ? " (" + r.signature + ")" : "");
    m.addEventListener("click", () => {
      document.getElementById("detail").textContent = JSON.stringify(r, null, 2);
    });
    return m;
  });
  const laneFilters = document.getElementById("lane-filters");
  lanes.forEach(lane => {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox"; box.checked = true; box.dataset.lane = lane;
    box.addEventListener("change", () => { box.checked ? hidden.delete(lane) : hidden.add(lane); apply(); });
    label.appendChild(box); label.appendChild(document.createTextNode(" " + lane + " "));
    laneFilters.appendChild(label);
  });
  const select = document.getElementById("node-filter");
  [...nodes].sort().forEach(n => {
    const o = document.createElement("option"); o.value = n; o.textContent = n; select.appendChild(o);
  });
  select.addEventListener("change", () => { nodeFilter = select.value; apply(); });
  function apply() {
    marks.forEach(m => {
      const show = !hidden.has(m.dataset.lane) && (!nodeFilter || m.dataset.node === nodeFilter);
      m.style.display = show ? "" : "none";
    });
  }
  document.body.dataset.ready = "true";
})();
</script></body></html>
"""
