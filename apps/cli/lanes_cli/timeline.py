"""Reading the timeline back from JetStream, with an ephemeral consumer that leaves nothing behind."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from lanes_console import rows as console_rows
from lanes_contract.codec import decode, format_time
from lanes_contract.errors import DecodeError
from lanes_contract.events import Event, JobStateChanged
from lanes_contract.signing import SIGNER_HEADER, Keyring, SignatureError, verified_signer
from lanes_contract.streams import JOBS
from lanes_runtime.reader import Selection, iter_stream

# Pure row readers shared with the console (which builds the same incident bundle): one definition of each.
row_kind = console_rows.row_kind
is_failure = console_rows.ended_in_failure


@dataclass(frozen=True)
class Signature:
    """Who signed a stored event, as its `Lanes-Signer` header says, and what a keyring made of that.

    The timeline names the signer next to the `source` the event claims: anyone can write any `ce-source`,
    only the holder of a key can sign. `refused` is the keyring's reason (`verified_signer`) when it does
    not confirm the signer; `checked` is False when no keyring was at hand (the header is then only a claim).
    """

    signer: str | None = None
    checked: bool = False
    refused: str | None = None

    @property
    def verdict(self) -> str:
        """`verified`, `unchecked`, `unsigned`, or `refused: <why>` (the `signature` of a JSON row)."""
        if self.signer is None:
            return "unsigned"
        if not self.checked:
            return "unchecked"
        return f"refused: {self.refused}" if self.refused else "verified"

    @property
    def label(self) -> str:
        """The `signer=` of a text row: the identity alone when verified, else what keeps it from being trusted."""
        if self.signer is None:
            return "unsigned"
        return self.signer if self.verdict == "verified" else f"{self.signer}({self.verdict})"


def signature_of(subject: str, headers: Mapping[str, str] | None, payload: bytes, keyring: Keyring | None) -> Signature:
    """The signer a stored message names, checked against the keyring when there is one (pure)."""
    reference = (headers or {}).get(SIGNER_HEADER)
    if not reference:
        return Signature()
    signer = reference.split(":", 1)[0]
    if keyring is None:
        return Signature(signer)
    try:
        verified_signer(subject, headers, payload, keyring)
    except SignatureError as exc:
        return Signature(signer, checked=True, refused=str(exc))
    return Signature(signer, checked=True)


@dataclass(frozen=True)
class TimelineEntry:
    """One stored event and its stream sequence, or the reason it could not be decoded, and who signed it."""

    seq: int
    subject: str
    event: Event | None
    error: str | None = None
    signature: Signature = field(default_factory=Signature)

    def as_json(self) -> dict[str, Any]:
        """The row of `lanes demo --json` / `lanes timeline --json`."""
        if self.event is None:
            return {"seq": self.seq, "subject": self.subject, "type": None, "error": self.error}
        e = self.event
        return {
            "seq": self.seq,
            "id": e.id,
            "time": format_time(e.time),
            "type": e.type,
            "lane": e.lane.value,
            "job_id": e.jobid,
            "attempt": e.attempt,
            "node": e.node,
            "rank": e.rank,
            "source": e.source,
            "signer": self.signature.signer,
            "signature": self.signature.verdict,
            "data": e.model_dump(mode="json")["data"],
        }


def entry_of(msg: Msg, keyring: Keyring | None = None) -> TimelineEntry:
    """A stored message as a timeline entry with its signer; an undecodable one keeps its place with its error."""
    seq = msg.metadata.sequence.stream
    signature = signature_of(msg.subject, msg.headers, msg.data, keyring)
    try:
        return TimelineEntry(seq, msg.subject, decode(msg.subject, msg.headers, msg.data), signature=signature)
    except DecodeError as exc:
        return TimelineEntry(seq, msg.subject, None, str(exc), signature)


def job_header(job_id: str, entries: list[TimelineEntry]) -> dict[str, Any]:
    """The job's state and its attempts' states as the timeline's own transitions say (no projection needed).

    The last `state_changed` of the job is its state; the last one of each attempt is that attempt's.
    """
    state: str | None = None
    attempts: dict[int, str] = {}
    for entry in entries:
        if isinstance(entry.event, JobStateChanged):
            state = entry.event.data.to_state.value
            if entry.event.attempt is not None:
                attempts[entry.event.attempt] = state
    return {
        "job_id": job_id,
        "state": state,
        "attempts": [{"number": number, "state": attempts[number]} for number in sorted(attempts)],
    }


async def read_stream(
    js: JetStreamContext, selection: Selection, keyring: Keyring | None = None
) -> list[TimelineEntry]:
    """Every selected message, decoded, in stream order, its signer checked against `keyring` if given."""
    return [entry_of(msg, keyring) async for msg in iter_stream(js, selection)]


async def job_timeline(js: JetStreamContext, job_id: str, keyring: Keyring | None = None) -> list[TimelineEntry]:
    """The job's whole timeline: every event on `lanes.job.<job_id>.>`."""
    return await read_stream(js, Selection(JOBS.name, f"lanes.job.{job_id}.>"), keyring)
