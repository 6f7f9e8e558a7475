// The jobs list: every job's latest state, folded from the server's event stream (EventSource), filtered by
// the URL's query string so that a pasted link shows the same list.
(function () {
  "use strict";
  const params = new URLSearchParams(location.search);
  const form = document.getElementById("filters");
  const wanted = {state: params.get("state") || "", lane: params.get("lane") || "", owner: params.get("owner") || ""};
  let pattern = null;
  try { pattern = params.get("q") ? new RegExp(params.get("q"), "i") : null; } catch (e) { pattern = /$^/; }
  form.elements.q.value = params.get("q") || "";
  form.elements.owner.value = wanted.owner;
  form.elements.lane.value = wanted.lane;
  const states = new Set(["submitted", "pending", "placed", "running", "succeeded", "failed", "partially_failed",
    "cancelled", "held", "retrying"]);
  const jobs = new Map();
  const tbody = document.querySelector("#jobs tbody");
  let queued = false;

  function fold(update) {
    const job = jobs.get(update.job_id) || {job_id: update.job_id};
    for (const key of ["name", "state", "error_lane", "owner"]) {
      if (update[key] !== undefined && update[key] !== null) job[key] = update[key];
    }
    job.time = update.time; job.seq = update.seq;
    jobs.set(update.job_id, job);
    if (job.state) states.add(job.state);
    if (!queued) { queued = true; requestAnimationFrame(draw); }
  }

  function keeps(job) {
    return (!wanted.state || job.state === wanted.state) && (!wanted.lane || job.error_lane === wanted.lane) &&
      (!wanted.owner || job.owner === wanted.owner) && (!pattern || pattern.test(job.job_id + " " + (job.name || "")));
  }

  function draw() {
    queued = false;
    const select = form.elements.state;
    [...states].sort().forEach(s => {
      if (![...select.options].some(o => o.value === s)) {
        const o = document.createElement("option"); o.value = s; o.textContent = s; select.appendChild(o);
      }
    });
    select.value = wanted.state;
    const shown = [...jobs.values()].filter(keeps).sort((a, b) => b.seq - a.seq);
    tbody.replaceChildren(...shown.map(job => {
      const tr = document.createElement("tr"); tr.dataset.job = job.job_id;
      const link = document.createElement("a");
      link.href = "/jobs/" + encodeURIComponent(job.job_id); link.textContent = job.job_id;
      const first = document.createElement("td"); first.appendChild(link); tr.appendChild(first);
      [job.name, job.state, job.error_lane, job.owner, job.time].forEach(value => {
        const td = document.createElement("td"); td.textContent = value === undefined || value === null || value === "" ? "-" : value;
        tr.appendChild(td);
      });
      return tr;
    }));
    document.getElementById("summary").textContent = shown.length + " of " + jobs.size + " jobs";
  }

  const status = document.getElementById("status");
  const source = new EventSource("/api/jobs");
  source.addEventListener("open", () => { status.textContent = "live"; status.className = "status live"; });
  source.addEventListener("error", () => { status.textContent = "reconnecting"; status.className = "status lost"; });
  source.addEventListener("job", e => { fold(JSON.parse(e.data)); });
  source.addEventListener("caught_up", () => { document.body.dataset.caughtUp = "true"; draw(); });
  document.body.dataset.ready = "true";
})();
