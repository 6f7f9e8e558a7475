"""The checkpoint gate: which recorded checkpoints a training job may resume from, and why others are refused.

A checkpoint counts only if its `checkpoint_saved` record exists (recovery knows checkpoints only by their
records), its step is consistent with the attempt that saved it, the versions it was trained with equal the
spec's (model, data, config, image), and its content still has the recorded digest. The digest is checked
by an adapter that reads the file (this module does no I/O): its verdict comes in as a `DigestVerdict`.
Records of one step (e.g. one shard per rank) stand or fall together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from lanes_contract.events import RefusedCheckpoint
from lanes_contract.jobs import JobSpec
from lanes_recovery.domain.knowledge import AttemptFacts, SavedCheckpoint

VERSION_FIELDS = ("model_version", "data_version", "config_version", "image")


@dataclass(frozen=True)
class DigestVerdict:
    """What the digest check found for one checkpoint record."""

    checked: bool
    """False: the path is not a local file (e.g. s3://): the record's digest is trusted, not recomputed."""
    matches: bool = True
    found: str | None = None
    """The digest computed (or why none could be: missing file, unsupported algorithm)."""


NOT_CHECKED = DigestVerdict(checked=False)


@dataclass(frozen=True)
class Verified:
    """The outcome of the gate: usable steps newest first, and the refused records with their field."""

    usable: tuple[SavedCheckpoint, ...]
    refused: tuple[RefusedCheckpoint, ...]

    @property
    def had_checkpoints(self) -> bool:
        """Whether the job recorded any checkpoint at all (usable or not)."""
        return bool(self.usable or self.refused)


def digest_key(checkpoint: SavedCheckpoint) -> tuple[str, str]:
    """How digest verdicts are looked up: by path and recorded digest."""
    return checkpoint.path, checkpoint.digest


def verify_checkpoints(
    checkpoints: Sequence[SavedCheckpoint],
    spec: JobSpec,
    attempts: Mapping[int, AttemptFacts],
    digests: Mapping[tuple[str, str], DigestVerdict],
    *,
    unrecorded_versions: Literal["refuse", "accept"] = "refuse",
) -> Verified:
    """Check every checkpoint record; a step is usable when all its records pass."""
    by_step: dict[int, list[SavedCheckpoint]] = {}
    for checkpoint in checkpoints:
        by_step.setdefault(checkpoint.step, []).append(checkpoint)
    usable: list[SavedCheckpoint] = []
    refused: list[RefusedCheckpoint] = []
    for step in sorted(by_step, reverse=True):
        records = sorted(by_step[step], key=lambda c: (-c.attempt, c.rank or 0))
        problems = [
            problem
            for record in records
            if (problem := _refusal(record, spec, attempts, digests, unrecorded_versions)) is not None
        ]
        if problems:
            refused.extend(problems)
        else:
            usable.append(records[0])
    return Verified(tuple(usable), tuple(refused))


def _refusal(
    checkpoint: SavedCheckpoint,
    spec: JobSpec,
    attempts: Mapping[int, AttemptFacts],
    digests: Mapping[tuple[str, str], DigestVerdict],
    unrecorded_versions: Literal["refuse", "accept"],
) -> RefusedCheckpoint | None:
    ref = checkpoint.ref()
    facts = attempts.get(checkpoint.attempt)
    if facts is not None and facts.resumed_from is not None and checkpoint.step < facts.resumed_from:
        # An attempt that started from step N cannot have saved an earlier step: the record is not the
        # checkpoint it says it is. (Heartbeats are too sparse to bound a step from above.)
        return RefusedCheckpoint(
            checkpoint=ref, field="step", expected=f">= {facts.resumed_from}", found=str(checkpoint.step)
        )
    for field in VERSION_FIELDS:
        expected = getattr(spec, field)
        found = getattr(checkpoint, field)
        if expected is None or found == expected:
            continue
        if found is None and unrecorded_versions == "accept":
            continue
        return RefusedCheckpoint(checkpoint=ref, field=field, expected=expected, found=found)
    verdict = digests.get(digest_key(checkpoint), NOT_CHECKED)
    if verdict.checked and not verdict.matches:
        return RefusedCheckpoint(checkpoint=ref, field="digest", expected=checkpoint.digest, found=verdict.found)
    return None
