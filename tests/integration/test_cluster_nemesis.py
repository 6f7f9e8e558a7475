"""A short run of the fault checker (bench/nemesis.py): three NATS servers, two processes of every service, each
fault kind once at half the pauses, under load. Nothing acknowledged is lost, nothing unexpected appears, no
placement is doubled, no job is stuck, the projections rebuild equal and the audit chain verifies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]
NEMESIS = Path(__file__).resolve().parents[2] / "bench" / "nemesis.py"


def test_a_quick_nemesis_run_loses_nothing() -> None:
    done = subprocess.run(
        [sys.executable, str(NEMESIS), "--quick", "--seed", "3", "--scale", "0.5", "--settle-s", "90"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["seed"] == 3
    assert len(report["fault_kinds"]) >= 5, report["faults"]
    assert report["acknowledged"] > 0
    assert report["lost"]["total"] == 0, report["lost"]
    assert all(count == report["acknowledged"] for count in report["read_back"].values()), report["read_back"]
    assert report["unexpected"] == 0
    assert report["duplicated"] == 0
    assert report["stuck"] == 0, report["stuck_jobs"]
    assert report["projections_verify"]["exit"] == 0, report["projections_verify"]
    assert report["audit_verify"]["exit"] == 0, report["audit_verify"]
