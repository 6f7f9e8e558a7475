"""Admitting a wrong decision: a later, settled finding that moves the culprit supersedes it. Pure.

Recovery decides on a settled finding, or on whatever it has when its grace runs out. Evidence can still
arrive after that (a kernel log minutes late), and telemetry then publishes a later finding. When that
finding is settled and blames another lane, node or rank than the decision did:

- if the retry (or the manual hold) the decision owes is still owed, the next attempt is not placed yet: the
  decision is superseded and re-planned (uncordon the wrongly cordoned node, cordon the right one, a new
  decision on the new finding);
- otherwise the next attempt may already run on the wrong nodes: the mismatch is escalated to the owner of
  the culprit's lane (again each time a later settled finding moves it once more). Never silent.

A finding that names the same node but now with evidence about it (v1: rank 2 killed by SIGKILL, no kernel
line, so no cordon; v2: the kernel's OOM kill) supersedes the decision the same way: the evidence a cordon
needs has arrived.
"""

from __future__ import annotations

from dataclasses import dataclass

from lanes_contract.events import Lane
from lanes_recovery.domain.knowledge import DecisionRecord, FindingSeen, FirstError, JobKnowledge
from lanes_recovery.domain.policy import NO_NODE_EVIDENCE


@dataclass(frozen=True)
class Supersession:
    """A decision the latest settled finding contradicts, and whether it can still be re-planned."""

    decision: DecisionRecord
    finding: FindingSeen
    culprit: FirstError
    replan: bool
    uncordon: tuple[str, ...]

    @property
    def decided_on(self) -> FirstError:
        """Whom the superseded decision blamed."""
        assert self.decision.culprit is not None  # noqa: S101 - only decisions that blamed someone are superseded
        return self.decision.culprit

    def reason(self, next_attempt: int) -> str:
        """Why, in one sentence: "decided on node-1 at v1; the settled finding v3 names node-3 ..."."""
        version = f" at v{self.decision.finding_version}" if self.decision.finding_version else ""
        said = (
            f"decided on {self.decided_on.named}{version}; the settled finding v{self.finding.version} names "
            f"{self.culprit.named}"
        )
        if self.replan:
            undo = f"; uncordon {', '.join(self.uncordon)}" if self.uncordon else ""
            return f"{said}{undo}; re-planned before attempt {next_attempt} was placed"
        return f"{said}; attempt {next_attempt} was already requested or placed: escalated to the lane's owner"


def in_force(known: JobKnowledge, attempt: int) -> DecisionRecord | None:
    """The policy decision in force for a failed attempt (not an owner's, not superseded)."""
    return next(
        (d for d in reversed(known.decisions) if d.attempt == attempt and not d.manual and d.superseded_by is None),
        None,
    )


def superseded(known: JobKnowledge) -> list[Supersession]:
    """The decisions whose attempt's latest settled finding blames someone else."""
    found = []
    for facts in sorted(known.attempts.values(), key=lambda a: a.number):
        latest = facts.latest
        if latest is None or not latest.settled or latest.first_error is None:
            continue
        decision = in_force(known, facts.number)
        if decision is None or decision.culprit is None:
            continue
        if decision.finding_version is not None and latest.version <= decision.finding_version:
            continue
        decided_on = decision.escalated or decision.culprit
        if not latest.first_error.blames_other_than(decided_on) and not _evidence_arrived(decided_on, latest):
            continue
        owed = (known.pending is not None and known.pending.decision_id == decision.id) or (
            known.manual is not None and known.manual.decision_id == decision.id and not known.manual.held
        )
        replan = owed and not known.attempt(facts.number + 1).placed
        uncordon = tuple(n for n in decision.cordoned if n != latest.first_error.node) if replan else ()
        found.append(Supersession(decision, latest, latest.first_error, replan, uncordon))
    return found


def _evidence_arrived(decided_on: FirstError, latest: FindingSeen) -> bool:
    """Whether the latest finding has host or network evidence about a node the decision had none about."""
    first = latest.first_error
    if first is None or first.node is None or first.lane not in {Lane.HOST, Lane.NETWORK}:
        return False
    return decided_on.category in NO_NODE_EVIDENCE and first.category not in NO_NODE_EVIDENCE
