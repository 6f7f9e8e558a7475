// The job page: its swimlanes and event list, fed live by the server's event stream (EventSource).
// Everything an event says is put in the page with textContent or as an attribute value, never as markup.
(function () {
  "use strict";
  const NS = "http://www.w3.org/2000/svg";
  const LANES = ["algorithm", "platform", "host", "network"];
  const COLORS = {algorithm: "#8e44ad", platform: "#2d6cdf", host: "#d35400", network: "#16a085"};
  const MAX_ROWS = 2000; // the page keeps this many events in the DOM; older ones leave it as new ones come
  const SHOW_PER_GROUP = 3; // rows of one failure group drawn one by one; the rest are counted in its group line
  const body = document.body;
  const jobId = body.dataset.job;
  const params = new URLSearchParams(location.search);
  const rows = []; // the events shown, in stream order
  let first = null;
  let dropped = 0;
  let earlier = 0; // stored events the view keeps that the server has not sent yet (before the first row)
  let before = null;
  const groupSeen = {}; // group key -> rows of it that arrived
  let grouped = 0;
  let drawQueued = false;

  // The filter form shows the URL's filters; applying it loads the URL with the new ones (a link to paste).
  const form = document.getElementById("filters");
  form.elements.q.value = params.get("q") || "";
  form.elements.failures.checked = params.get("failures") === "1";
  const chosenLanes = new Set(params.getAll("lane"));
  const laneFilters = document.getElementById("lane-filters");
  LANES.forEach(lane => {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox"; box.name = "lane"; box.value = lane; box.checked = chosenLanes.has(lane);
    label.appendChild(box); label.appendChild(document.createTextNode(" " + lane + " "));
    laneFilters.appendChild(label);
  });
  document.getElementById("clear").href = location.pathname;

  const svg = document.getElementById("chart");
  const W = 1100, left = 110, right = 20, bandH = 48, top = 12, H = top + bandH * LANES.length + 30;
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    (parent || svg).appendChild(e); return e;
  }
  LANES.forEach((lane, i) => {
    el("rect", {x: 0, y: top + i * bandH, width: W, height: bandH, class: "band" + (i % 2 ? " alt" : ""),
      "data-lane": lane});
    el("text", {x: 8, y: top + i * bandH + bandH / 2 + 4, class: "lane-label"}).textContent = lane;
  });
  el("line", {x1: left, x2: W - right, y1: H - 24, y2: H - 24, class: "axis"});
  const ticks = [0, 1, 2, 3, 4, 5].map(() => el("text", {y: H - 8, class: "tick"}));
  const marks = el("g", {id: "marks"});
  const tbody = document.querySelector("#events tbody");

  function text(value) { return value === null || value === undefined ? "-" : String(value); }

  // A node named on the timeline links to its history: its state changes and all its agent reported.
  function nodeLink(node) {
    const link = document.createElement("a");
    link.href = "/nodes/" + encodeURIComponent(node); link.textContent = node;
    link.addEventListener("click", e => e.stopPropagation());
    return link;
  }

  function add(row) {
    if (row.group) {
      groupSeen[row.group] = (groupSeen[row.group] || 0) + 1;
      if (groupSeen[row.group] > SHOW_PER_GROUP && !(first && first.seq === row.seq)) {
        grouped += 1; rows.push(row); trim(); queueDraw(); return; // counted in its group's line
      }
    }
    draw_row(row, false);
    rows.push(row);
    trim();
    markFirst();
    queueDraw();
  }

  function trim() {
    while (rows.length > MAX_ROWS) {
      const old = rows.shift(); dropped += 1;
      if (old.tr) old.tr.remove(); else grouped -= 1;
      if (old.mark) old.mark.remove();
    }
  }

  function draw_row(row, atTop) {
    const tr = document.createElement("tr");
    tr.className = "event" + (row.failure ? " failure" : "");
    tr.id = "seq-" + row.seq; tr.dataset.seq = row.seq; tr.dataset.lane = row.lane || "";
    [row.seq, row.time, row.lane, row.attempt, row.node, row.rank, row.kind || row.subject, row.summary]
      .forEach((value, i) => {
        const td = document.createElement("td");
        if (i === 4 && row.node) td.appendChild(nodeLink(row.node)); else td.textContent = text(value);
        if (i === 7) td.className = "summary";
        tr.appendChild(td);
      });
    tr.addEventListener("click", () => { location.hash = "seq=" + row.seq; });
    if (atTop) tbody.insertBefore(tr, tbody.firstChild); else tbody.appendChild(tr);
    row.tr = tr;
    if (row.lane && !isNaN(Date.parse(row.time))) {
      row.mark = el("circle", {r: 6, fill: COLORS[row.lane] || "#777", class: "mark", "data-seq": row.seq,
        "data-lane": row.lane}, marks);
      el("title", {}, row.mark).textContent = "#" + row.seq + " " + text(row.kind) + " node=" + text(row.node) +
        " rank=" + text(row.rank) + ": " + text(row.summary);
      row.mark.addEventListener("click", () => { location.hash = "seq=" + row.seq; });
    }
    if (row.kind === "replica_listening" || row.kind === "replica_state") showReplica(row);
  }

  // Earlier stored events, a page at a time from the server (the feed sent the newest ones only).
  const more = document.getElementById("earlier");
  function showEarlier() {
    more.replaceChildren();
    if (!earlier || before === null) return;
    const button = document.createElement("button");
    button.type = "button"; button.id = "load-earlier";
    button.textContent = "load earlier events (" + (earlier === true ? "more" : earlier) + " before #" + before + ")";
    button.addEventListener("click", loadEarlier);
    more.appendChild(button);
  }
  async function loadEarlier() {
    const query = new URLSearchParams(location.search);
    query.set("before", before); query.set("limit", "500");
    const answer = await fetch("/api/jobs/" + encodeURIComponent(jobId) + "/rows?" + query.toString());
    if (!answer.ok) { more.textContent = "could not load earlier events: " + (await answer.text()); return; }
    const page = await answer.json();
    // A group's first rows in this page are drawn, its others counted in the group line, as for the live rows.
    const inPage = {};
    const drawn = page.rows.map(row => {
      if (!row.group) return true;
      inPage[row.group] = (inPage[row.group] || 0) + 1;
      return inPage[row.group] <= SHOW_PER_GROUP || (first && first.seq === row.seq);
    });
    page.rows.slice().reverse().forEach((row, i) => {
      if (drawn[page.rows.length - 1 - i]) draw_row(row, true); else grouped += 1;
      rows.unshift(row);
    });
    while (rows.length > MAX_ROWS) { // the newest leave this time: the reader went back in time
      const old = rows.pop(); dropped += 1;
      if (old.tr) old.tr.remove(); else grouped -= 1;
      if (old.mark) old.mark.remove();
    }
    earlier = page.more ? (typeof earlier === "number" ? Math.max(earlier - page.rows.length, 1) : true) : 0;
    before = page.rows.length ? page.rows[0].seq : before;
    if (!page.rows.length) earlier = 0;
    showEarlier(); markFirst(); queueDraw();
  }

  // A storm's failures, one line per group with its count, each opening to its ranks and a link to its first.
  function showGroups(groups) {
    const box = document.getElementById("groups");
    box.replaceChildren();
    groups.forEach(g => {
      const details = document.createElement("details");
      details.className = "group" + (g.consequence ? " consequence" : "");
      details.dataset.key = g.key; details.dataset.count = g.count;
      const summary = document.createElement("summary");
      const who = g.ranks.length ? g.count + " ranks" : g.count + " events";
      let line = who + ": " + text(g.kind) + " " + text(g.says) + " (" + text(g.lane) + " lane, " + g.nodes + " nodes)";
      if (g.consequence && first) line += ", consequence of " + first.detail;
      if (g.holds_first_error) line += ", the first error among them";
      summary.textContent = line;
      details.appendChild(summary);
      const inner = document.createElement("div");
      inner.className = "sub";
      inner.appendChild(document.createTextNode("ranks " + g.ranks.join(" ") + (g.count > g.ranks.length ? " …" : "") + " "));
      const jump = document.createElement("a");
      jump.href = "#seq=" + g.first_seq; jump.textContent = "first of them (#" + g.first_seq + ")";
      inner.appendChild(jump);
      details.appendChild(inner);
      box.appendChild(details);
    });
  }

  // An inference job is a replica: its requests, with their provenance, are what a fault of it touched.
  function showReplica(row) {
    const replica = (row.data && row.data.replica) || row.job_id;
    const box = document.getElementById("replica");
    if (!replica || box.childNodes.length) return;
    const link = document.createElement("a");
    link.id = "replica-requests"; link.href = "/replicas/" + encodeURIComponent(replica) + "/requests";
    link.textContent = "the requests this replica served";
    box.className = "sub"; box.appendChild(document.createTextNode("Inference replica " + replica + ": "));
    box.appendChild(link);
  }

  function queueDraw() {
    if (drawQueued) return;
    drawQueued = true;
    requestAnimationFrame(draw);
  }

  function draw() {
    drawQueued = false;
    const times = rows.filter(r => r.mark).map(r => Date.parse(r.time));
    const t0 = times.length ? Math.min(...times) : 0, t1 = Math.max(...times, t0 + 1);
    const x = t => left + (W - left - right) * (t - t0) / (t1 - t0);
    rows.forEach((r, i) => {
      if (!r.mark) return;
      const jitter = ((i * 7) % 5 - 2) * 6;
      r.mark.setAttribute("cx", x(Date.parse(r.time)));
      r.mark.setAttribute("cy", top + LANES.indexOf(r.lane) * bandH + bandH / 2 + jitter);
    });
    ticks.forEach((tick, k) => {
      const t = t0 + (t1 - t0) * k / 5;
      tick.setAttribute("x", x(t) - 20);
      tick.textContent = "+" + ((t - t0) / 1000).toFixed(3) + "s";
    });
    document.getElementById("summary").textContent = (rows.length - grouped) + " events shown" +
      (grouped ? " (" + grouped + " more in the groups above)" : "") +
      (dropped ? " (the " + dropped + " oldest left the page; filter to see them)" : "") +
      (params.toString() ? " \u00b7 filtered" : "");
  }

  function markFirst() {
    rows.forEach(r => {
      if (!r.tr) return;
      const on = first !== null && r.seq === first.seq;
      r.tr.classList.toggle("first-error", on);
      if (r.mark) r.mark.classList.toggle("first-error", on);
    });
  }

  function showFirst(elected) {
    first = elected;
    const box = document.getElementById("first-error");
    box.replaceChildren();
    const div = document.createElement("div");
    if (!first) {
      div.className = "callout none"; div.textContent = "No error on this timeline yet.";
      box.appendChild(div); markFirst(); return;
    }
    div.className = "callout first-error";
    div.appendChild(document.createTextNode("First error: " + text(first.detail) + " (" + text(first.lane) +
      " lane, node "));
    div.appendChild(first.node ? nodeLink(first.node) : document.createTextNode("-"));
    div.appendChild(document.createTextNode(", rank " + text(first.rank) +
      (first.owner ? ", owner " + first.owner : "") + ") "));
    const jump = document.createElement("a");
    jump.id = "jump-first-error"; jump.href = "#seq=" + first.seq; jump.textContent = "jump to first error";
    div.appendChild(jump);
    box.appendChild(div);
    const missing = first.missing_evidence || {};
    if (Object.keys(missing).length) {
      const m = document.createElement("div"); m.className = "callout missing";
      m.textContent = "Missing evidence: " + Object.keys(missing).map(l => l + ": " + missing[l].join("; ")).join(" | ");
      box.appendChild(m);
    }
    markFirst();
  }

  // `#seq=<n>` selects that event: the row scrolled to and its detail shown.
  function select() {
    const m = /^#seq=(\d+)$/.exec(location.hash);
    rows.forEach(r => { if (r.tr) r.tr.classList.remove("selected"); if (r.mark) r.mark.classList.remove("selected"); });
    if (!m) return;
    const row = rows.find(r => r.seq === Number(m[1]));
    const detail = document.getElementById("detail");
    if (!row) { detail.textContent = "Event #" + m[1] + " is not among the events shown."; return; }
    if (!row.tr) { // a grouped row opened by its link: drawn where it belongs, now that it is asked for
      draw_row(row, false);
      const next = rows.slice(rows.indexOf(row) + 1).find(r => r.tr && r.tr !== row.tr);
      if (next) tbody.insertBefore(row.tr, next.tr);
      grouped -= 1; queueDraw();
    }
    row.tr.classList.add("selected"); if (row.mark) row.mark.classList.add("selected");
    row.tr.scrollIntoView({block: "center"});
    const shown = Object.assign({}, row); delete shown.tr; delete shown.mark; delete shown.group;
    detail.textContent = JSON.stringify(shown, null, 2);
    body.dataset.selected = row.seq;
  }
  window.addEventListener("hashchange", select);

  // An operator's action: the operator token goes in this request's Authorization header only, never a cookie,
  // and is not kept. The command it sends comes back on the timeline like any other event.
  const act = document.getElementById("act");
  act.addEventListener("submit", async e => {
    e.preventDefault();
    const result = document.getElementById("act-result");
    const f = act.elements;
    const answer = await fetch("/api/jobs/" + encodeURIComponent(jobId) + "/actions/" + encodeURIComponent(f.action.value), {
      method: "POST", headers: {"Authorization": "Bearer " + f.token.value, "Content-Type": "application/json"},
      body: JSON.stringify({by: f.by.value, reason: f.reason.value}),
    });
    f.token.value = "";
    result.className = answer.ok ? "sub" : "refused";
    result.textContent = answer.ok ? (s => "sent: " + s.type + " #" + s.seq)(await answer.json()) : await answer.text();
    result.dataset.status = answer.status;
  });

  const status = document.getElementById("status");
  const source = new EventSource("/api/jobs/" + encodeURIComponent(jobId) + "/events" + location.search);
  source.addEventListener("open", () => { status.textContent = "live"; status.className = "status live"; });
  source.addEventListener("error", () => { status.textContent = "reconnecting"; status.className = "status lost"; });
  source.addEventListener("row", e => { add(JSON.parse(e.data)); });
  source.addEventListener("first_error", e => { showFirst(JSON.parse(e.data)); });
  source.addEventListener("groups", e => { showGroups(JSON.parse(e.data)); });
  source.addEventListener("page", e => {
    const page = JSON.parse(e.data);
    if (body.dataset.caughtUp === "true") return; // a reconnect: the rows the page has stay
    earlier = page.earlier; before = page.before; showEarlier();
  });
  source.addEventListener("caught_up", () => {
    if (body.dataset.caughtUp !== "true") { body.dataset.caughtUp = "true"; select(); }
  });
  body.dataset.ready = "true";
})();
