"""Slow ranks from heartbeats' step timings, through the telemetry service on real NATS and PostgreSQL.

Four ranks on four nodes report every step's compute and wait in batches, as their agents send them; from
step 60 rank 2 computes 40% longer and the other three wait for it. Telemetry publishes one `slowdown` on the
job's subject naming rank 2 and its node, in the host lane, with the onset and the GPU-hours lost; the
batches that keep coming change nothing (one report per attempt), and a clean job gets none, even when
another node's agent sends slow timings in the name of one of its ranks (dead-lettered: not its node).

A degraded link: every rank's collective wait rises together, which the timings cannot pin on a link. The
node is the one whose agent reported its port holding packets back, even when the waits lean elsewhere.
"""

from __future__ import annotations

from support.cli import local_stack
from support.contract import stored
from support.recovery import events_of, wait_for
from support.waiting import eventually

from lanes_contract.client import LanesClient
from lanes_contract.events import (
    EvidenceCategory,
    EvidenceData,
    Heartbeat,
    HeartbeatData,
    JobPlaced,
    JobPlacedData,
    JobSlowdown,
    Lane,
    RankAssignment,
    StepTiming,
    utc_now,
)
from lanes_contract.streams import DEAD, JOBS
from lanes_evidence.evidence import Evidence, evidence_event
from lanes_runtime.settings import ServerUrls

NODES = ("sr-node-0", "sr-node-1", "sr-node-2", "sr-node-3")
BATCH = 20
"""Steps per heartbeat (an agent sends what a second gathered)."""


def _timing(rank: int, step: int, slow_from: int | None) -> StepTiming:
    # A +-1% wobble by rank and step; the slow rank computes 40% longer, and everyone waits for the slowest.
    def compute(r: int) -> float:
        c = 1.0 + 0.01 * (((step * 7 + r * 3) % 5) - 2) / 2
        return c * 1.4 if slow_from is not None and r == 2 and step >= slow_from else c

    slowest = max(compute(r) for r in range(len(NODES)))
    return StepTiming(step=step, compute_s=compute(rank), wait_s=slowest - compute(rank) + 0.25)


async def _forged(client: LanesClient, job_id: str, steps: int) -> None:
    """Node 0's agent claims rank 2's timings (rank 2 runs on node 2), slow ones, before rank 2 says anything."""
    timings = tuple(_timing(2, step, slow_from=0) for step in range(steps))
    for first in range(0, steps, BATCH):
        data = HeartbeatData(step=first + BATCH - 1, timings=timings[first : first + BATCH])
        keys = {"source": f"agent/{NODES[0]}", "jobid": job_id, "attempt": 1, "rank": 2, "node": NODES[0]}
        await client.publish(Heartbeat(data=data, **keys))  # type: ignore[arg-type]


async def _placed(client: LanesClient, job_id: str) -> None:
    assignments = tuple(RankAssignment(rank=r, node=n, gpus=(0, 1)) for r, n in enumerate(NODES))
    await client.publish(
        JobPlaced(source="tests", jobid=job_id, attempt=1, data=JobPlacedData(assignments=assignments))
    )


async def _run(client: LanesClient, job_id: str, steps: int, slow_from: int | None, *, place: bool = True) -> None:
    if place:
        await _placed(client, job_id)
    for first in range(0, steps, BATCH):
        for rank, node in enumerate(NODES):
            timings = tuple(_timing(rank, step, slow_from) for step in range(first, first + BATCH))
            data = HeartbeatData(step=first + BATCH - 1, timings=timings)
            beat = Heartbeat(source=f"agent/{node}", jobid=job_id, attempt=1, rank=rank, node=node, data=data)
            await client.publish(beat)


async def test_a_rank_that_computes_longer_is_named_once_with_its_node_lane_onset_and_cost(
    own_urls: ServerUrls, unique: str
) -> None:
    slow, clean, later = f"slow-{unique}", f"clean-{unique}", f"later-{unique}"
    async with local_stack(own_urls, ["telemetry"], nodes=False, agent=False) as conns:
        client = LanesClient(conns.nc, "tests")
        await _placed(client, clean)
        await _forged(client, clean, 200)  # another node's agent tries to make the clean job's rank 2 slow
        await _run(client, clean, 200, slow_from=None, place=False)
        await _run(client, slow, 200, slow_from=60)
        (found,) = await wait_for(client, slow, JobSlowdown)
        assert (found.data.kind, found.lane, found.rank, found.node) == ("compute_straggler", Lane.HOST, 2, NODES[2])
        assert found.data.rank == 2
        assert abs(found.data.onset_step - 60) <= 8  # within the block of steps it began in
        assert 0.35 < found.data.slowdown < 0.45  # its compute, 40% longer
        assert found.data.gpu_hours > 0  # 8 GPUs held while everyone waited for rank 2
        assert found.data.summary == (
            f"rank 2: compute +{found.data.slowdown:.0%}, the others wait for it since step {found.data.onset_step}"
            " (compute_straggler)"
        )
        await _run(client, slow, 300, slow_from=60)  # later heartbeats (and redeliveries) report nothing new
        await _run(client, later, 200, slow_from=60)
        # One consumer reads the heartbeats in order: once the last job's slowdown is out, every heartbeat
        # published before it was read, the clean job's and the slow job's later ones included.
        await wait_for(client, later, JobSlowdown)
        # A heartbeat read before its placement is redelivered, so wait for what the ordering cannot promise:
        # every genuine timing of the clean job stored, every forged heartbeat dead-lettered.
        dead = f"lanes.dead.{JOBS.name}.telemetry-progress"

        async def all_read() -> bool:
            timings = await conns.pool.fetchval("SELECT count(*) FROM telemetry_step_timings WHERE job_id = $1", clean)
            letters = await stored(conns.nc.jetstream(), DEAD.name, dead)
            return bool(timings == len(NODES) * 200 and letters == 200 // BATCH)

        await eventually(all_read, what="the clean job's timings stored and the forged ones dead-lettered")
        assert await events_of(client, clean, JobSlowdown) == []
        assert len(await events_of(client, slow, JobSlowdown)) == 1


def _link_timing(rank: int, step: int, leaning: int) -> StepTiming:
    # Nobody computes longer; from step 60 every rank waits 0.4 s more, rank `leaning` 0.65 s (a loaded host).
    compute = 1.0 + 0.01 * (((step * 7 + rank * 3) % 5) - 2) / 2
    extra = 0.0 if step < 60 else 0.65 if rank == leaning else 0.4
    return StepTiming(step=step, compute_s=compute, wait_s=1.02 - compute + 0.25 + extra)


async def _run_link(client: LanesClient, job_id: str, steps: int) -> None:
    for first in range(0, steps, BATCH):
        for rank, node in enumerate(NODES):
            timings = tuple(_link_timing(rank, step, leaning=3) for step in range(first, first + BATCH))
            data = HeartbeatData(step=first + BATCH - 1, timings=timings)
            await client.publish(
                Heartbeat(source=f"agent/{node}", jobid=job_id, attempt=1, rank=rank, node=node, data=data)
            )


async def test_a_degraded_link_is_named_by_the_node_whose_port_held_packets_back(
    own_urls: ServerUrls, unique: str
) -> None:
    reported, unreported = f"link-{unique}", f"quiet-{unique}"
    async with local_stack(own_urls, ["telemetry"], nodes=False, agent=False) as conns:
        client = LanesClient(conns.nc, "tests")
        await _placed(client, reported)
        await _placed(client, unreported)
        data = EvidenceData(category=EvidenceCategory.PORT_ERRORS, summary="link held back 40 packets", interface="lv1")
        now = utc_now()
        port = evidence_event(
            Evidence(data=data, time=now, node=NODES[1]), source=f"agent/{NODES[1]}", node=NODES[1], time=now
        )
        await client.publish(port.model_copy(update={"jobid": reported, "attempt": 1}))

        async def stored_port_errors() -> bool:
            found = await conns.pool.fetchval(
                "SELECT count(*) FROM telemetry_evidence WHERE category = 'port_errors' AND job_id = $1", reported
            )
            return bool(found)

        await eventually(stored_port_errors, what="the port errors stored")  # another consumer reads heartbeats
        await _run_link(client, reported, 200)
        await _run_link(client, unreported, 200)
        (named,) = await wait_for(client, reported, JobSlowdown)
        assert (named.data.kind, named.lane, named.rank, named.node) == ("degraded_link", Lane.NETWORK, None, NODES[1])
        assert abs(named.data.onset_step - 60) <= 8
        assert named.data.summary.startswith(f"{NODES[1]}: step time +")
        # No agent said which link: after waiting for one, the finding says what the waits alone lean towards.
        (leaning,) = await wait_for(client, unreported, JobSlowdown)
        assert (leaning.data.kind, leaning.lane, leaning.node) == ("degraded_link", Lane.NETWORK, NODES[3])
