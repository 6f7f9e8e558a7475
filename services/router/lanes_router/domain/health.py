"""Passive and active health: which failures count against a replica, and how long the penalty box holds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Outcome = Literal["ok", "error", "timeout", "refused", "slow_first_token", "failed_mid_stream", "client_closed"]
"""How one try of a request on one replica ended (as `RequestAttempt.outcome` records it)."""

RETRYABLE_BEFORE_FIRST_BYTE = frozenset({"error", "timeout", "refused", "slow_first_token"})
"""Outcomes after which nothing reached the client, so another replica may take the request."""


@dataclass(frozen=True, slots=True)
class PenaltyPolicy:
    """When passive failures eject a replica, and the back-off before it is probed again."""

    failures_to_eject: int = 2
    """Consecutive failed tries (all routers together) that put a ready replica in the penalty box."""
    base_s: float = 1.0
    max_s: float = 30.0

    def penalty_s(self, failures: int) -> float:
        """Exponential back-off on consecutive failures, capped: 1 s, 2 s, 4 s... at most `max_s`."""
        exponent = max(0, failures - self.failures_to_eject)
        return min(self.max_s, self.base_s * 2.0**exponent)

    def ejects(self, outcome: Outcome, failures: int) -> bool:
        """Whether this failure takes the replica out of rotation.

        A refused connection means no process is listening: out at once. Errors, timeouts and slow first
        tokens may be one bad request, so they count until `failures_to_eject` in a row.
        """
        if outcome == "refused":
            return True
        return failures >= self.failures_to_eject


def counts_against_replica(outcome: Outcome, http_status: int | None) -> bool:
    """Whether a try's outcome is a passive health signal (a busy 429/503 or a closed client is not)."""
    if outcome in {"ok", "client_closed"}:
        return False
    return http_status not in {429, 503}
