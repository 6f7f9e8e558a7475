"""What an operator may do from the console (pure): the commands the CLI publishes, with who asked and why.

The same commands as `lanes cancel|hold|resume` and `lanes recover --approve|--rollback|--abandon`.

The console's own NATS identity only reads; an operator's action is published through a second connection,
as the identity the CLI uses, and only for a request that shows the operator token. Each action is an event
on the job's timeline with `requested_by` naming the person and the console.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lanes_contract.events import (
    CancelRequested,
    CommandData,
    Event,
    HoldRequested,
    HoldRequestedData,
    ManualAction,
    ManualActionData,
    ManualActionRequested,
    ResumeRequested,
    RetryData,
)

ACTIONS = ("cancel", "hold", "resume", "approve", "rollback", "abandon")
"""What a job page's operator may ask: a job command, or a decision on the manual recovery path."""
MANUAL = {"approve": ManualAction.APPROVE, "rollback": ManualAction.ROLLBACK, "abandon": ManualAction.ABANDON}
MAX_TEXT = 500


class BadActionError(ValueError):
    """The action asked for cannot be sent as it is; the message says why (HTTP 400)."""


def _text(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key, "")
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        msg = f"{key} must be text of at most {MAX_TEXT} characters"
        raise BadActionError(msg)
    return value.strip()


def command_of(action: str, job_id: str, body: Any, source: str) -> Event:
    """The event an operator's action publishes; `body` (a JSON object) gives `reason` and `by` (who)."""
    if not isinstance(body, dict):
        raise BadActionError("the body must be a JSON object: by, reason")
    if action not in ACTIONS:
        msg = f"unknown action {action[:40]!r}; the console's actions are {', '.join(ACTIONS)}"
        raise BadActionError(msg)
    reason, by = _text(body, "reason"), _text(body, "by")
    if not by:
        raise BadActionError("by is required: the timeline says who did it")
    requested_by = f"{by} (console)"
    if action in MANUAL:
        if not reason:
            raise BadActionError("reason is required: a recovery decision is audited with who and why")
        data = ManualActionData(action=MANUAL[action], reason=reason, requested_by=requested_by)
        return ManualActionRequested(source=source, jobid=job_id, data=data)
    if action == "cancel":
        return CancelRequested(source=source, jobid=job_id, data=CommandData(reason=reason, requested_by=requested_by))
    if action == "hold":
        return HoldRequested(
            source=source, jobid=job_id, data=HoldRequestedData(reason=reason, requested_by=requested_by, owner=by)
        )
    return ResumeRequested(source=source, jobid=job_id, data=RetryData(reason=reason, requested_by=requested_by))
