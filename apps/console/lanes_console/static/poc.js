// The POC page: the verdict table of the last `lanes poc run`, each cell linked to the job that is its evidence.
// Everything the report says is put in the page with textContent or as an attribute value, never as markup.
(function () {
  "use strict";
  const body = document.body;
  function cellOf(tag, value) { const c = document.createElement(tag); c.textContent = value; return c; }
  fetch("/api/poc").then(async answer => {
    const source = document.getElementById("source");
    if (!answer.ok) { source.className = "refused"; source.textContent = await answer.text(); body.dataset.ready = "true"; return; }
    const table = await answer.json();
    source.textContent = table.report ? "report: " + table.report : "";
    const head = document.querySelector("#verdicts thead tr");
    table.columns.forEach(column => head.appendChild(cellOf("th", column)));
    const tbody = document.querySelector("#verdicts tbody");
    table.lines.forEach(line => {
      const tr = document.createElement("tr"); tr.dataset.capability = line.capability;
      tr.appendChild(cellOf("th", line.capability));
      line.cells.forEach((cell, i) => {
        const td = document.createElement("td"); td.dataset.rung = table.columns[i];
        if (!cell) { td.textContent = "-"; tr.appendChild(td); return; }
        td.dataset.verdict = cell.verdict; td.className = "verdict " + cell.verdict.replace(/ /g, "-");
        if (cell.missing) td.title = cell.missing;
        if (cell.href) {
          const a = document.createElement("a"); a.href = cell.href; a.textContent = cell.verdict; td.appendChild(a);
        } else td.textContent = cell.verdict;
        if (cell.missing) td.appendChild(cellOf("div", cell.missing)).className = "sub";
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
    });
    body.dataset.ready = "true";
  });
})();
