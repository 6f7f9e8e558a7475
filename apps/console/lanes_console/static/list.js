// A list of events, live (EventSource on the page's data-feed): a node's history (its state changes and the
// evidence its agent sent), or the requests a replica served. Everything an event says is put in the page with
// textContent, never as markup.
(function () {
  "use strict";
  const MAX_ROWS = 2000; // the page keeps this many events in the DOM; older ones leave it as new ones come
  const body = document.body;
  const tbody = document.querySelector("#events tbody");
  let count = 0;

  function text(value) { return value === null || value === undefined ? "-" : String(value); }

  function add(row) {
    count += 1;
    const tr = document.createElement("tr");
    tr.className = "event" + (row.failure ? " failure" : "");
    tr.dataset.seq = row.seq; tr.dataset.stream = row.stream;
    const cells = [row.stream, row.seq, row.time, row.lane, null, row.rank, row.kind || row.subject, row.summary];
    cells.forEach((value, i) => {
      const td = document.createElement("td");
      if (i === 4 && row.job_id) {
        const link = document.createElement("a");
        link.href = "/jobs/" + encodeURIComponent(row.job_id); link.textContent = row.job_id;
        td.appendChild(link);
      } else {
        td.textContent = text(value);
      }
      if (i === 7) td.className = "summary";
      tr.appendChild(td);
    });
    tr.addEventListener("click", () => {
      document.getElementById("detail").textContent = JSON.stringify(row, null, 2);
    });
    tbody.appendChild(tr);
    while (tbody.rows.length > MAX_ROWS) tbody.rows[0].remove();
    if (row.kind === "state_changed" && row.data) {
      document.getElementById("state").textContent = "State: " + text(row.data.state) +
        (row.data.reason ? " (" + row.data.reason + ")" : "") + " since " + text(row.time);
    }
    document.getElementById("summary").textContent = count + " events";
  }

  const status = document.getElementById("status");
  const source = new EventSource(body.dataset.feed);
  source.addEventListener("open", () => { status.textContent = "live"; status.className = "status live"; });
  source.addEventListener("error", () => { status.textContent = "reconnecting"; status.className = "status lost"; });
  source.addEventListener("row", e => { add(JSON.parse(e.data)); });
  source.addEventListener("caught_up", () => { body.dataset.caughtUp = "true"; });
  body.dataset.ready = "true";
})();
