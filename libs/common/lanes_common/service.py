"""What a service is, to the composition root: its migrations and its consumers with their handlers."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources.abc import Traversable

from lanes_common.consumer import ConsumerSpec, Handler


@dataclass(frozen=True)
class ServiceDefinition:
    """A service's name, its SQL migrations (or None) and the consumers it runs."""

    name: str
    migrations: Traversable | None
    consumers: tuple[tuple[ConsumerSpec, Handler], ...]
