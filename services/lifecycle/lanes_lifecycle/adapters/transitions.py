"""Per-job optimistic concurrency on JetStream for the lifecycle's state changes.

Every `lanes.job.<id>.state_changed` is published with `Nats-Expected-Last-Subject-Sequence` set to the
sequence of the job's previous state change, so the state changes of one job form a single chain on the
log: two writers that both decided a transition from the same state cannot both append it. The check is
made inside the handler's transaction, before it commits: a writer that loses the race rolls back its
projection too, and the event comes back (retryable) instead of leaving a projection the log contradicts.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import APIError

from lanes_contract.client import publish_encoded
from lanes_contract.codec import EVENT_ID_HEADER, encode
from lanes_contract.errors import TransientError
from lanes_contract.events import JobStateChanged
from lanes_contract.streams import JOBS

WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code when the expected last subject sequence does not match."""


class TransitionConflictError(TransientError):
    """Another writer appended a state change for this job since our view was loaded: retry from the log."""


async def publish_transition(js: JetStreamContext, changed: JobStateChanged, *, after_seq: int) -> int:
    """Append a state change only if the job's last one is at `after_seq` (0: none yet); return its sequence.

    A writer that died after publishing but before committing publishes the same event id again on
    redelivery, and so does a second lifecycle replica that decided the very same transition: JetStream
    checks the expected sequence before de-duplicating, so both cases are recognised by finding our own id
    as the job's state change right after `after_seq`, and its sequence is adopted.
    """
    subject = changed.nats_subject()
    try:
        published = await publish_encoded(
            js, encode(changed), stream=JOBS.name, expected_last_subject_seq=after_seq, expected_subject=subject
        )
    except APIError as exc:
        if exc.err_code != WRONG_LAST_SEQUENCE:
            raise
        following = await js.get_msg(JOBS.name, seq=after_seq + 1, subject=subject, next=True)
        if (following.headers or {}).get(EVENT_ID_HEADER) == changed.id:
            return int(following.seq or 0)
        msg = (
            f"job {changed.jobid}: another writer appended a different state change after sequence {after_seq} "
            f"(at {following.seq}); not applying {changed.data.from_state} -> {changed.data.to_state}"
        )
        raise TransitionConflictError(msg) from exc
    return published.seq
