"""First-error accuracy on the labelled corpus of real-world log formats, against torchelastic's own Root Cause.

    uv run python bench/accuracy.py [CORPUS_DIR]

Every directory of tests/data/logs holding a `label.toml` (lane, rank or "none", node, category, reason, and
optionally the log family it belongs to) is one case: its logs go through exactly what `lanes analyze` does
(`load_evidence`, `elect_first_error`).
A case is right on the lane when the elected lane is the labelled one, right on the rank when the label
names a rank and the elected rank is it (cases labelled "none" do not count for the rank: their log cannot
say). The calibration table groups cases by the finding's confidence: a higher bucket must be at least as
accurate as a lower one ("right" there means lane right and, where labelled, rank right).

Tuned and held out: a case whose directory starts with `heldout_` was written and labelled before the rules
were changed for its family and never tuned on; the figures are given for each part, overall and per family
(a case without a `family` in its label counts under "earlier corpus").

Baseline: wherever a case's log has torchelastic's ChildFailedError summary, its "Root Cause (first observed
failure)" entry is what users already have: its rank, and the lane a reader gives it (a death by signal:
host; an exit with an error: the job's code). The same figures are printed for it and for Lanes on those
cases. The last line of stdout is one JSON object.

Flight Recorder drills: each directory of tests/data/flight_recorder with a `label.toml` (the hung rank and the
collective it never entered) holds real per-rank dumps. With every dump, the elected rank must be the labelled
one; with each rank's dump deleted in turn, the finding must name that rank's dump as missing and the collective
it would settle.
"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lanes_cli.analyze_cli import load_evidence
from lanes_contract.events import Lane
from lanes_evidence.evidence import Evidence
from lanes_telemetry.views import elect_first_error

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "logs"
DRILLS = CORPUS.parent / "flight_recorder"
BUCKETS = ((0.0, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 1.01))
_ROOT_CAUSE = "torchelastic root cause"
HELD_OUT = "heldout_"
EARLIER = "earlier corpus"


@dataclass(frozen=True)
class Outcome:
    """One case: what the label says, what Lanes elected, what torchelastic's Root Cause said."""

    case: str
    family: str
    lane: str
    rank: int | None
    got_lane: str | None
    got_rank: int | None
    confidence: float
    summary: str
    baseline: tuple[str, int | None] | None

    @property
    def split(self) -> str:
        """Which part of the corpus the case is in: "heldout" (never tuned on) or "tuned"."""
        return "heldout" if self.case.startswith(HELD_OUT) else "tuned"

    @property
    def lane_right(self) -> bool:
        """The elected lane is the labelled one."""
        return self.got_lane == self.lane

    @property
    def rank_right(self) -> bool:
        """The label names a rank and the elected rank is it."""
        return self.rank is not None and self.got_rank == self.rank

    @property
    def right(self) -> bool:
        """Lane right and, where the label names a rank, rank right."""
        return self.lane_right and (self.rank is None or self.rank_right)


def _baseline(evidence: list[Evidence]) -> tuple[str, int | None] | None:
    roots = [e for e in evidence if e.data.summary.startswith(_ROOT_CAUSE)]
    if not roots:
        return None
    root = roots[0]
    return (Lane.HOST if root.data.signal is not None else Lane.ALGORITHM).value, root.rank


def run_case(directory: Path) -> Outcome:
    """Analyse one case as `lanes analyze DIR` does."""
    label = tomllib.loads((directory / "label.toml").read_text())
    rank = label["rank"] if isinstance(label["rank"], int) else None
    evidence, world = load_evidence([directory])
    finding = elect_first_error(evidence, world=world)
    first = finding.first_error
    return Outcome(
        case=directory.name,
        family=str(label.get("family", EARLIER)),
        lane=label["lane"],
        rank=rank,
        got_lane=first.lane.value if first else None,
        got_rank=first.rank if first else None,
        confidence=finding.confidence,
        summary=first.summary if first else "no first error",
        baseline=_baseline(evidence),
    )


def _ratio(right: int, total: int) -> float | None:
    return round(right / total, 3) if total else None


def _figures(outcomes: list[Outcome], answer: Any) -> dict[str, Any]:
    ranked = [o for o in outcomes if o.rank is not None]
    lanes = sum(answer(o)[0] == o.lane for o in outcomes)
    ranks = sum(answer(o)[1] == o.rank for o in ranked)
    return {
        "cases": len(outcomes),
        "lane_accuracy": _ratio(lanes, len(outcomes)),
        "rank_cases": len(ranked),
        "rank_accuracy": _ratio(ranks, len(ranked)),
    }


def calibration(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Accuracy per confidence bucket, lowest bucket first (empty buckets left out)."""
    table = []
    for low, high in BUCKETS:
        inside = [o for o in outcomes if low <= o.confidence < high]
        if inside:
            table.append(
                {
                    "bucket": f"{low:.1f}-{min(high, 1.0):.1f}",
                    "count": len(inside),
                    "accuracy": _ratio(sum(o.right for o in inside), len(inside)),
                }
            )
    return table


def _lanes_figures(outcomes: list[Outcome]) -> dict[str, Any]:
    return _figures(outcomes, lambda o: (o.got_lane, o.got_rank))


def by_split(outcomes: list[Outcome]) -> dict[str, Any]:
    """Lane and rank accuracy on the tuned and the held-out parts, overall and per family."""
    splits = ("tuned", "heldout")
    families = sorted({o.family for o in outcomes})
    return {
        "overall": {split: _lanes_figures([o for o in outcomes if o.split == split]) for split in splits},
        "families": {
            family: {
                split: _lanes_figures([o for o in outcomes if o.family == family and o.split == split])
                for split in splits
            }
            | {"all": _lanes_figures([o for o in outcomes if o.family == family])}
            for family in families
        },
    }


def report(corpus: Path) -> dict[str, Any]:
    """The whole corpus: accuracy, calibration, misses, and the torchelastic baseline beside."""
    cases = sorted(p.parent for p in corpus.glob("*/label.toml"))
    outcomes = [run_case(case) for case in cases]
    ours = _figures(outcomes, lambda o: (o.got_lane, o.got_rank))
    table = calibration(outcomes)
    accuracies = [row["accuracy"] for row in table]
    with_summary = [o for o in outcomes if o.baseline is not None]
    baseline = _figures(with_summary, lambda o: o.baseline)
    lanes_there = _figures(with_summary, lambda o: (o.got_lane, o.got_rank))
    lanes_count: dict[str, int] = {}
    for o in outcomes:
        lanes_count[o.lane] = lanes_count.get(o.lane, 0) + 1
    return {
        "cases": len(outcomes),
        "cases_by_lane": dict(sorted(lanes_count.items())),
        "lane_accuracy": ours["lane_accuracy"],
        "rank_cases": ours["rank_cases"],
        "rank_accuracy": ours["rank_accuracy"],
        "by_split": by_split(outcomes),
        "calibration": table,
        "calibration_monotone": all(a <= b for a, b in itertools.pairwise(accuracies)),
        "torchelastic_baseline": {
            "cases": baseline["cases"],
            "root_cause_lane_accuracy": baseline["lane_accuracy"],
            "root_cause_rank_accuracy": baseline["rank_accuracy"],
            "lanes_lane_accuracy": lanes_there["lane_accuracy"],
            "lanes_rank_accuracy": lanes_there["rank_accuracy"],
            "rank_cases": baseline["rank_cases"],
        },
        "misses": [
            {
                "case": o.case,
                "family": o.family,
                "split": o.split,
                "expected": {"lane": o.lane, "rank": o.rank},
                "got": {"lane": o.got_lane, "rank": o.got_rank},
                "confidence": o.confidence,
                "summary": o.summary,
            }
            for o in outcomes
            if not o.lane_right or (o.rank is not None and not o.rank_right)
        ],
    }


def _missing_named(dumps: list[Path], deleted: Path, rank: int, seq: int) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        for dump in dumps:
            if dump != deleted:
                shutil.copy(dump, Path(tmp) / dump.name)
        evidence, world = load_evidence([Path(tmp)])
    pending = elect_first_error(evidence, world=world).missing_evidence  # as `lanes analyze` reports it
    said = (
        f"rank {rank}'s Flight Recorder dump is missing: it would settle whether rank {rank} entered collective {seq}"
    )
    return any(p.rank == rank and p.what.startswith(said) for p in pending)


def flight_recorder_drills(root: Path = DRILLS) -> dict[str, Any]:
    """All dumps present: is the hung rank elected? One dump deleted (each in turn): is it named missing?"""
    present: list[bool] = []
    deleted: list[bool] = []
    misses: list[str] = []
    for label_path in sorted(root.glob("*/label.toml")):
        drill = label_path.parent
        label = tomllib.loads(label_path.read_text())
        dumps = sorted(p for p in drill.iterdir() if p.suffix not in {".toml", ".md"})
        evidence, world = load_evidence([drill])
        first = elect_first_error(evidence, world=world).first_error
        present.append(first is not None and first.rank == label["rank"])
        if not present[-1]:
            misses.append(f"{drill.name}: elected rank {first.rank if first else None}, not {label['rank']}")
        for dump in dumps:
            rank = int("".join(ch for ch in dump.stem if ch.isdigit()) or -1)
            deleted.append(_missing_named(dumps, dump, rank, label["seq"]))
            if not deleted[-1]:
                misses.append(f"{drill.name} without {dump.name}: rank {rank}'s dump not named missing")
    return {
        "all_dumps_present": {"drills": len(present), "rank_accuracy": _ratio(sum(present), len(present))},
        "one_dump_deleted": {"drills": len(deleted), "missing_named": _ratio(sum(deleted), len(deleted))},
        "misses": misses,
    }


def main() -> None:
    """Print the report as one JSON object."""
    corpus = Path(sys.argv[1]) if len(sys.argv) > 1 else CORPUS
    print(json.dumps(report(corpus) | {"flight_recorder_drills": flight_recorder_drills()}, indent=2))


if __name__ == "__main__":
    main()
