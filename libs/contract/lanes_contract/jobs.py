"""The job vocabulary every service shares: the spec a user submits and the states a job moves through."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_validator

from lanes_contract.ids import validate_token
from lanes_contract.topology import TopologyConstraint

Token = Annotated[str, AfterValidator(validate_token)]
"""A string that is safe to use as a NATS subject token (job, node, model, replica ids)."""

MAX_ARGUMENT_CHARS = 32_768
"""One argument of a command; Linux refuses a single argument over 128 KiB at exec (E2BIG)."""
MAX_COMMAND_CHARS = 65_536
"""A whole command: bounded well under what exec accepts, so a job that was admitted can also start."""
MAX_ARGUMENTS = 4_096
Text = Annotated[str, Field(max_length=1_024)]
"""A short free-text field (an image, a GPU model, an owner, a path)."""
Argument = Annotated[str, Field(max_length=MAX_ARGUMENT_CHARS)]


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
    STARTING = "starting"
    RUNNING = "running"
    PARTIALLY_FAILED = "partially_failed"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    RELEASED = "released"
    RETRYING = "retrying"
    AWAITING_MANUAL = "awaiting_manual"


# --- lifecycle: causes, success criteria and owners (defaults keep older specs valid) ---


class FailureCause(StrEnum):
    """Why an attempt ended; refined later when telemetry publishes a finding."""

    NORMAL_COMPLETION = "normal_completion"
    USER_CANCEL = "user_cancel"
    NODE_FAULT = "node_fault"
    COMMUNICATION_FAILURE = "communication_failure"
    USER_CODE_ERROR = "user_code_error"
    PLATFORM_ACTION = "platform_action"
    UNKNOWN = "unknown"


class SuccessCriteria(BaseModel):
    """When an attempt counts as succeeded: every rank exited 0 and every required artifact was recorded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    all_ranks_exit_zero: bool = True
    required_artifacts: tuple[Token, ...] = Field(default=(), description="Artifact names that must be produced.")


class Owners(BaseModel):
    """Who to call per responsibility lane (a name, a team or an on-call alias)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: Text | None = None
    platform: Text | None = None
    host: Text | None = None
    network: Text | None = None


class ProtectionMode(StrEnum):
    """What an inference deployment does with a request when no replica can take it."""

    PAUSE = "pause"
    """Stop intake: 503 with `Retry-After`."""
    QUEUE = "queue"
    """Wait (bounded) for a slot, then 503 with `Retry-After`."""
    REJECT = "reject"
    """Answer 429 at once: the client should back off."""


class FailoverPolicy(BaseModel):
    """What the router does when a replica fails a request, per class of failure (safe defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    connect_failure: Literal["retry_elsewhere", "fail"] = Field(
        default="retry_elsewhere",
        description="Before any byte reached the client (refused, error, timeout): try another replica at once "
        "(within the router's max_attempts), or answer the failure.",
    )
    mid_stream: Literal["continue_elsewhere", "fail"] = Field(
        default="continue_elsewhere",
        description="After the first token (the connection drops, the replica goes silent, its node is lost): "
        "continue the stream on another ready replica of the same model and version, or end it with an "
        "error event. Continuing needs `continuation` other than `none`.",
    )
    max_continuations: StrictInt = Field(
        default=2,
        ge=0,
        le=16,
        description="How many times one stream may move; past it, the next failure ends it with an error event.",
    )
    drain_timeout_s: float | None = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="A draining replica's streams still running after this long are handed to another replica "
        "(continued like a failure mid-stream); unset: they finish where they are.",
    )


class ServingSpec(BaseModel):
    """What an inference job serves, and how the router protects it (one job = one replica)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Token = Field(description="The model name clients ask for, e.g. tiny-chat.")
    version: Token = Field(description="The model version this replica serves; routing never mixes versions silently.")
    max_concurrency: StrictInt = Field(
        default=8, ge=1, le=4096, description="In-flight requests per replica, all routers."
    )
    protection: ProtectionMode = ProtectionMode.PAUSE
    queue_timeout_s: float = Field(default=5.0, gt=0, le=600, description="How long `queue` waits for a slot.")
    retry_after_s: StrictInt = Field(default=2, ge=1, le=3600, description="The `Retry-After` a 503 or 429 carries.")
    weight: StrictInt = Field(
        default=100, ge=0, le=100, description="Traffic share of this version while several versions run."
    )
    continuation: Literal["text", "none"] = Field(
        default="text",
        description="How the backend continues a partial answer: `text` sends the prompt plus the text already "
        "streamed (chat: a final assistant message with vLLM's `continue_final_message`; completions: the "
        "prompt extended); `none`: it cannot, and a stream that loses its replica ends with an error event.",
    )
    failover: FailoverPolicy = FailoverPolicy()


Digest = Annotated[str, Field(pattern=r"^[a-z0-9]+:[0-9a-fA-F]{8,128}$", description="e.g. sha256:<hex>")]


class JobSpec(BaseModel):
    """What a user asks for: the gang, where it may run, what it runs, and what success and recovery mean."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Token
    tenant: Token = "default"
    workload_class: WorkloadClass = WorkloadClass.TRAINING
    # StrictInt: `workers: true` is not one worker; a boolean posing as a number is refused.
    workers: StrictInt = Field(ge=1, le=65_536, description="Number of worker processes (ranks) in the gang.")
    gpus_per_worker: StrictInt = Field(default=1, ge=1, le=16)
    gpu_model: Text | None = Field(default=None, description="Required GPU model, or any model when unset.")
    # --- scheduler: resources and topology (defaults keep older specs valid) ---
    gpu_memory_gib: StrictInt | None = Field(default=None, ge=1, description="Minimum memory per GPU, or any.")
    host_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=65_536,
        description="Host memory per rank: where the node agent may create cgroups, each rank runs in its own "
        "memory cgroup of this size, so exceeding it is the kernel's real OOM kill. Unset: no limit.",
    )
    pool: Token = "default"
    priority: StrictInt = Field(default=0, ge=-1000, le=1000, description="Higher is placed first.")
    topology: TopologyConstraint = TopologyConstraint()
    image: Text = Field(default="local", min_length=1)
    command: tuple[Argument, ...] = Field(
        default=(),
        max_length=MAX_ARGUMENTS,
        description="What each rank runs; the launcher passes RANK, WORLD_SIZE and LOCAL_RANK in the environment.",
    )
    # --- lifecycle: versions, checkpoints, success, retries, owners (defaults keep older specs valid) ---
    model_version: Digest | None = None
    data_version: Digest | None = None
    config_version: Digest | None = None
    checkpoint_location: Text | None = Field(default=None, min_length=1, description="Where checkpoints go.")
    success: SuccessCriteria = SuccessCriteria()
    retry_budget: StrictInt = Field(default=3, ge=0, le=100, description="How many retries (new attempts) are allowed.")
    steps: StrictInt | None = Field(
        default=None,
        ge=1,
        le=10**12,
        description="Training: the steps the run means to take. With them recovery weighs restarting a slow attempt"
        " (its projected loss over the steps left) against the restart's cost.",
    )
    owners: Owners = Owners()
    # --- router: what an inference job serves (required for inference, absent otherwise) ---
    serving: ServingSpec | None = None
    # --- observe mode: a job another system places and runs (default: Lanes places it) ---
    managed_by: Token | None = Field(
        default=None,
        description=(
            "The outside system that places, runs and requeues this job (e.g. slurm, lanes-run). Lanes' "
            "scheduler never places it and recovery only advises; attempts, placement, ranks and evidence "
            "come from that system's producer."
        ),
    )

    @model_validator(mode="after")
    def _command_fits_exec(self) -> JobSpec:
        total = sum(len(argument) + 1 for argument in self.command)
        if total > MAX_COMMAND_CHARS:
            msg = f"command is {total} characters; at most {MAX_COMMAND_CHARS} (put long inputs in a file)"
            raise ValueError(msg)
        return self

    @model_validator(mode="after")
    def _serving_matches_class(self) -> JobSpec:
        if self.workload_class is WorkloadClass.INFERENCE and self.serving is None:
            msg = "an inference job needs `serving` (model, version): the router routes to it by those"
            raise ValueError(msg)
        if self.workload_class is not WorkloadClass.INFERENCE and self.serving is not None:
            msg = f"`serving` is for inference jobs, not {self.workload_class} ones"
            raise ValueError(msg)
        return self
