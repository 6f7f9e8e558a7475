"""The Kubernetes observer publishing to real NATS (its own embedded server) through lanes_observe's outbox, with
the lifecycle and telemetry services reading it: the Workload evicted for PodsReadyTimeout is one job with two
attempts on the read side, and the OOMKilled pod is telemetry's host-lane finding naming its rank.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support.cli import local_stack
from support.k8s_api import FakeKubeApi
from support.observe import job_view, timeline_events
from support.waiting import eventually

from lanes_contract.events import JobFinding, JobStateChanged, Lane
from lanes_contract.jobs import JobState
from lanes_k8s.kubeconfig import ApiAccess
from lanes_k8s.watch import Backoff, KubeApi, KubeWatch
from lanes_observe.outbox import Outbox, Sender
from lanes_runtime.service import Connections
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers]

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"


def stream(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


@pytest.fixture
async def observed(own_urls: ServerUrls, tmp_path: Path) -> AsyncIterator[tuple[Connections, FakeKubeApi, KubeWatch]]:
    api = FakeKubeApi()
    await api.start()
    async with local_stack(own_urls, ["lifecycle", "telemetry"], nodes=False) as conns:
        outbox = Outbox(tmp_path / "k8s-outbox.ndjson")
        watch = KubeWatch(
            KubeApi(ApiAccess(server=api.url), read_timeout_s=10.0),
            outbox,
            Sender(outbox, own_urls.nats_url, name="tests-k8s"),
            watch_timeout_s=3,
            backoff=Backoff(initial_s=0.05, cap_s=0.3),
        )
        stop = asyncio.Event()
        running = asyncio.create_task(watch.run(stop))
        try:
            yield conns, api, watch
        finally:
            stop.set()
            await running
            await watch.sender.close()
            await watch.api.close()
            await api.stop()


async def _feed(api: FakeKubeApi, watch: KubeWatch, items: list[dict[str, Any]]) -> None:
    for item in items:
        version = await api.apply(item["type"], item["object"])
        kind = item["object"]["kind"]

        async def absorbed(kind: str = kind, version: int = version) -> bool:
            return all(
                int(s.resource_version or 0) >= version for k, s in watch.streams.items() if k.startswith(f"{kind}:")
            )

        await eventually(absorbed, what=f"{kind} at {version} read")


def _job_id(watch: KubeWatch) -> str:
    (job,) = watch.observer.memory.jobs.values()
    return job.job_id


async def test_an_evicted_and_readmitted_workload_is_one_job_with_two_attempts_on_the_read_side(observed, own_urls):
    conns, api, watch = observed
    await _feed(api, watch, stream("kueue-podsreadytimeout.ndjson"))
    job_id = _job_id(watch)

    async def released() -> bool:
        return any(
            isinstance(e, JobStateChanged) and e.attempt == 2 and e.data.to_state is JobState.RELEASED
            for e in await timeline_events(conns, job_id)
        )

    await eventually(
        released, what="attempt 2 released by the lifecycle", nc=conns.nc, subjects=[f"lanes.job.{job_id}.>"]
    )
    view = await job_view(own_urls, job_id)
    assert view is not None
    attempts = [(a["number"], a["cause"]) for a in view["attempts"]]
    assert attempts == [(1, "platform_action"), (2, "normal_completion")]
    assert watch.outbox.lines() == []  # everything sent


async def test_an_oomkilled_pod_is_telemetrys_host_lane_finding_naming_its_rank(observed):
    conns, api, watch = observed
    await _feed(api, watch, stream("jobset-oomkilled.ndjson"))
    job_id = _job_id(watch)

    async def finding() -> JobFinding | None:
        found = [e for e in await timeline_events(conns, job_id) if isinstance(e, JobFinding)]
        return found[-1] if found else None

    async def elected() -> bool:
        # Telemetry re-elects as evidence arrives (the rank's exit on the job stream, the OOM kill on the
        # telemetry stream): wait for the finding to read both.
        latest = await finding()
        return (
            latest is not None
            and latest.data.first_error is not None
            and latest.data.first_error.category == "oom_kill"
        )

    await eventually(
        elected, what="telemetry's finding on the OOM kill", nc=conns.nc, subjects=[f"lanes.job.{job_id}.>"]
    )
    latest = await finding()
    assert latest is not None
    assert latest.data.first_error is not None
    assert (latest.lane, latest.data.first_error.rank, latest.data.first_error.node) == (Lane.HOST, 3, "gpu-node-4")
    assert "OOMKilled" in latest.data.first_error.summary
