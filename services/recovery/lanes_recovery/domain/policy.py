"""Recovery policies: declarative, versioned rules per workload class, keyed on the first error's lane and category.

A policy is data (YAML, see `lanes_recovery/policies/default.yaml` and docs/recovery.md), validated here at
load: every workload class has rules, every rule's action makes sense for its class, and each class ends
with a catch-all rule, so any finding (or none) maps to exactly one rule: the first that matches.
"""

from __future__ import annotations

from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lanes_contract.events import Lane, RecoveryAction
from lanes_contract.jobs import WorkloadClass

ANY: Literal["*"] = "*"
NO_FINDING = "unknown"
"""The category recovery assumes (lane platform) for a failed attempt no finding explained in time."""
NEVER_PLACED = "never_placed"
"""The category (lane platform) of an attempt that failed before it was placed, e.g. rejected."""
NO_NODE_EVIDENCE = frozenset({"process_exited", "unexplained_exit", "collective_hang", NO_FINDING, NEVER_PLACED})
"""First errors that say nothing about their node's host or network, whatever their lane: an exit status or a
signal alone (the kernel line that would say who sent it never came), an exit nothing explains, a hang in
which every rank waited. A rule's `cordon` never applies to them."""

ACTIONS_OF_CLASS: dict[WorkloadClass, frozenset[RecoveryAction]] = {
    WorkloadClass.TRAINING: frozenset({RecoveryAction.RESUME, RecoveryAction.MANUAL}),
    WorkloadClass.INFERENCE: frozenset({RecoveryAction.REPLACE_REPLICA, RecoveryAction.MANUAL}),
    WorkloadClass.EVALUATION: frozenset({RecoveryAction.REBUILD, RecoveryAction.MANUAL}),
    WorkloadClass.BATCH: frozenset({RecoveryAction.REBUILD, RecoveryAction.MANUAL}),
}
"""What a policy may do for each class: only training has checkpoints to resume from."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Backoff(_Model):
    """How long the n-th automatic retry waits after its decision: base x factor^(retries so far), capped."""

    base_s: float = Field(default=0.0, ge=0, le=86_400)
    factor: float = Field(default=2.0, ge=1, le=10)
    max_s: float = Field(default=600.0, ge=0, le=86_400)

    def delay_s(self, retries_used: int) -> float:
        """The wait before the retry that follows `retries_used` earlier retries."""
        return float(min(self.base_s * self.factor**retries_used, self.max_s))


class CordonBudget(_Model):
    """At most `max_nodes` nodes cordoned by recovery within `window_s` without a person's approval.

    Whatever a rule says, recovery never empties the cluster on its own: a decision that would cordon one
    node more waits for its owner instead (the manual path), and its reason says the budget is spent.
    """

    max_nodes: int = Field(default=3, ge=0, le=10_000)
    window_s: float = Field(default=3600.0, gt=0, le=30 * 86_400)


class Slowdowns(_Model):
    """What recovery does about a running training attempt that telemetry found slow (a straggler, a slow link).

    It restarts the attempt from its last verified checkpoint, away from the slow node, only when the time the
    slowness would still cost (the slowdown times the steps left) is more than the restart's: `restart_cost_s`
    (stopping, placing again, loading) plus the steps redone since the checkpoint.
    """

    restart: bool = Field(default=True, description="False: a slowdown is recorded and never restarts anything.")
    restart_cost_s: float = Field(default=300.0, ge=0, le=86_400)


class Limits(_Model):
    """The knobs a rule inherits from the policy's defaults unless it sets its own."""

    max_retries: int | None = Field(default=None, ge=0, le=100)
    backoff: Backoff | None = None
    crash_loop_count: int | None = Field(
        default=None, ge=2, le=100, description="The same first error on the same node or checkpoint this often stops."
    )
    manual_deadline_s: float | None = Field(default=None, gt=0, le=30 * 86_400)


class Defaults(_Model):
    """Policy-wide settings."""

    max_retries: int = Field(default=3, ge=0, le=100)
    backoff: Backoff = Backoff()
    crash_loop_count: int = Field(default=3, ge=2, le=100)
    manual_deadline_s: float = Field(default=3600.0, gt=0, le=30 * 86_400)
    finding_grace_s: float = Field(
        default=60.0, ge=0, le=86_400, description="How long a failed attempt waits for a finding naming a first error."
    )
    decide_within_s: float = Field(
        default=86_400.0,
        gt=0,
        description="A failure older than this when recovery first sees it (a replayed log) gets no decision.",
    )
    checkpoint_roots: tuple[str, ...] = Field(
        default=(),
        description="The only directories checkpoint digests read under (none named: any local path).",
    )
    digest_max_bytes: int = Field(default=64 << 30, ge=1, description="A checkpoint larger than this is unverified.")
    digest_timeout_s: float = Field(
        default=60.0, gt=0, le=3600, description="A checkpoint not hashed within this is unverified."
    )
    cordon_budget: CordonBudget = Field(
        default=CordonBudget(), description="How many nodes recovery may cordon in a window without a person."
    )
    unrecorded_versions: Literal["refuse", "accept"] = Field(
        default="refuse", description="A checkpoint that does not record a version the spec sets: refuse or accept it."
    )
    slowdowns: Slowdowns = Slowdowns()


class Match(_Model):
    """Which first errors a rule applies to; `*` matches any."""

    lane: Lane | Literal["*"] = ANY
    category: str = Field(default=ANY, min_length=1)

    @property
    def catches_all(self) -> bool:
        """Whether the rule matches every first error."""
        return self.lane == ANY and self.category == ANY

    def matches(self, lane: Lane, category: str) -> bool:
        """Whether a first error of `lane`/`category` falls under this rule."""
        return self.lane in {ANY, lane} and self.category in {ANY, category}


class Rule(Limits):
    """What to do for the first errors a rule matches."""

    match: Match = Match()
    action: RecoveryAction
    cordon: bool = Field(default=False, description="Cordon the first error's node before the next attempt.")
    owner_lane: Lane | None = Field(default=None, description="Whose decision this is; default the first error's lane.")
    why: str = Field(default="", description="The rule's rationale, quoted in each decision it makes.")


class ClassPolicy(_Model):
    """The ordered rules of one workload class: the first rule that matches decides."""

    rules: tuple[Rule, ...] = Field(min_length=1)


class Effective(_Model):
    """A rule's limits with the policy defaults filled in."""

    max_retries: int
    backoff: Backoff
    crash_loop_count: int
    manual_deadline_s: float


class Policy(_Model):
    """A named, versioned recovery policy."""

    name: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=1)
    description: str = ""
    defaults: Defaults = Defaults()
    classes: dict[WorkloadClass, ClassPolicy]

    @model_validator(mode="after")
    def _complete_and_consistent(self) -> Policy:
        missing = [c.value for c in WorkloadClass if c not in self.classes]
        if missing:
            msg = f"policy {self.name} v{self.version} has no rules for: {', '.join(missing)}"
            raise ValueError(msg)
        for workload_class, rules in self.classes.items():
            for index, rule in enumerate(rules.rules):
                if rule.action not in ACTIONS_OF_CLASS[workload_class]:
                    allowed = ", ".join(sorted(a.value for a in ACTIONS_OF_CLASS[workload_class]))
                    msg = f"{workload_class} rule {index + 1}: action {rule.action} is not one of {allowed}"
                    raise ValueError(msg)
            if not rules.rules[-1].match.catches_all:
                msg = f"{workload_class}: the last rule must match every lane and category (lane '*', category '*')"
                raise ValueError(msg)
        return self

    def rule_for(self, workload_class: WorkloadClass, lane: Lane, category: str) -> tuple[int, Rule]:
        """The first rule of the class that matches, with its 1-based position (the catch-all always does)."""
        rules = self.classes[workload_class].rules
        return next((i + 1, r) for i, r in enumerate(rules) if r.match.matches(lane, category))

    def limits(self, rule: Rule) -> Effective:
        """The rule's limits, its own where it sets them, else the policy's defaults."""
        d = self.defaults
        return Effective(
            max_retries=d.max_retries if rule.max_retries is None else rule.max_retries,
            backoff=rule.backoff or d.backoff,
            crash_loop_count=rule.crash_loop_count or d.crash_loop_count,
            manual_deadline_s=rule.manual_deadline_s or d.manual_deadline_s,
        )


class PolicyError(ValueError):
    """A policy document that is not valid YAML or does not validate."""


def parse_policy(text: str, *, origin: str = "policy") -> Policy:
    """Validate a YAML policy document; raise PolicyError naming what is wrong."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        msg = f"{origin}: not valid YAML: {exc}"
        raise PolicyError(msg) from exc
    try:
        return Policy.model_validate(document)
    except ValueError as exc:
        msg = f"{origin}: {exc}"
        raise PolicyError(msg) from exc
