// A job's attempts side by side: placement, ranks (aligned on step), first error, cause, recovery decisions.
// The server sends the whole comparison (`attempts`) whenever it changes; it is drawn again from it.
// Everything an event says is put in the page with textContent or as an attribute value, never as markup.
(function () {
  "use strict";
  const NS = "http://www.w3.org/2000/svg";
  const body = document.body;
  const jobId = body.dataset.job;
  const params = new URLSearchParams(location.search);
  const chosen = new Set(params.getAll("attempt").map(Number));
  const BAR_W = 220, BAR_H = 12;

  function text(value) { return value === null || value === undefined || value === "" ? "-" : String(value); }
  function cell(tag, value, cls) {
    const c = document.createElement(tag); c.textContent = text(value); if (cls) c.className = cls; return c;
  }

  function choices(numbers, shown) {
    const box = document.getElementById("attempt-choices");
    box.replaceChildren();
    numbers.forEach(n => {
      const label = document.createElement("label");
      const input = document.createElement("input");
      input.type = "checkbox"; input.name = "attempt"; input.value = n;
      input.checked = chosen.size ? chosen.has(n) : shown.includes(n);
      label.appendChild(input); label.appendChild(document.createTextNode(" " + n + " "));
      box.appendChild(label);
    });
  }

  function errorOf(a) {
    const e = a.first_error;
    return e ? e.detail + " (" + text(e.lane) + " lane, node " + text(e.node) + ", rank " + text(e.rank) + ")" : null;
  }
  function causeOf(a) {
    const e = a.first_error;
    if (!e) return null;
    const missing = Object.keys(e.missing_evidence || {}).map(l => l + ": " + e.missing_evidence[l].join("; "));
    return text(e.category) + (e.owner ? ", owner " + e.owner : "") +
      (missing.length ? "; missing evidence " + missing.join(" | ") : "");
  }
  function decisionsOf(a) {
    return a.decisions.length ? a.decisions.map(d => text(d.action) + ": " + text(d.reason) +
      (d.owner ? " (owner " + d.owner + ")" : "") + (d.resume_step !== null ? ", resume at step " + d.resume_step : "") +
      (d.cordon.length ? ", cordon " + d.cordon.join(" ") : "") + (d.requested_by ? ", by " + d.requested_by : "")
    ).join(" \u2192 ") : null;
  }
  function placementOf(a) {
    const ranks = Object.keys(a.placement);
    return ranks.length ? ranks.map(r => "r" + r + "@" + a.placement[r]).join(" ") +
      (a.domain ? " (" + a.domain + ")" : "") : null;
  }
  const FIELDS = [
    ["why", a => a.reason], ["resumes at step", a => a.resume_step], ["state", a => a.state],
    ["placement", placementOf], ["first error", errorOf], ["cause", causeOf], ["recovery decision", decisionsOf],
  ];

  // One rank's progress on the shared step axis: a bar from where the attempt resumed to its last step.
  function bar(rank, attempt, steps) {
    const svg = document.createElementNS(NS, "svg");
    svg.setAttribute("width", BAR_W); svg.setAttribute("height", BAR_H); svg.setAttribute("class", "step-bar");
    const span = Math.max(steps.high - steps.low, 1);
    const x = s => (BAR_W - 2) * (s - steps.low) / span + 1;
    const from = attempt.resume_step === null ? steps.low : attempt.resume_step;
    if (rank.last_step !== null) {
      const r = document.createElementNS(NS, "rect");
      r.setAttribute("x", x(from)); r.setAttribute("y", 1); r.setAttribute("height", BAR_H - 2);
      r.setAttribute("width", Math.max(x(rank.last_step) - x(from), 2));
      r.setAttribute("class", rank.failed ? "steps failed" : "steps");
      svg.appendChild(r);
    }
    return svg;
  }

  function draw(view) {
    choices(view.attempts, view.shown.map(a => a.attempt));
    const head = document.querySelector("#attempts thead tr");
    head.replaceChildren(document.createElement("th"));
    view.shown.forEach(a => { const th = cell("th", "attempt " + a.attempt); th.dataset.attempt = a.attempt; head.appendChild(th); });
    const tbody = document.querySelector("#attempts tbody");
    tbody.replaceChildren();
    FIELDS.forEach(([name, of]) => {
      const tr = document.createElement("tr"); tr.dataset.field = name;
      tr.appendChild(cell("th", name));
      view.shown.forEach(a => {
        const td = cell("td", of(a), name === "first error" && a.first_error ? "failure" : "");
        td.dataset.attempt = a.attempt;
        if (name === "first error" && a.first_error) {
          const jump = document.createElement("a");
          jump.href = "/jobs/" + encodeURIComponent(jobId) + "#seq=" + a.first_error.seq; jump.textContent = " open";
          td.appendChild(jump);
        }
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
    });
    const rankHead = document.querySelector("#ranks thead tr");
    rankHead.replaceChildren(cell("th", "rank"));
    view.shown.forEach(a => rankHead.appendChild(cell("th", "attempt " + a.attempt + " (steps " +
      view.steps.low + "\u2013" + view.steps.high + ")")));
    const rankBody = document.querySelector("#ranks tbody");
    rankBody.replaceChildren();
    view.ranks.forEach(line => {
      const tr = document.createElement("tr"); tr.dataset.rank = line.rank;
      tr.appendChild(cell("td", line.rank));
      line.by_attempt.forEach((rank, i) => {
        const td = document.createElement("td"); td.dataset.attempt = view.shown[i].attempt;
        if (!rank) { td.textContent = "not in this attempt"; tr.appendChild(td); return; }
        if (rank.failed) td.className = "failure";
        td.appendChild(document.createTextNode(text(rank.node) + " \u00b7 step " + text(rank.last_step) + " \u00b7 " +
          (rank.ended ? rank.ended : rank.started ? "running" : "placed") + " "));
        td.appendChild(bar(rank, view.shown[i], view.steps));
        tr.appendChild(td);
      });
      rankBody.appendChild(tr);
    });
    body.dataset.shown = view.shown.map(a => a.attempt).join(",");
  }

  const status = document.getElementById("status");
  const source = new EventSource("/api/jobs/" + encodeURIComponent(jobId) + "/attempts" + location.search);
  source.addEventListener("open", () => { status.textContent = "live"; status.className = "status live"; });
  source.addEventListener("error", () => { status.textContent = "reconnecting"; status.className = "status lost"; });
  source.addEventListener("attempts", e => { draw(JSON.parse(e.data)); });
  source.addEventListener("caught_up", () => { body.dataset.caughtUp = "true"; });
  body.dataset.ready = "true";
})();
