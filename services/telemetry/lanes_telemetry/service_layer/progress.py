"""Slow ranks and degraded links from the heartbeats' step timings (the `telemetry-progress` consumer).

Each rank's agent batches its step timings into heartbeats (at most one per rank per second). This handler
keeps them and, once per attempt per batch (before the commit, as the election runs), reads the attempt's
complete steps through the straggler core (`domain/stragglers.py`). The first slowdown found is published
as `slowdown` on the job's subject, once per attempt: an attempt that is slow stays slow, and a page a
second would bury it.

A degraded link is named from two signals. The timings say the job's collectives slowed, but not behind which
link: in a ring every rank waits for the slow hop alike (measured on a real rate-limited link: no rank's wait
and no rank's arrival stands out; on a loaded host one node's waits can lean higher by chance). The node's
agent says which link holds packets back (its port counters, `port_errors` evidence), and that names the node.
A degraded link found without that word waits for it up to `LINK_REPORT_WAIT` more steps, then is reported
with what the timings alone say (a node whose ranks' waits rose most, or the job's collective path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lanes_contract.errors import PoisonEventError, TransientError
from lanes_contract.events import Event, Heartbeat, JobSlowdown, JobSlowdownData, derive
from lanes_runtime.consumer import Caused, HandlerContext
from lanes_telemetry.adapters.repository import PostgresStepTimings
from lanes_telemetry.domain.stragglers import BLOCK, DEFAULT_WARMUP, RankStep, SlowClass, Slowdown, detect
from lanes_telemetry.service_layer.ports import StepTimingFactory, StepTimingStore

SOURCE = "lanes/telemetry"
RECENT_STEPS = 1000
"""Steps read after the baseline: a slowdown older than this has been reported, or never will be."""
LINK_REPORT_WAIT = 4 * BLOCK
"""Steps a degraded link found in the timings waits for its node's agent to name the link (seconds at most)."""
_PENDING = "telemetry.slowdown_reads"


class SlowRanks:
    """The handler of the `telemetry-progress` consumer, on a step-timing store (the port)."""

    def __init__(self, store: StepTimingFactory = PostgresStepTimings) -> None:
        self._store = store

    async def handle_progress(self, event: Event, ctx: HandlerContext) -> Sequence[Event]:
        """Keep a heartbeat's step timings; read the attempt for a slowdown (now, or once per batch)."""
        if not isinstance(event, Heartbeat) or not event.data.timings or event.attempt is None:
            return ()
        if event.rank is None or event.node is None:
            return ()  # a heartbeat that does not say whose timings they are cannot place them
        store = self._store(ctx.conn)
        # Timings count only from the node the rank was placed on: another node's agent (which may sign for
        # its own node only) must not be able to make a rank elsewhere look slow, or hide that it is.
        placed = await store.placed_node(event.job_key, event.attempt, event.rank)
        if placed is None:
            msg = f"heartbeat of rank {event.rank} of {event.job_key}/{event.attempt} before its placement was read"
            raise TransientError(msg, delay_s=1.0)
        if placed != event.node:
            msg = f"heartbeat of rank {event.rank} from node {event.node}, but the rank was placed on {placed}"
            raise PoisonEventError(msg)
        await store.add(event.job_key, event.attempt, event.rank, event.node, event.data.timings)
        if not ctx.scope.deferred:
            return [found for _, found in await _read(store, {(event.job_key, event.attempt): event})]
        pending: dict[tuple[str, int], Event] | None = ctx.scope.cache.get(_PENDING)
        if pending is None:
            pending = ctx.scope.cache[_PENDING] = {}
            scope = ctx.scope
            scope.before_commit(lambda: _read(store, scope.cache.pop(_PENDING)))
        pending[event.job_key, event.attempt] = event  # the finding follows from the batch's last heartbeat
        return ()


async def _read(store: StepTimingStore, attempts: dict[tuple[str, int], Event]) -> list[Caused]:
    """Read each attempt (in one order, so two transactions wait rather than deadlock) for a slowdown."""
    found: list[Caused] = []
    for (job_id, attempt), cause in sorted(attempts.items()):
        if await store.reported(job_id, attempt):
            continue
        slow = await _first_slowdown(store, job_id, attempt)
        if slow is None:
            continue
        report = JobSlowdownData(
            kind=slow.kind.value,
            rank=slow.rank,
            node=slow.node,
            onset_step=slow.onset_step,
            slowdown=round(slow.slowdown, 4),
            lost_s=round(slow.lost_s, 3),
            gpu_hours=round(slow.gpu_hours(await store.gpus(job_id, attempt)), 4),
            votes=round(slow.votes, 3),
            summary=slow.summary(),
        )
        await store.save_report(job_id, attempt, report)
        event = derive(JobSlowdown, cause, source=SOURCE, lane=slow.lane, rank=slow.rank, node=slow.node, data=report)
        found.append((cause, event))
    return found


async def _first_slowdown(store: StepTimingStore, job_id: str, attempt: int) -> Slowdown | None:
    """The first slowdown the attempt's complete steps show, read block by block from where the last read ended.

    Read at block ends only, the same timings give the same finding however their heartbeats were batched.
    """
    timed = await store.complete_steps(job_id, attempt, DEFAULT_WARMUP, RECENT_STEPS)
    nodes = {t.rank: t.node for t in timed}
    steps = [RankStep(t.rank, t.step, t.compute_s, t.wait_s) for t in timed]
    ordered = sorted({s.step for s in steps})
    done = await store.read_through(job_id, attempt)
    ends = [step for i, step in enumerate(ordered) if (i + 1) % BLOCK == 0 and step > done]
    for end in ends:
        slow = detect([s for s in steps if s.step <= end], nodes=nodes)
        if slow is not None and slow.kind is SlowClass.DEGRADED_LINK:
            named = await store.throttled_links(job_id, attempt)
            if len(named) == 1:  # the port's own counters outrank a node the waits merely lean towards
                slow = dataclasses.replace(slow, node=named[0])
            elif ordered[-1] - end < LINK_REPORT_WAIT:
                # Not yet reported (the agent's word travels another way): read this block again next time.
                await store.set_read_through(job_id, attempt, max(done, end - 1))
                return None
        if slow is not None:
            await store.set_read_through(job_id, attempt, end)
            return slow
    if ends:
        await store.set_read_through(job_id, attempt, ends[-1])
    return None
