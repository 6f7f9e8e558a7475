"""A running attempt's progress: rendezvous, communicator, checkpoints, artifacts, heartbeats, attempts."""

from __future__ import annotations

from pydantic import Field

from lanes_contract.events.base import Data, Event, Family, Lane
from lanes_contract.jobs import Digest, JobState, Token


class RendezvousDoneData(Data):
    """The rank found its peers: the world size it joined."""

    world_size: int = Field(ge=1)


class RendezvousDone(Event):
    """A rank completed rendezvous (it knows its peers); part of `starting`."""

    family = Family.JOB
    name = "rendezvous_done"
    lane: Lane = Lane.PLATFORM
    data: RendezvousDoneData


class CommunicatorReadyData(Data):
    """The collective communicator a rank initialised."""

    backend: str = ""


class CommunicatorReady(Event):
    """A rank's communicator (NCCL, gloo...) is initialised; when every rank is, the job is running."""

    family = Family.JOB
    name = "communicator_ready"
    lane: Lane = Lane.NETWORK
    data: CommunicatorReadyData


class CheckpointStartedData(Data):
    """The training step being checkpointed."""

    step: int = Field(ge=0)


class CheckpointStarted(Event):
    """A rank began writing a checkpoint; the job carries the `checkpointing` flag until it is saved."""

    family = Family.JOB
    name = "checkpoint_started"
    lane: Lane = Lane.ALGORITHM
    data: CheckpointStartedData


class CheckpointSavedData(Data):
    """A written checkpoint: its step, where it is and its content digest (what makes it verifiable)."""

    step: int = Field(ge=0)
    path: str = Field(min_length=1)
    digest: Digest
    # --- recovery: what the checkpoint was trained with, checked against the spec before a resume ---
    model_version: Digest | None = None
    data_version: Digest | None = None
    config_version: Digest | None = None
    image: str | None = None


class CheckpointSaved(Event):
    """A checkpoint was written and its digest recorded: the attempt's last verified checkpoint."""

    family = Family.JOB
    name = "checkpoint_saved"
    lane: Lane = Lane.ALGORITHM
    data: CheckpointSavedData


class ArtifactProducedData(Data):
    """An output of the job, named as the spec's success criteria name it."""

    artifact: Token
    path: str = Field(min_length=1)
    digest: Digest | None = None


class ArtifactProduced(Event):
    """A rank produced an artifact (a model export, an eval report...)."""

    family = Family.JOB
    name = "artifact_produced"
    lane: Lane = Lane.ALGORITHM
    data: ArtifactProducedData


MAX_TIMINGS = 256
"""Step timings one heartbeat may carry (an agent sends at most one heartbeat per rank per second)."""


class StepTiming(Data):
    """How one rank spent one training step: computing, and waiting inside its collectives."""

    step: int = Field(ge=0)
    compute_s: float = Field(ge=0, le=86_400, allow_inf_nan=False)
    wait_s: float = Field(ge=0, le=86_400, allow_inf_nan=False)


class HeartbeatData(Data):
    """Progress of a rank: the step it reached, and the timings of the steps since its last heartbeat."""

    step: int = Field(ge=0)
    timings: tuple[StepTiming, ...] = Field(default=(), max_length=MAX_TIMINGS)


class Heartbeat(Event):
    """A rank is alive at a step; the steps past the last verified checkpoint are what a failure loses."""

    family = Family.JOB
    name = "heartbeat"
    lane: Lane = Lane.ALGORITHM
    data: HeartbeatData


class AttemptRequestedData(Data):
    """Why a new attempt is wanted, and the step to resume from (the last verified checkpoint)."""

    reason: str
    resume_step: int | None = None
    avoid_nodes: tuple[Token, ...] = Field(
        default=(), description="Nodes the scheduler must never place this attempt on (carried from the retry)."
    )
    managed_by: Token | None = Field(
        default=None, description="The job spec's `managed_by`: set when another system places the attempt."
    )


class AttemptRequested(Event):
    """The lifecycle created attempt `attempt` of the job; the scheduler queues it for placement."""

    family = Family.JOB
    name = "attempt_requested"
    lane: Lane = Lane.PLATFORM
    data: AttemptRequestedData


class TransitionRejectedData(Data):
    """An event the job's state did not allow, kept on the timeline instead of silently dropped."""

    event_type: str
    event_id: str
    state: JobState | None
    reason: str


class TransitionRejected(Event):
    """The lifecycle refused an event for this job; the projection was left as it was."""

    family = Family.JOB
    name = "transition_rejected"
    lane: Lane = Lane.PLATFORM
    data: TransitionRejectedData
