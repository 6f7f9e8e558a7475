"""The recovery as the composition root sees it: its tables, its consumer of job events and its timer runner.

The consumer reads the job events recovery folds one at a time in stream order (`batch=1`,
`max_ack_pending=1`): a job's facts are few, but their order makes the story (the submission before the
failure, a checkpoint before the failure it may resume from). The lifecycle, with far more events, gets its
order another way: a per-job ordered fold (docs/ordering.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lanes_contract.streams import JOBS
from lanes_recovery.adapters.policies import configured_policy
from lanes_recovery.domain.policy import Policy
from lanes_recovery.entrypoints.timers import RecoveryTimers
from lanes_recovery.service_layer.handlers import Recovery
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.service import RunnerContext, ServiceDefinition
from lanes_runtime.store import migrations_of

RECOVERY_INPUTS = (
    "submitted",
    "placed",
    "attempt_requested",
    "heartbeat",
    "checkpoint_saved",
    "finding",
    "slowdown",
    "state_changed",
    "resources_released",
    "manual_action",
)
"""The subject names (`lanes.job.*.<name>`) recovery folds."""

EVENTS = ConsumerSpec(
    durable="recovery",
    stream=JOBS,
    subjects=tuple(f"lanes.job.*.{name}" for name in RECOVERY_INPUTS),
    batch=1,
    max_ack_pending=1,
)


def recovery_service(
    policy: Callable[[], Policy] = configured_policy,
    *,
    consumer: ConsumerSpec = EVENTS,
    tick_s: float = 0.25,
) -> ServiceDefinition:
    """The recovery service under a policy (default: LANES_RECOVERY_POLICY, else the shipped one)."""
    recovery = Recovery(policy)

    def timers(ctx: RunnerContext) -> RecoveryTimers:
        return RecoveryTimers(ctx.nc, ctx.pool, recovery, tick_s=tick_s)

    return ServiceDefinition(
        name="recovery",
        migrations=migrations_of("lanes_recovery.adapters"),
        consumers=((consumer, recovery.handle_job_event),),
        runners=(timers,),
    )


def consumer_for_jobs(job_ids: tuple[str, ...], durable: str) -> ConsumerSpec:
    """Recovery's consumer restricted to some jobs (tests on a shared server, per-tenant deployments)."""
    subjects = tuple(f"lanes.job.{job}.{name}" for job in job_ids for name in RECOVERY_INPUTS)
    return dataclasses.replace(EVENTS, durable=durable, subjects=subjects)


SERVICE = recovery_service()
