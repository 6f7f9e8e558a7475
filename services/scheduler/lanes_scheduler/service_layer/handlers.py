"""Scheduler handlers: apply one event inside the consumer's transaction, return the events it causes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

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
from lanes_scheduler.domain.admission import CapacityView, Placed, Rejected, schedule
from lanes_scheduler.domain.queue import PendingJob, gang_of
from lanes_scheduler.service_layer.ports import UnitOfWork

SOURCE = "lanes/scheduler"
TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
log = structlog.get_logger(__name__)

_MAX_STATES = 8


@dataclass
class _State:
    view: CapacityView
    pending: dict[tuple[str, int], PendingJob]


class Scheduler:
    """The scheduler's handlers, with what this instance left behind after its last decision.

    That is the capacity view and the queue, kept under the state token written with them. They are reused
    only when the database still holds that token, i.e. no other process and no rolled-back transaction
    changed anything since. Tokens are random, so the state of one database is never taken for another's.
    """

    def __init__(self) -> None:
        self._states: dict[str, _State] = {}

    async def _reusable_state(self, uow: UnitOfWork) -> tuple[str, _State | None]:
        token = await uow.repo.state_token()
        return token, self._states.pop(token, None)

    def _put_back(self, token: str, state: _State | None) -> None:
        if state is not None:
            self._states[token] = state

    async def _queue(
        self,
        uow: UnitOfWork,
        state: _State | None,
        job_id: str,
        attempt: int,
        spec: JobSpec,
        *,
        avoid_nodes: tuple[str, ...] = (),
    ) -> bool:
        added = await uow.repo.add_pending_job(job_id, attempt, spec, uow.stream_seq, avoid_nodes=avoid_nodes)
        if added and state is not None:
            gang = gang_of(job_id, attempt, spec, uow.stream_seq, avoid_nodes=avoid_nodes)
            state.pending[(job_id, attempt)] = PendingJob(gang, None)
        return added

    async def apply_job_event(self, event: Event, uow: UnitOfWork) -> Sequence[Event]:
        """Queue submitted jobs and new attempts, free the allocation of finished ones; then place what waits."""
        if _observed(event):
            return []  # another system places this job (observe mode): nothing to queue, hold or free
        if isinstance(event, JobStateChanged) and event.data.to_state not in TERMINAL:
            return []  # only the end of an attempt concerns the scheduler
        await uow.repo.lock_scheduling()
        token, state = await self._reusable_state(uow)
        if isinstance(event, JobSubmitted):
            added = await self._queue(uow, state, event.job_key, event.attempt or 1, event.data.spec)
            if not added:
                self._put_back(token, state)
                return []
            return await self._schedule(event, uow, state)
        if isinstance(event, AttemptRequested):
            spec = await uow.repo.original_spec(event.job_key)
            if spec is None:
                msg = f"attempt {event.attempt} of job {event.jobid} requested, but the job was never submitted"
                raise PoisonEventError(msg)
            added = await self._queue(
                uow, state, event.job_key, event.attempt or 1, spec, avoid_nodes=event.data.avoid_nodes
            )
            if not added:
                self._put_back(token, state)
                return []
            return await self._schedule(event, uow, state)
        if isinstance(event, JobStateChanged):
            attempt = event.attempt or 1
            released = await uow.repo.release(event.job_key, attempt, event.id, event.time)
            if released.outcome != "released":
                self._put_back(token, state)  # nothing changed: the state is still the one the token names
                return []
            if state is not None:
                state.view.release(f"{event.job_key}/{attempt}")
                state.pending.pop((event.job_key, attempt), None)  # a job cancelled while it waited
            data = ResourcesReleasedData(nodes=released.nodes, gpus=released.gpus)
            freed = derive(ResourcesReleased, event, source=SOURCE, data=data)
            return [freed, *await self._schedule(event, uow, state)]
        msg = f"the scheduler does not handle {event.type} on the job stream"
        raise PoisonEventError(msg)

    async def apply_node_event(self, event: Event, uow: UnitOfWork) -> Sequence[Event]:
        """Record inventory, node states and policy; any of them may let waiting jobs run (or change why not)."""
        await uow.repo.lock_scheduling()
        if isinstance(event, NodeRegistered):
            await uow.repo.upsert_node(event.node_key, event.data)
        elif isinstance(event, NodeStateChanged):
            status = NodeStatus(
                state=event.data.state, reason=event.data.reason, owner_lane=event.lane.value, since=event.time
            )
            if not await uow.repo.set_node_state(event.node_key, status):
                log.warning("state change for an unknown node ignored", node=event.node, state=event.data.state)
                return []
        elif isinstance(event, ClusterPolicySet):
            await uow.repo.set_policy(event.data.policy)
        else:
            msg = f"the scheduler does not handle {event.type} on the node stream"
            raise PoisonEventError(msg)
        return await self._schedule(event, uow, None)  # the inventory changed: rebuild the view from the projection

    async def _load(self, uow: UnitOfWork) -> _State:
        view = CapacityView(await uow.repo.nodes(), await uow.repo.policy(), await uow.repo.holdings())
        pending = {(p.gang.job_id, p.gang.attempt): p for p in await uow.repo.pending_jobs()}
        return _State(view, pending)

    async def _schedule(self, cause: Event, uow: UnitOfWork, state: _State | None) -> list[Event]:
        """Decide every waiting attempt; publish placements, rejections and changed wait reasons."""
        state = state or await self._load(uow)
        outputs: list[Event] = []
        for decision in schedule(state.view, [p.gang for p in state.pending.values()]):
            gang = decision.gang
            ref = (gang.job_id, gang.attempt)
            key = f"{gang.job_id}/{gang.attempt}"
            ids: dict[str, str | int] = {"source": SOURCE, "jobid": gang.job_id, "attempt": gang.attempt}
            if isinstance(decision, Placed):
                waited = state.pending.pop(ref).wait_reason is not None
                await uow.repo.allocate(gang, decision.assignments)
                if waited:
                    await uow.repo.close_wait(gang.job_id, gang.attempt, cause.time, "placed")
                outputs.append(
                    derive(
                        JobPlaced,
                        cause,
                        key=key,
                        **ids,
                        data=JobPlacedData(
                            assignments=decision.assignments, level=str(decision.level), domain=decision.domain
                        ),
                    )
                )
            elif isinstance(decision, Rejected):
                del state.pending[ref]
                await uow.repo.reject(gang)
                await uow.repo.close_wait(gang.job_id, gang.attempt, cause.time, "rejected")
                data = JobRejectedData(
                    reason=decision.reason.value,
                    detail=decision.detail,
                    owner_lane=decision.owner_lane,
                    figures=dict(decision.figures),
                )
                outputs.append(derive(JobRejected, cause, key=key, **ids, data=data))
            else:
                last = state.pending[ref]
                changed = last.wait_reason != decision.reason.value
                if changed or (last.wait_detail, last.queue_position) != (decision.detail, decision.queue_position):
                    await uow.repo.record_wait(decision, uow.stream_seq, cause.time, changed=changed)
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
                    outputs.append(derive(JobWaiting, cause, key=key, **ids, data=waiting))
        await self._keep(uow, state)
        return outputs

    async def _keep(self, uow: UnitOfWork, state: _State | None) -> None:
        """Write a fresh state token in this transaction and remember the state by it (if there is one)."""
        token = uuid.uuid4().hex
        await uow.repo.set_state_token(token)
        if state is not None:
            while len(self._states) >= _MAX_STATES:
                self._states.pop(next(iter(self._states)))
            self._states[token] = state


def _observed(event: Event) -> bool:
    """A submission or new attempt of a job that another system (e.g. Slurm) places and runs."""
    if isinstance(event, JobSubmitted):
        return event.data.spec.managed_by is not None
    return isinstance(event, AttemptRequested) and event.data.managed_by is not None
