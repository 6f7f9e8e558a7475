"""What a service is, to the composition root: its migrations and its consumers with their handlers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from typing import Protocol

import asyncpg
import redis.asyncio as aioredis
from nats.aio.client import Client as NatsClient

from lanes_common.consumer import ConsumerSpec, Handler


class Runner(Protocol):
    """A long-running reader of the log that the composition root provisions and runs next to consumers."""

    @property
    def name(self) -> str:
        """The durable consumer (or role) name, for logs."""
        ...

    async def provision(self) -> None:
        """Create what it needs on the servers (idempotent)."""
        ...

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop` is set."""
        ...


@dataclass(frozen=True)
class RunnerContext:
    """The open connections a runner may use; the composition root owns (and closes) them."""

    nc: NatsClient
    pool: asyncpg.Pool
    redis: aioredis.Redis


RunnerFactory = Callable[[RunnerContext], Runner]


@dataclass(frozen=True)
class ServiceDefinition:
    """A service's name, its SQL migrations (or None), its consumers, and any runners of its own.

    Consumers follow the event consumer contract; a runner is for a reader that must see the raw log,
    such as the audit recorder, which copies even the messages no service can decode.
    """

    name: str
    migrations: Traversable | None
    consumers: tuple[tuple[ConsumerSpec, Handler], ...]
    runners: tuple[RunnerFactory, ...] = ()
