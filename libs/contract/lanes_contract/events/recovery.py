"""Recovery: decisions, escalations and manual actions."""

from __future__ import annotations

from enum import StrEnum

from pydantic import AwareDatetime, Field

from lanes_contract.events.base import Data, Event, Family, Lane
from lanes_contract.events.commands import CommandData
from lanes_contract.jobs import ProtectionMode, Token


class RecoveryAction(StrEnum):
    """What the recovery service decided to do about a failed attempt (or a running one that slowed)."""

    RESUME = "resume"
    """Training: a new attempt from the last verified checkpoint, on healthy nodes."""
    RESTART = "restart"
    """Training: a running attempt slowed by one node is stopped and resumed from its last verified checkpoint
    elsewhere, because the time the slowness would still cost is more than the restart's."""
    REBUILD = "rebuild"
    """Evaluation / batch: a new attempt from the start."""
    REPLACE_REPLICA = "replace_replica"
    """Inference: the replica leaves rotation and a replacement of the same version is placed."""
    MANUAL = "manual"
    """No automatic recovery: the job waits for its owner (`lanes recover`)."""
    NONE = "none"
    """Nothing to recover (e.g. the attempt succeeded or was cancelled by its user, or a slow one runs on)."""
    ABANDON = "abandon"
    """The owner gave up on the job (`lanes recover --abandon`): it ends cancelled, with its failure kept."""


class ManualAction(StrEnum):
    """What an owner decided for a job waiting on the manual path."""

    APPROVE = "approve"
    """Run the recovery the policy would have run (e.g. resume from the verified checkpoint)."""
    ROLLBACK = "rollback"
    """Resume from the checkpoint before the last verified one (e.g. the last one is suspect)."""
    ABANDON = "abandon"
    """Give up on the job."""


class CheckpointRef(Data):
    """A checkpoint as its `checkpoint_saved` event recorded it."""

    attempt: int = Field(ge=1)
    step: int = Field(ge=0)
    path: str
    digest: str


class RefusedCheckpoint(Data):
    """A checkpoint the version gate refused, and the field that did not match."""

    checkpoint: CheckpointRef
    field: str = Field(description="digest, step, model_version, data_version, config_version or image.")
    expected: str | None = None
    found: str | None = None


class LostWork(Data):
    """The work a failure threw away: steps past the resumed checkpoint, times GPUs, times step time."""

    steps: int = Field(ge=0)
    gpus: int = Field(ge=0)
    step_time_s: float | None = Field(default=None, ge=0)
    gpu_hours: float | None = Field(default=None, ge=0)


class Culprit(Data):
    """Who a decision (or a finding) blames: the first error's lane, node and rank."""

    lane: Lane
    category: str
    node: str | None = None
    rank: int | None = None


class RecoveryDecidedData(Data):
    """One recovery decision: what it acted on, under which policy, what it does, and what should follow."""

    finding_id: str = Field(min_length=1, description="The finding (or event) the decision acted on.")
    finding_version: int | None = Field(default=None, ge=1, description="The finding version decided on.")
    settled: bool | None = Field(
        default=None,
        description="Whether that finding was settled; False: decided when the grace ran out, without one.",
    )
    first_error: str = Field(default="", description="lane/category of the first error, e.g. host/oom_killed.")
    culprit: Culprit | None = Field(default=None, description="Whom the decision blames: lane, node and rank.")
    policy: str = Field(min_length=1)
    policy_version: int = Field(ge=1)
    workload_class: str
    action: RecoveryAction
    reason: str
    owner: str = Field(description="Who owns the next step (person or team, else the lane's on-call).")
    owner_lane: Lane
    rollback: str = Field(description="How to undo this decision.")
    expects: str = Field(description="The event type that should follow if all goes well.")
    cordon: tuple[Token, ...] = Field(default=(), description="Nodes taken out of scheduling.")
    checkpoint: CheckpointRef | None = None
    refused: tuple[RefusedCheckpoint, ...] = ()
    lost_work: LostWork | None = None
    backoff_s: float | None = Field(default=None, ge=0)
    deadline: AwareDatetime | None = None
    retries_used: int = Field(default=0, ge=0)
    # --- manual path and inference (defaults: a decision the policy made on its own) ---
    manual_action: ManualAction | None = Field(default=None, description="Set when an owner's action decided.")
    requested_by: str = Field(default="", description="Who took the manual action; empty when the policy decided.")
    protection: ProtectionMode | None = Field(
        default=None, description="Inference: how the router protects requests while the replica is replaced."
    )
    resume_step: int | None = Field(
        default=None, ge=0, description="The step the next attempt starts from (0: the start)."
    )


class RecoveryDecided(Event):
    """The recovery service decided how the job's failed attempt recovers (or that it waits for a person)."""

    family = Family.JOB
    name = "recovery_decided"
    lane: Lane = Lane.PLATFORM
    data: RecoveryDecidedData


class RecoveryEscalatedData(Data):
    """A manual step whose deadline passed without a decision."""

    decision_id: str
    owner: str
    owner_lane: Lane
    deadline: AwareDatetime
    reason: str = ""


class RecoveryEscalated(Event):
    """Nobody acted on a manual recovery step before its deadline."""

    family = Family.JOB
    name = "recovery_escalated"
    lane: Lane = Lane.PLATFORM
    data: RecoveryEscalatedData


class RecoverySupersededData(Data):
    """A decision acted on a finding that a later, settled finding contradicts: what is undone and redone."""

    decision_id: str = Field(min_length=1, description="The decision superseded.")
    decided_on: Culprit
    decided_version: int | None = Field(default=None, ge=1)
    finding_id: str = Field(min_length=1, description="The later finding that moved the culprit.")
    finding_version: int = Field(ge=1)
    culprit: Culprit
    uncordon: tuple[Token, ...] = Field(default=(), description="Nodes the superseded decision wrongly cordoned.")
    replanned: bool = Field(description="True: the retry was re-planned; False: the next attempt was already placed.")
    reason: str


class RecoverySuperseded(Event):
    """A later finding moved the culprit after recovery decided: the decision is superseded, on the timeline."""

    family = Family.JOB
    name = "recovery_superseded"
    lane: Lane = Lane.PLATFORM
    data: RecoverySupersededData


class ManualActionData(CommandData):
    """The owner's decision; `requested_by` and `reason` say who and why."""

    action: ManualAction


class ManualActionRequested(Event):
    """An owner acted on a job waiting for a manual recovery decision (`lanes recover`)."""

    family = Family.JOB
    name = "manual_action"
    lane: Lane = Lane.PLATFORM
    data: ManualActionData
