"""The HTML timeline of a real demo run, rendered by headless Chromium: bands, marks, a screenshot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from support.optional import CHROMIUM, chromium, require

from lanes_cli.html import LANE_ORDER, render_page
from lanes_cli.timeline import TimelineEntry
from lanes_contract.events import EvidenceCategory, EvidenceData, JobEvidence, JobEvidenceData

LANES = str(Path(sys.executable).parent / "lanes")
require(CHROMIUM)


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    binary = chromium()
    assert binary is not None  # require(CHROMIUM) let the module run
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120, check=False)


def test_the_demo_timeline_page_renders_its_bands_and_marks(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"NATS_URL", "DATABASE_URL", "REDIS_URL"}}
    demo = subprocess.run([LANES, "demo", "--json"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert demo.returncode == 0, demo.stderr[-2000:]
    jobs = json.loads(demo.stdout)["jobs"]
    job = next(j for j in jobs if j["job_id"].startswith("demo-oom-"))  # the failing one, with a finding
    page = tmp_path / "timeline.html"
    page.write_text(render_page(job))
    assert "<script src" not in page.read_text()  # self-contained: no external assets
    assert "<link" not in page.read_text()

    dom = _chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile-dom").stdout
    assert 'data-ready="true"' in dom  # the page's script ran to the end
    bands = re.findall(r'<rect [^>]*class="band[^"]*"[^>]*data-lane="(\w+)"', dom)
    assert bands == list(LANE_ORDER)
    marks = re.findall(r'<circle [^>]*class="mark[^"]*"[^>]*data-seq="(\d+)"', dom)
    assert sorted(map(int, marks)) == sorted(row["seq"] for row in job["timeline"])
    assert f"Job {job['job_id']}" in dom

    shot = tmp_path / "timeline.png"
    _chromium("--window-size=1200,560", f"--screenshot={shot}", page.as_uri(), profile=tmp_path / "profile-shot")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000  # a drawn page, not a blank one


def test_event_text_that_looks_like_markup_stays_text_in_the_page(tmp_path: Path) -> None:
    attack = "</script><script>document.body.dataset.owned='1'</script><!--<script><img src=x onerror=alert(1)>"
    found = EvidenceData(category=EvidenceCategory.OOM_KILL, summary=attack, lines=(attack,))
    event = JobEvidence(
        source="lanes/telemetry",
        jobid="j-1",
        attempt=1,
        node="node-1",
        rank=0,
        data=JobEvidenceData(evidence_id="e-1", evidence=found),
    )
    row = TimelineEntry(1, "lanes.job.j-1.evidence", event).as_json()
    page = tmp_path / "timeline.html"
    page.write_text(render_page({"job_id": "j-1", "timeline": [row]}))

    dom = _chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile-dom").stdout
    assert 'data-ready="true"' in dom  # the page's own script ran to the end: the data did not end it
    assert "data-owned" not in dom  # the injected script never ran
    assert "<img" not in dom
    assert re.findall(r'<circle [^>]*data-seq="(\d+)"', dom) == ["1"]
