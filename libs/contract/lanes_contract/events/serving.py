"""Inference serving: replicas listening and changing state, and one provenance event per request."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import AwareDatetime, Field

from lanes_contract.events.base import Data, Event, Family, HeaderText, Lane
from lanes_contract.jobs import Token


class ReplicaState(StrEnum):
    """Where an inference replica stands in the router's rotation."""

    STARTING = "starting"
    """Placed (and maybe listening) but not yet confirmed by a health check."""
    READY = "ready"
    DRAINING = "draining"
    """Takes no new requests; the ones in flight finish."""
    UNHEALTHY = "unhealthy"
    """In the penalty box (or marked by recovery); probed until it answers again."""
    GONE = "gone"
    """Its attempt ended; it will never take a request again."""


class ReplicaListeningData(Data):
    """The address a replica's server answers on, as its process announced it."""

    endpoint: str = Field(
        pattern=r"^https?://[^\s/]+$", description="Scheme, host and port, e.g. http://10.0.0.7:8000."
    )
    rank: int = Field(default=0, ge=0)


class ReplicaListening(Event):
    """A launcher saw an inference replica's server start listening."""

    family = Family.JOB
    name = "replica_listening"
    lane: Lane = Lane.HOST
    data: ReplicaListeningData


class ReplicaStateChangedData(Data):
    """A replica (one inference job) entered a new state in the router's rotation."""

    replica: Token
    model: Token
    version: Token
    state: ReplicaState
    previous: ReplicaState | None = None
    reason: str = ""
    signal: Literal["placement", "probe", "passive", "recovery", "operator", "lifecycle"] = "probe"
    endpoint: str | None = None
    gpus: tuple[int, ...] = ()
    penalty_s: float | None = Field(default=None, ge=0, description="How long it stays out before the next probe.")


class ReplicaStateChanged(Event):
    """A replica became ready, draining, unhealthy or gone; routers fold these into their registry."""

    family = Family.JOB
    name = "replica_state"
    lane: Lane = Lane.PLATFORM
    data: ReplicaStateChangedData


UNROUTED = "unrouted"
"""The replica token of a request no replica took: `lanes.req.<model>.unrouted`."""


class RequestAttempt(Data):
    """One try of a request on one replica, and why the router moved on (or stopped)."""

    replica: Token
    node: str | None = None
    outcome: Literal["ok", "error", "timeout", "refused", "slow_first_token", "failed_mid_stream", "client_closed"]
    detail: str = ""
    http_status: int | None = None
    elapsed_ms: float = Field(ge=0)
    first_token: int | None = Field(
        default=None,
        ge=0,
        description="Streams: the index, in the client's stream, of the first token this try sent; above 0 "
        "when it continued a stream another replica had started.",
    )
    tokens_sent: int | None = Field(
        default=None, ge=0, description="Streams: how many tokens this try sent the client."
    )


class RequestServedData(Data):
    """The provenance of one inference request: who served it, on what, how it went, and every try."""

    request_id: HeaderText = Field(min_length=1, max_length=128)
    model: Token
    version: Token | None = None
    replica: Token = Field(description="The replica that answered, or `unrouted`.")
    gpus: tuple[int, ...] = ()
    endpoint: str | None = None
    route: str = Field(description="The API path, e.g. /v1/chat/completions.")
    stream: bool = False
    status: Literal["ok", "failed", "rejected", "client_closed"]
    http_status: int
    error: str = ""
    attempts: tuple[RequestAttempt, ...] = ()
    continuations: int = Field(
        default=0, ge=0, description="How many times the stream moved to another replica after its first token."
    )
    received_at: AwareDatetime
    ttft_ms: float | None = Field(default=None, ge=0, description="Time to the first byte of the answer.")
    latency_ms: float = Field(ge=0)
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    router: str = Field(default="", description="Which router process handled it.")
    tenant: Token | None = Field(default=None, description="The tenant whose API key asked, when tenants are on.")


class RequestServed(Event):
    """One inference request, end to end; `jobid`/`node` are the serving replica's job and node."""

    family = Family.REQUEST
    name = "served"
    lane: Lane = Lane.PLATFORM
    data: RequestServedData

    def nats_subject(self) -> str:
        """`lanes.req.<model>.<replica>`: the join keys of a request are its model and replica."""
        return f"lanes.req.{self.data.model}.{self.data.replica}"
