"""The acknowledgement policy of the consumer runtime, as one pure function.

The message loop classifies what happened to a delivery (an `Outcome`) and carries out what `decide`
returns; it makes no acknowledgement choice of its own. The rules, in one place:

- processed or a duplicate: ack.
- a message that is itself bad (undecodable, or a handler that says the event can never apply): term, at
  once, with the reason (the loop dead-letters it first).
- a handler failure that may pass (a conflict, a bug fixed by a deploy): nak with the redelivery schedule's
  delay; on the last allowed delivery, term with the last error instead of letting JetStream drop it.
- the infrastructure is unavailable (database, bus or cache unreachable, a timeout): hold. The message is
  kept, marked in progress so its ack timer restarts, and the whole batch is tried again after a backoff.
  A hold never spends a delivery and never dead-letters, however long the outage lasts: an outage says
  nothing about the event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lanes_runtime.consumer import ConsumerSpec


@dataclass(frozen=True)
class Processed:
    """The handler ran and its effects committed."""


@dataclass(frozen=True)
class Duplicate:
    """The event was already recorded as processed by this consumer; the handler was skipped."""


@dataclass(frozen=True)
class Invalid:
    """The message itself is bad: it cannot be decoded, or its handler refused it for good."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """The handler failed in a way that may pass; `delay_s` is the handler's own hint, if any."""

    reason: str
    delay_s: float | None = None


@dataclass(frozen=True)
class Unavailable:
    """A server the consumer depends on did not answer; `outages` counts consecutive failed tries."""

    reason: str
    outages: int = 1


Outcome = Processed | Duplicate | Invalid | Failed | Unavailable


@dataclass(frozen=True)
class Ack:
    """Done: acknowledge."""


@dataclass(frozen=True)
class Nak:
    """Redeliver after `delay_s` (spends one delivery)."""

    delay_s: float


@dataclass(frozen=True)
class Term:
    """Dead-letter with `reason`, then terminate the message."""

    reason: str


@dataclass(frozen=True)
class Hold:
    """Keep the message in progress and try the batch again after `delay_s` (spends no delivery)."""

    delay_s: float


Decision = Ack | Nak | Term | Hold

OUTAGE_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
"""Pauses between tries while a server is unavailable; the last one repeats for as long as it lasts."""


def decide(outcome: Outcome, deliveries: int, spec: ConsumerSpec) -> Decision:
    """What to do with a delivery after `outcome`, on its `deliveries`-th delivery (1 = first)."""
    match outcome:
        case Processed() | Duplicate():
            return Ack()
        case Invalid(reason):
            return Term(reason)
        case Failed(reason, delay_s):
            if deliveries >= spec.max_deliver:
                return Term(f"gave up after {deliveries} deliveries; last error: {reason}")
            return Nak(delay_s if delay_s is not None else spec.delay_after(deliveries))
        case Unavailable(_, outages):
            return Hold(OUTAGE_BACKOFF_S[min(max(outages, 1), len(OUTAGE_BACKOFF_S)) - 1])
