"""Did recovery act on the truth? Each decision's culprit against its attempt's final settled finding.

Read from timeline rows alone (like `lanes poc` and `lanes incident`): the decisions in force (an owner's
manual action aside, a decision superseded by a re-plan is no longer in force), the final finding of the
attempt (its highest version), and whether the two blame the same lane, node and rank. A decision whose
mismatch was escalated is still a mismatch: it is reported, with the escalation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lanes_console.rows import row_kind

Row = dict[str, Any]


@dataclass(frozen=True)
class DecisionVerdict:
    """One decision in force, the finding it used, the attempt's final finding, and whether they agree."""

    job_id: str
    attempt: int
    decision_id: str
    decided_on: str
    """The culprit as the decision named it, with the finding version it used."""
    final: str
    """The final finding's culprit, its version and whether it is settled."""
    agrees: bool
    escalated: bool

    def explain(self) -> str:
        """Why, by name: "decided on node-1 at v1; the settled finding names node-3" (or that they agree)."""
        if self.agrees:
            return f"{self.job_id} attempt {self.attempt}: decided on {self.decided_on}; the final finding agrees"
        told = " (escalated to the lane's owner)" if self.escalated else ""
        return f"{self.job_id} attempt {self.attempt}: decided on {self.decided_on}; {self.final}{told}"

    def as_json(self) -> dict[str, Any]:
        """The verdict as `lanes incident` and `lanes demo --json` print it."""
        return {
            "decision_id": self.decision_id,
            "attempt": self.attempt,
            "decided_on": self.decided_on,
            "final": self.final,
            "agrees": self.agrees,
            "escalated": self.escalated,
        }


def _named(culprit: dict[str, Any] | None) -> str:
    if not culprit:
        return "no culprit"
    where = " ".join(
        part
        for part in (culprit.get("node") or "", f"rank {culprit['rank']}" if culprit.get("rank") is not None else "")
        if part
    )
    label = f"{culprit.get('lane')}/{culprit.get('category')}"
    return f"{label} on {where}" if where else label


def _same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if not a or not b:
        return not a and not b
    if (a.get("lane"), a.get("node")) != (b.get("lane"), b.get("node")):
        return False
    return a.get("rank") is None or b.get("rank") is None or a.get("rank") == b.get("rank")


def _finding_culprit(data: dict[str, Any]) -> dict[str, Any] | None:
    first = data.get("first_error")
    if not first:
        return None
    return {key: first.get(key) for key in ("lane", "category", "node", "rank")}


def decision_verdicts(rows: Iterable[Row]) -> list[DecisionVerdict]:
    """A verdict for every policy decision in force on these timeline rows (any number of jobs)."""
    rows = list(rows)
    replaced: set[str] = set()
    escalated: set[str] = set()
    for row in rows:
        if row_kind(row) == "recovery_superseded":
            data = row.get("data") or {}
            (replaced if data.get("replanned") else escalated).add(str(data.get("decision_id")))
    finals: dict[tuple[str, int], Row] = {}
    for row in rows:
        if row_kind(row) != "finding":
            continue
        key = (str(row.get("job_id")), int(row.get("attempt") or 1))
        version = int((row.get("data") or {}).get("version") or 0)
        if key not in finals or version > int((finals[key].get("data") or {}).get("version") or 0):
            finals[key] = row
    verdicts = []
    for row in rows:
        data = row.get("data") or {}
        if row_kind(row) != "recovery_decided" or data.get("manual_action") or row["id"] in replaced:
            continue
        key = (str(row.get("job_id")), int(row.get("attempt") or 1))
        final_data = (finals.get(key) or {}).get("data") or {}
        culprit = data.get("culprit")
        final_culprit = _finding_culprit(final_data)
        used = data.get("finding_version")
        decided_on = _named(culprit) + (f" at v{used}" if used else "")
        if final_data:
            settled = "settled " if final_data.get("settled") else "unsettled "
            final = f"the {settled}finding v{final_data.get('version')} names {_named(final_culprit)}"
        else:
            final = "no finding names a first error"
        unknown = culprit is not None and culprit.get("lane") == "platform" and culprit.get("node") is None
        agrees = (_same(culprit, final_culprit) or (unknown and final_culprit is None)) and (
            not final_data or bool(final_data.get("settled"))
        )
        verdicts.append(DecisionVerdict(key[0], key[1], row["id"], decided_on, final, agrees, row["id"] in escalated))
    return verdicts
