"""Request/reply endpoints on NATS for jobs: submit, cancel, retry, get.

Clients send JSON to `lanes.api.job.<operation>` and get one JSON reply: `{"ok": true, ...}` or
`{"ok": false, "error": "<kind>", "message": "..."}` with kind bad_input, not_found or unavailable, so a
client learns at the edge what is wrong and a malformed request never reaches the log. Commands are
published as events and decided by the lifecycle (a refused one shows up as `transition_rejected`);
`get` reads the lifecycle projection. Several processes may serve the endpoints: they share a queue group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lanes_contract.client import LanesClient
from lanes_contract.events import (
    CancelRequested,
    JobSubmitted,
    JobSubmittedData,
    RetryRequested,
)
from lanes_contract.ids import derived_event_id, new_event_id
from lanes_contract.jobs import JobSpec, Token
from lanes_contract.streams import JOBS
from lanes_lifecycle.adapters import repository as lifecycle_jobs
from lanes_runtime.reader import Selection, count

API_PREFIX = "lanes.api.job"
QUEUE = "lanes-job-api"
SOURCE = "lanes/api"
log = structlog.get_logger(__name__)


class ApiError(Exception):
    """A request the API refuses, with the kind of refusal a client can act on."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SubmitRequest(_Request):
    """A job spec, and optionally its id (submitting the same id again is a no-op)."""

    job_id: Token | None = None
    spec: JobSpec


class CommandRequest(_Request):
    """A command for an existing job; `attempt` names the attempt a retry is for (default: the current one)."""

    job_id: Token
    attempt: int | None = Field(default=None, ge=1)
    reason: str = ""
    requested_by: str = ""


class GetRequest(_Request):
    """Which job to show."""

    job_id: Token


class JobApi:
    """Serves `lanes.api.job.*` until stopped."""

    def __init__(self, nc: NatsClient, pool: asyncpg.Pool) -> None:
        self._nc = nc
        self._pool = pool
        self._client = LanesClient(nc, SOURCE)
        self._operations: dict[str, Callable[[bytes], Awaitable[dict[str, Any]]]] = {
            "submit": self.submit,
            "cancel": self.cancel,
            "retry": self.retry,
            "get": self.get,
        }

    @property
    def name(self) -> str:
        """The queue group the API's processes share."""
        return QUEUE

    async def provision(self) -> None:
        """Nothing to create: a core NATS queue subscription needs no server-side state."""

    async def run(self, stop: asyncio.Event) -> None:
        """Answer requests until `stop` is set."""
        sub = await self._nc.subscribe(f"{API_PREFIX}.*", queue=QUEUE, cb=self._on_request)
        log.info("job api serving", subjects=f"{API_PREFIX}.*")
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_request(self, msg: Msg) -> None:
        operation = self._operations.get(msg.subject.rsplit(".", 1)[-1], self._unknown)
        try:
            reply = {"ok": True} | await operation(msg.data)
        except ApiError as exc:
            reply = {"ok": False, "error": exc.kind, "message": str(exc)}
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in exc.errors())
            reply = {"ok": False, "error": "bad_input", "message": problems}
        except Exception as exc:  # noqa: BLE001 - a server-side failure is reported to the client, not raised
            log.warning("job api request failed", subject=msg.subject, error=str(exc))
            reply = {"ok": False, "error": "unavailable", "message": f"{type(exc).__name__}: {exc}"}
        if msg.reply:
            await msg.respond(json.dumps(reply).encode())

    async def _unknown(self, body: bytes) -> dict[str, Any]:
        del body
        raise ApiError("bad_input", f"unknown operation; use one of {', '.join(self._operations)}")

    async def submit(self, body: bytes) -> dict[str, Any]:
        """Publish a JobSubmitted; its id derives from the job id, so a resubmission is de-duplicated."""
        request = SubmitRequest.model_validate_json(body or b"{}")
        job_id = request.job_id or f"{request.spec.name}-{new_event_id()[-12:]}"
        event_id = derived_event_id(job_id, JobSubmitted.model_fields["type"].default)
        event = JobSubmitted(
            id=event_id, source=SOURCE, jobid=job_id, attempt=1, data=JobSubmittedData(spec=request.spec)
        )
        return {"job_id": job_id, "seq": await self._client.publish(event)}

    async def cancel(self, body: bytes) -> dict[str, Any]:
        """Publish a CancelRequested for an existing job."""
        request = CommandRequest.model_validate_json(body or b"{}")
        return await self._command(request, CancelRequested, new_event_id())

    async def retry(self, body: bytes) -> dict[str, Any]:
        """Publish a RetryRequested; retrying a named attempt twice is one request."""
        request = CommandRequest.model_validate_json(body or b"{}")
        retry_type = RetryRequested.model_fields["type"].default
        event_id = derived_event_id(request.job_id, retry_type, str(request.attempt)) if request.attempt else None
        return await self._command(request, RetryRequested, event_id or new_event_id())

    async def get(self, body: bytes) -> dict[str, Any]:
        """The job from the lifecycle projection, with the time spent in each state."""
        request = GetRequest.model_validate_json(body or b"{}")
        async with self._pool.acquire() as conn:
            view = await lifecycle_jobs.load(conn, request.job_id)
        if view is None:
            raise ApiError("not_found", f"unknown job {request.job_id!r}")
        job = view.model_dump(mode="json") | {"time_in_states": view.time_in_states(datetime.now(UTC))}
        return {"job": job}

    async def _command(
        self, request: CommandRequest, kind: type[CancelRequested | RetryRequested], event_id: str
    ) -> dict[str, Any]:
        if await count(self._client.js, Selection(JOBS.name, f"lanes.job.{request.job_id}.submitted")) == 0:
            raise ApiError("not_found", f"unknown job {request.job_id!r}: nothing was submitted")
        data = {"reason": request.reason, "requested_by": request.requested_by}
        fields = {"id": event_id, "source": SOURCE, "jobid": request.job_id, "attempt": request.attempt, "data": data}
        event = kind.model_validate(fields)
        return {"job_id": request.job_id, "seq": await self._client.publish(event)}
