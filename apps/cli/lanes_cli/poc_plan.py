"""The plan of `lanes poc run`: the workload, the rungs of nodes it grows by, a drill at every rung, the criteria.

A pure module: `parse_plan(text)` gives the plan or a `PlanError` whose message is `line N: what was expected`
(the line of the YAML node the problem is in), so a user can fix a malformed plan without reading a stack
trace. The shipped default plan is `poc_default.yaml` beside this module.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum
from importlib import resources
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from lanes_cli.input_files import InputFileError, UniqueKeyLoader, parse_yaml
from lanes_contract.events import DrillKind
from lanes_contract.jobs import Token

DEFAULT_PLAN = "poc_default.yaml"
MAX_RUNGS = 16
MAX_PLAN_NODES = 64
"""Simulated nodes run on this one host: a plan of thousands is a typo, refused before anything starts."""


class InferenceStep(StrEnum):
    """The inference POC's steps, in the order a plan may list them."""

    START = "start"
    HEALTH = "health"
    TRAFFIC = "traffic"
    UPGRADE = "upgrade"
    ROLLBACK = "rollback"
    SCALE_DOWN = "scale_down"
    NODE_FAULT = "node_fault"


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Cluster(_Strict):
    """The simulated nodes the runner starts: every rung is placed on these."""

    nodes: StrictInt = Field(ge=1, le=MAX_PLAN_NODES)
    gpus_per_node: StrictInt = Field(default=4, ge=1, le=16)


class Training(_Strict):
    """The training workload every rung runs, unchanged: only the number of nodes grows."""

    workload: Literal["drill"] | None = "drill"
    """The bundled drill workload (torch.distributed over gloo, CPU), or None with a `command`."""
    command: tuple[Annotated[str, Field(min_length=1, max_length=4096)], ...] | None = Field(
        default=None, min_length=1, max_length=256
    )
    steps: StrictInt = Field(default=120, ge=1, le=1_000_000)
    step_s: float = Field(default=0.05, ge=0, le=60)
    checkpoint_every: StrictInt = Field(default=20, ge=1, le=1_000_000)
    collective_timeout_s: float = Field(default=15.0, gt=0, le=3600)
    host_memory_gib: float | None = Field(default=None, gt=0, le=1024)

    @model_validator(mode="after")
    def _one_workload(self) -> Training:
        if (self.command is None) == (self.workload is None):
            msg = "give either workload: drill or a command, not both and not neither"
            raise ValueError(msg)
        return self


class Drill(_Strict):
    """One fault injected into a rung's running job, after its first verified checkpoint."""

    kind: DrillKind
    rank: StrictInt = Field(default=0, ge=0)
    duration_s: float | None = Field(default=None, gt=0, le=3600)


class Rung(_Strict):
    """One step of scale: a job of `nodes` ranks, each holding `gpus` GPUs of its node, and its drills."""

    nodes: StrictInt = Field(ge=1, le=MAX_PLAN_NODES)
    gpus: StrictInt = Field(default=4, ge=1, le=16)
    drills: tuple[Drill, ...] = Field(default=(), max_length=8)

    @model_validator(mode="after")
    def _ranks_exist(self) -> Rung:
        for drill in self.drills:
            if drill.kind.value.startswith("replica-"):
                msg = f"{drill.kind.value} is a drill on an inference replica: the inference steps run it, not a rung"
                raise ValueError(msg)
            if drill.rank >= self.nodes:
                msg = f"drill rank {drill.rank} does not exist in a rung of {self.nodes} ranks (one per node)"
                raise ValueError(msg)
        return self


TOY_MODEL = "tiny-chat"
"""The model `lanes poc run` serves: the toy OpenAI-compatible replica (`lanes_sandbox.toy_replica`)."""


class Inference(_Strict):
    """The inference service: the toy model behind the router, its two versions, its replicas and its load.

    The version steps (upgrade, rollback, scale-down) run `replicas` replicas of each version under `clients`
    streaming clients; the node-fault step is the demo's story (two replicas, three clients). Only the toy
    model can be served by the runner: another model is refused rather than silently run as the toy.
    """

    model: str = TOY_MODEL
    versions: tuple[Token, Token] = ("v1", "v2")
    replicas: StrictInt = Field(default=2, ge=2, le=8)
    """Replicas of each version (two at least: a drilled replica's streams continue on another of its version)."""
    clients: StrictInt = Field(default=3, ge=1, le=64)
    """Streaming clients through the router, each sending one request after another, the whole time."""
    steps: tuple[InferenceStep, ...] = Field(default=tuple(InferenceStep), max_length=len(InferenceStep))

    @model_validator(mode="after")
    def _servable(self) -> Inference:
        if self.model != TOY_MODEL:
            msg = (
                f"unknown model {self.model!r}: lanes poc run serves only the toy model {TOY_MODEL} "
                "(lanes_sandbox.toy_replica), whose answers it can check token by token"
            )
            raise ValueError(msg)
        if self.versions[0] == self.versions[1]:
            msg = f"the two versions must differ (an upgrade from {self.versions[0]} to itself is no upgrade)"
            raise ValueError(msg)
        return self


class Criteria(_Strict):
    """The pass thresholds, each the user's to change."""

    detect_within_s: float = Field(default=60.0, gt=0, le=86_400)
    named_right: bool = True
    """The finding must name the injected rank, node and lane."""
    released: bool = True
    """The drilled attempt's allocation must be released."""
    verified_checkpoint: bool = True
    """The next attempt must resume from a checkpoint saved with its digest."""
    min_ettr: float = Field(default=0.0, ge=0, le=1)
    """The lowest effective training time ratio a rung may have and pass goodput."""
    min_completeness: float = Field(default=1.0, ge=0, le=1)
    """The share of each lane's events that must carry their join keys."""


class Plan(_Strict):
    """`lanes poc run PLAN.yaml`."""

    name: str = Field(default="poc", min_length=1, max_length=128)
    cluster: Cluster
    training: Training = Training()
    rungs: tuple[Rung, ...] = Field(min_length=1, max_length=MAX_RUNGS)
    inference: Inference | None = None
    criteria: Criteria = Criteria()
    rung_timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    """How long one rung may take before it is judged as it stands (never a hang)."""


class PlanError(ValueError):
    """A plan that cannot be run; the message is `line N: what was expected`."""


def parse_plan(text: str) -> Plan:
    """The plan in `text` (YAML), or a PlanError naming the line and what was expected there."""
    try:
        document = parse_yaml(text)
    except InputFileError as exc:
        raise PlanError(_with_line(str(exc))) from exc
    if not isinstance(document, dict):
        raise PlanError("line 1: expected a mapping with cluster, rungs (and training, inference, criteria)")
    try:
        return Plan.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "plan"
        line = _line_of(text, first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise PlanError(f"line {line}: {where}: {first['msg']}{more}") from exc


def default_plan_text() -> str:
    """The shipped plan: rungs of 1, 2 and 4 nodes, a drill at each, and the inference steps."""
    return resources.files("lanes_cli").joinpath(DEFAULT_PLAN).read_text(encoding="utf-8")


def _with_line(message: str) -> str:
    # A YAML error names its place (`line N, column M`, or `(line N)` for a key given twice); lead with the
    # first line it names, as every plan error does.
    found = re.search(r"line (\d+)", message)
    return f"line {found.group(1) if found else 1}: {message}"


def _line_of(text: str, loc: Sequence[int | str]) -> int:
    """The 1-based line of the YAML node at `loc` (the deepest one that exists: a missing key's parent)."""
    node = yaml.compose(text, Loader=UniqueKeyLoader)  # the text already parsed: this cannot fail
    line = node.start_mark.line + 1 if node is not None else 1
    for key in loc:
        child = _child(node, key)
        if child is None:
            break
        node = child
        line = node.start_mark.line + 1
    return line


def _child(node: yaml.Node | None, key: int | str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        return next((value for name, value in node.value if name.value == str(key)), None)
    if isinstance(node, yaml.SequenceNode) and isinstance(key, int) and 0 <= key < len(node.value):
        child: yaml.Node = node.value[key]
        return child
    return None
