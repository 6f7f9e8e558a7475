"""The job vocabulary every service shares: the spec a user submits and the states a job moves through."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from lanes_common.ids import validate_token

Token = Annotated[str, AfterValidator(validate_token)]
"""A string that is safe to use as a NATS subject token (job, node, model, replica ids)."""


class WorkloadClass(StrEnum):
    """What kind of work a job is; recovery policy is chosen per class."""

    TRAINING = "training"
    INFERENCE = "inference"
    EVALUATION = "evaluation"
    BATCH = "batch"


class JobState(StrEnum):
    """Base states of a job, as the lifecycle service folds them from events."""

    SUBMITTED = "submitted"
    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    RELEASED = "released"


class JobSpec(BaseModel):
    """What a user asks for. Later issues add versions, checkpoints, owners and constraints."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Token
    tenant: Token = "default"
    workload_class: WorkloadClass = WorkloadClass.TRAINING
    workers: int = Field(ge=1, le=65_536, description="Number of worker processes (ranks) in the gang.")
    gpus_per_worker: int = Field(default=1, ge=1, le=16)
    gpu_model: str | None = Field(default=None, description="Required GPU model, or any model when unset.")
    image: str = Field(default="local", min_length=1)
    command: tuple[str, ...] = Field(
        default=(),
        description="What each rank runs; the launcher passes RANK, WORLD_SIZE and LOCAL_RANK in the environment.",
    )
