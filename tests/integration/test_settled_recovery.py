"""Recovery acts on settled evidence, on real servers: the OOM scenario with its kernel line held back.

Every rank is a real process run by the local launcher; all services run as `lanes up` runs them. The
kernel's OOM line arrives seconds after the other ranks have timed out and exited: telemetry's finding
waits for it (the killed rank's exit says SIGKILL, "kernel log pending"), and recovery decides only once the
finding is settled, so the killed rank's node is cordoned and a node that merely waited never is.
"""

from __future__ import annotations

import pytest
from support.cli import local_stack

from lanes_cli.bootstrap import SERVICES
from lanes_cli.incident import bundle
from lanes_cli.scenarios.telemetry import oom_killed_rank
from lanes_cli.timeline import job_timeline, row_kind
from lanes_cli.verdicts import decision_verdicts
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]
KERNEL_DELAY_S = 3.0
"""Less than telemetry's settle window (5 s): the finding waits for the line instead of settling without it."""


async def test_a_kernel_line_seconds_late_still_cordons_the_killed_ranks_node_and_never_another(
    own_urls: ServerUrls,
) -> None:
    async with local_stack(own_urls, SERVICES) as conns:
        job_id = await oom_killed_rank(conns, kernel_delay_s=KERNEL_DELAY_S, timeout_s=150)
        rows = [entry.as_json() for entry in await job_timeline(conns.nc.jetstream(), job_id)]
    killed = next(r for r in rows if row_kind(r) == "rank_exited" and (r.get("data") or {}).get("signal") == 9)
    assert killed["node"] == "node-3"
    (decision,) = [r for r in rows if row_kind(r) == "recovery_decided"]
    data = decision["data"]
    assert data["cordon"] == ["node-3"]
    assert data["settled"] is True
    assert data["first_error"] == "host/oom_kill"
    used = next(r for r in rows if row_kind(r) == "finding" and r["data"]["version"] == data["finding_version"])
    assert used["data"]["settled"]
    assert not [r for r in rows if row_kind(r) == "recovery_superseded"]
    # Before the kernel line, the findings blamed the killed rank's node already, and said they waited for it.
    early = [r["data"] for r in rows if row_kind(r) == "finding" and not r["data"]["settled"]]
    assert early
    assert all(f["first_error"]["node"] == "node-3" for f in early if f["first_error"])
    assert any("kernel log of node-3" in " ".join(f["waiting_for"]) for f in early)
    (verdict,) = decision_verdicts(rows)
    assert verdict.agrees, verdict.explain()
    incident = bundle({"job_id": job_id, "timeline": rows})
    assert incident["decisions"][0]["decided_on"] == f"host/oom_kill on node-3 rank 2 at v{data['finding_version']}"
