"""Recovery acts on settled evidence, on real servers: the OOM scenario with its kernel line held back.

Every rank is a real process run by the local launcher; all services run as `lanes up` runs them. The
kernel's OOM line arrives seconds after the other ranks have timed out and exited: telemetry's finding
waits for it (the killed rank's exit says SIGKILL, "kernel log pending"), and recovery decides only once the
finding is settled, so the killed rank's node is cordoned and a node that merely waited never is.

A rank that exits with a status and says nothing is no evidence against its node: nothing is cordoned.
"""

from __future__ import annotations

import sys

import pytest
from support.cli import local_stack
from support.recovery import events_of, node_events, wait_for

from lanes_cli.bootstrap import SERVICES
from lanes_cli.demo import DEMO_NODES
from lanes_cli.incident import bundle
from lanes_cli.scenarios.telemetry import oom_killed_rank
from lanes_cli.timeline import job_timeline, row_kind
from lanes_cli.verdicts import decision_verdicts
from lanes_contract.client import LanesClient
from lanes_contract.events import (
    JobFinding,
    JobStateChanged,
    JobSubmitted,
    JobSubmittedData,
    Lane,
    NodeStateChanged,
    RecoveryAction,
    RecoveryDecided,
)
from lanes_contract.jobs import FailureCause, JobSpec, JobState, Owners, WorkloadClass
from lanes_contract.topology import NodeState
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
    # Before the kernel line, no finding blamed a node that merely waited. Which evidence comes first is not
    # fixed: a survivor's exit (status 1) or timeout can reach telemetry before the victim's SIGKILL does.
    # Such an early finding may say where that exit happened (an unexplained exit, platform lane) or that
    # several nodes are still silent (naming none), but only the killed rank's node is ever blamed (host or
    # network lane), and the findings said they waited for its kernel log.
    early = [r["data"] for r in rows if row_kind(r) == "finding" and not r["data"]["settled"]]
    assert early
    blamed = [f["first_error"] for f in early if f["first_error"] and f["first_error"]["lane"] in {"host", "network"}]
    assert {first["node"] for first in blamed} <= {"node-3"}, blamed
    assert any("kernel log of node-3" in " ".join(f["waiting_for"]) for f in early)
    (verdict,) = decision_verdicts(rows)
    assert verdict.agrees, verdict.explain()
    incident = bundle({"job_id": job_id, "timeline": rows})
    assert incident["decisions"][0]["decided_on"] == f"host/oom_kill on node-3 rank 2 at v{data['finding_version']}"


async def test_a_rank_that_exits_3_without_a_word_cordons_nothing_and_its_finding_says_unexplained(
    own_urls: ServerUrls, unique: str
) -> None:
    job_id = f"silent-exit-{unique}"
    spec = JobSpec(
        name="silent-exit",
        workload_class=WorkloadClass.TRAINING,
        workers=2,
        gpus_per_worker=4,
        command=(sys.executable, "-c", "import sys; sys.exit(3)"),
        owners=Owners(algorithm="ml-oncall", host="node-oncall"),
    )
    async with local_stack(own_urls, SERVICES) as conns:
        client = LanesClient(conns.nc, "tests")
        await client.publish(JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
        decided = (await wait_for(client, job_id, RecoveryDecided, timeout_s=120))[0].data
        findings = await events_of(client, job_id, JobFinding)
        cordons = [
            e
            for node in DEMO_NODES
            for e in await node_events(client, node)
            if isinstance(e, NodeStateChanged) and e.data.state is NodeState.CORDONED
        ]
        failed = await events_of(client, job_id, JobStateChanged)
    assert (decided.action, decided.first_error, decided.cordon) == (
        RecoveryAction.MANUAL, "platform/unexplained_exit", (),
    )  # fmt: skip
    assert decided.settled
    assert decided.owner == "ml-oncall"
    assert cordons == []
    used = next(f for f in findings if f.id == decided.finding_id).data
    first = used.first_error
    assert first is not None
    assert (first.category, first.lane) == ("unexplained_exit", Lane.PLATFORM)
    assert "exited with status 3 and no evidence explains it" in first.summary
    missing = [(m.lane, m.what) for m in used.missing_evidence]
    assert (
        Lane.ALGORITHM,
        f"an error line in rank {first.rank}'s own output saying why it exited (none was read)",
    ) in (missing)
    assert not [f for f in findings if f.data.first_error and f.data.first_error.lane is Lane.HOST]
    assert FailureCause.NODE_FAULT not in {e.data.cause for e in failed if e.data.to_state is JobState.FAILED}
