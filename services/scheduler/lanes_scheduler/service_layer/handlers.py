"""Scheduler handlers: apply one event inside the consumer's transaction, return the events it causes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import structlog

from lanes_contract.errors import PoisonEventError
from lanes_contract.events import (
    AttemptRequested,
    ClusterPolicySet,
    Event,
    JobPlaced,
    JobPlacedData,
    JobRejected,
    JobRejectedData,
    JobStateChanged,
    JobSubmitted,
    JobWaiting,
    JobWaitingData,
    NodeRegistered,
    NodeStateChanged,
    ResourcesReleased,
    ResourcesReleasedData,
    derive,
)
from lanes_contract.jobs import JobSpec, JobState
from lanes_contract.topology import NodeStatus
from lanes_runtime.consumer import Caused
from lanes_scheduler.domain.admission import CapacityView, Placed, Rejected, schedule
from lanes_scheduler.domain.queue import PendingJob, gang_of
from lanes_scheduler.service_layer.ports import QueuedAttempt, SchedulingRepository, UnitOfWork, WaitEnd, WaitUpdate

SOURCE = "lanes/scheduler"
TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
log = structlog.get_logger(__name__)

_MAX_STATES = 8


@dataclass
class _State:
    view: CapacityView
    pending: dict[tuple[str, int], PendingJob]


@dataclass
class _Round:
    """One transaction's scheduling: the state it started from and the events that asked for a decision.

    `causes` maps an attempt queued in this transaction to the event that queued it: its placement or wait
    derives from that event (one trace from submission to placement). Any other decision derives from the
    round's last trigger, the change of capacity that allowed it.
    """

    token: str
    state: _State | None
    triggers: list[tuple[Event, int]] = field(default_factory=list)
    causes: dict[tuple[str, int], tuple[Event, int]] = field(default_factory=dict)
    queued: dict[tuple[str, int], QueuedAttempt] = field(default_factory=dict)
    """Attempts queued in this round and not yet written (they are written together)."""


_ROUND = "lanes_scheduler.round"


class Scheduler:
    """The scheduler's handlers, with what this instance left behind after its last decision.

    That is the capacity view and the queue, kept under the state token written with them. They are reused
    only when the database still holds that token, i.e. no other process and no rolled-back transaction
    changed anything since. Tokens are random, so the state of one database is never taken for another's.

    In a batch transaction the queue is decided once, after the batch's last event (as Slurm's scheduler
    runs over its queue per interval, not per submission): a backlog of N waiting jobs then costs one pass
    per batch instead of one per arriving event, and jobs that arrived together are placed in priority
    order rather than in arrival order.
    """

    def __init__(self) -> None:
        self._states: dict[str, _State] = {}

    async def _round(self, uow: UnitOfWork) -> _Round:
        """This transaction's round: begun (lock, token, reusable state) by its first event."""
        if uow.batch is not None and _ROUND in uow.batch.cache:
            current: _Round = uow.batch.cache[_ROUND]
            return current
        await uow.repo.lock_scheduling()
        token = await uow.repo.state_token()
        current = _Round(token, self._states.pop(token, None))
        if uow.batch is not None:
            uow.batch.cache[_ROUND] = current
            batch_repo = uow.repo
            uow.batch.before_commit(lambda: self._finish(batch_repo, current))
        return current

    async def _finish(self, repo: SchedulingRepository, current: _Round) -> list[Caused]:
        """Decide the queue if anything asked for it; otherwise the state is still the one its token names."""
        await self._write_queued(repo, current)
        if not current.triggers:
            self._keep_unchanged(current)
            return []
        return await self._schedule(repo, current)

    def _keep_unchanged(self, current: _Round) -> None:
        """A round that asked for no decision leaves the state its token still names: keep it for the next."""
        if current.state is not None:
            self._states[current.token] = current.state

    async def _decide(self, uow: UnitOfWork, current: _Round, event: Event) -> list[Event]:
        """Ask for a decision because of `event`: at once, or after the batch's last event."""
        current.triggers.append((event, uow.stream_seq))
        if uow.batch is not None:
            return []
        return [output for _, output in await self._schedule(uow.repo, current)]

    async def _queue(
        self,
        uow: UnitOfWork,
        current: _Round,
        event: Event,
        spec: JobSpec,
        *,
        avoid_nodes: tuple[str, ...] = (),
    ) -> list[Event]:
        ref = (event.job_key, event.attempt or 1)
        if ref in current.queued or (current.state is not None and ref in current.state.pending):
            return []  # already queued: nothing changed
        current.queued[ref] = QueuedAttempt(*ref, spec, uow.stream_seq, avoid_nodes)
        current.causes[ref] = (event, uow.stream_seq)
        if uow.batch is None and ref not in await self._write_queued(uow.repo, current):
            return []
        return await self._decide(uow, current, event)

    async def _write_queued(self, repo: SchedulingRepository, current: _Round) -> set[tuple[str, int]]:
        """Write the attempts this round queued; those already known (placed, ended) ask for no decision."""
        if not current.queued:
            return set()
        queued, current.queued = list(current.queued.values()), {}
        added = await repo.add_pending_jobs(queued)
        known = [current.causes.pop((q.job_id, q.attempt)) for q in queued if (q.job_id, q.attempt) not in added]
        current.triggers = [trigger for trigger in current.triggers if trigger not in known]
        if current.state is not None:
            for q in queued:
                if (q.job_id, q.attempt) in added:
                    gang = gang_of(q.job_id, q.attempt, q.spec, q.seq, avoid_nodes=q.avoid_nodes)
                    current.state.pending[q.job_id, q.attempt] = PendingJob(gang, None)
        return added

    async def apply_job_event(self, event: Event, uow: UnitOfWork) -> Sequence[Event]:
        """Queue submitted jobs and new attempts, free the allocation of finished ones; then place what waits."""
        if _observed(event):
            return []  # another system places this job (observe mode): nothing to queue, hold or free
        if isinstance(event, JobStateChanged) and event.data.to_state not in TERMINAL:
            return []  # only the end of an attempt concerns the scheduler
        current = await self._round(uow)
        outputs = await self._apply_job_event(event, uow, current)
        self._put_back_unchanged(uow, current)
        return outputs

    async def _apply_job_event(self, event: Event, uow: UnitOfWork, current: _Round) -> list[Event]:
        if isinstance(event, JobSubmitted):
            return await self._queue(uow, current, event, event.data.spec)
        await self._write_queued(uow.repo, current)  # what follows reads the attempts this round queued
        if isinstance(event, AttemptRequested):
            spec = await uow.repo.original_spec(event.job_key)
            if spec is None:
                msg = f"attempt {event.attempt} of job {event.jobid} requested, but the job was never submitted"
                raise PoisonEventError(msg)
            return await self._queue(uow, current, event, spec, avoid_nodes=event.data.avoid_nodes)
        if isinstance(event, JobStateChanged):
            return await self._release(event, uow, current)
        msg = f"the scheduler does not handle {event.type} on the job stream"
        raise PoisonEventError(msg)

    def _put_back_unchanged(self, uow: UnitOfWork, current: _Round) -> None:
        """An event decided alone (a batch's round ends in `_finish`) that changed nothing."""
        if uow.batch is None and not current.triggers:
            self._keep_unchanged(current)

    async def _release(self, event: JobStateChanged, uow: UnitOfWork, current: _Round) -> list[Event]:
        attempt = event.attempt or 1
        released = await uow.repo.release(event.job_key, attempt, event.id, event.time)
        if released.outcome != "released":
            return []
        if current.state is not None:
            current.state.view.release(f"{event.job_key}/{attempt}")
            current.state.pending.pop((event.job_key, attempt), None)  # a job cancelled while it waited
        current.causes.pop((event.job_key, attempt), None)
        data = ResourcesReleasedData(nodes=released.nodes, gpus=released.gpus)
        freed = derive(ResourcesReleased, event, source=SOURCE, data=data)
        return [freed, *await self._decide(uow, current, event)]

    async def apply_node_event(self, event: Event, uow: UnitOfWork) -> Sequence[Event]:
        """Record inventory, node states and policy; any of them may let waiting jobs run (or change why not)."""
        current = await self._round(uow)
        if isinstance(event, NodeRegistered):
            await uow.repo.upsert_node(event.node_key, event.data)
        elif isinstance(event, NodeStateChanged):
            status = NodeStatus(
                state=event.data.state, reason=event.data.reason, owner_lane=event.lane.value, since=event.time
            )
            if not await uow.repo.set_node_state(event.node_key, status):
                log.warning("state change for an unknown node ignored", node=event.node, state=event.data.state)
                self._put_back_unchanged(uow, current)
                return []
        elif isinstance(event, ClusterPolicySet):
            await uow.repo.set_policy(event.data.policy)
        else:
            msg = f"the scheduler does not handle {event.type} on the node stream"
            raise PoisonEventError(msg)
        current.state = None  # the inventory changed: the decision rebuilds the view from the projection
        return await self._decide(uow, current, event)

    async def _load(self, repo: SchedulingRepository) -> _State:
        view = CapacityView(await repo.nodes(), await repo.policy(), await repo.holdings())
        pending = {(p.gang.job_id, p.gang.attempt): p for p in await repo.pending_jobs()}
        return _State(view, pending)

    async def _schedule(self, repo: SchedulingRepository, current: _Round) -> list[Caused]:
        """Decide every waiting attempt; publish placements, rejections and changed wait reasons.

        Returns each output with its cause: the event that queued the attempt in this round, else the
        round's last trigger.
        """
        state = current.state or await self._load(repo)
        trigger = current.triggers[-1]
        outputs: list[Caused] = []
        placements: list[Placed] = []
        ended: list[WaitEnd] = []
        waits: list[WaitUpdate] = []
        for decision in schedule(state.view, [p.gang for p in state.pending.values()]):
            gang = decision.gang
            ref = (gang.job_id, gang.attempt)
            cause, seq = current.causes.get(ref, trigger)
            key = f"{gang.job_id}/{gang.attempt}"
            ids: dict[str, str | int] = {"source": SOURCE, "jobid": gang.job_id, "attempt": gang.attempt}
            if isinstance(decision, Placed):
                placements.append(decision)
                if state.pending.pop(ref).wait_reason is not None:
                    ended.append(WaitEnd(gang.job_id, gang.attempt, cause.time, "placed"))
                placed = JobPlacedData(
                    assignments=decision.assignments, level=str(decision.level), domain=decision.domain
                )
                outputs.append((cause, derive(JobPlaced, cause, key=key, **ids, data=placed)))
            elif isinstance(decision, Rejected):
                del state.pending[ref]
                await repo.reject(gang)
                ended.append(WaitEnd(gang.job_id, gang.attempt, cause.time, "rejected"))
                rejected = JobRejectedData(
                    reason=decision.reason.value,
                    detail=decision.detail,
                    owner_lane=decision.owner_lane,
                    figures=dict(decision.figures),
                )
                outputs.append((cause, derive(JobRejected, cause, key=key, **ids, data=rejected)))
            else:
                last = state.pending[ref]
                changed = last.wait_reason != decision.reason.value
                if changed or (last.wait_detail, last.queue_position) != (decision.detail, decision.queue_position):
                    waits.append(WaitUpdate(decision, seq, cause.time, changed=changed))
                    state.pending[ref] = replace(
                        last,
                        wait_reason=decision.reason.value,
                        wait_detail=decision.detail,
                        queue_position=decision.queue_position,
                    )
                if changed:
                    waiting = JobWaitingData(
                        reason=decision.reason.value,
                        detail=decision.detail,
                        queue_position=decision.queue_position,
                        owner_lane=decision.owner_lane,
                        blocking=decision.blocking,
                        figures=dict(decision.figures),
                    )
                    outputs.append((cause, derive(JobWaiting, cause, key=key, **ids, data=waiting)))
        # The round's writes go together, a statement per kind rather than a round trip per attempt.
        await repo.allocate(placements)
        await repo.close_waits(ended)
        await repo.record_waits(waits)
        await self._keep(repo, state)
        return outputs

    async def _keep(self, repo: SchedulingRepository, state: _State) -> None:
        """Write a fresh state token in this transaction and remember the state by it."""
        token = uuid.uuid4().hex
        await repo.set_state_token(token)
        while len(self._states) >= _MAX_STATES:
            self._states.pop(next(iter(self._states)))
        self._states[token] = state


def _observed(event: Event) -> bool:
    """A submission or new attempt of a job that another system (e.g. Slurm) places and runs."""
    if isinstance(event, JobSubmitted):
        return event.data.spec.managed_by is not None
    return isinstance(event, AttemptRequested) and event.data.managed_by is not None
