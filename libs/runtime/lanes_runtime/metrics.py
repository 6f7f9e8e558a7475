"""Prometheus metrics of the consumer runtime (prefix `lanes_`, labelled by consumer, never by job).

The families live in the process's default registry, so `/metrics` (`serve_metrics`) shows every consumer
the process runs. Label values are consumer names: a handful per service, never an unbounded set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from enum import StrEnum

_EVENTS = Counter("lanes_consumer_events", "Deliveries settled, by what became of them", ["consumer", "outcome"])
_HELD = Counter("lanes_consumer_held", "Deliveries held in place while a server was unavailable", ["consumer"])
_READY = Gauge("lanes_consumer_ready", "1 when every server the consumer depends on answers", ["consumer"])
_PENDING = Gauge(
    "lanes_consumer_pending", "Messages on the stream not yet delivered to the consumer (lag)", ["consumer"]
)
_BATCH = Histogram(
    "lanes_consumer_batch_size",
    "Messages per fetched batch",
    ["consumer"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
_HANDLER = Histogram("lanes_consumer_handler_seconds", "Time in one handler call", ["consumer"])
_COMMIT = Histogram("lanes_consumer_commit_seconds", "Time of one batch transaction, begin to commit", ["consumer"])


@dataclass(frozen=True)
class ConsumerMetrics:
    """The metric children of one consumer."""

    consumer: str
    held: Counter
    ready: Gauge
    pending: Gauge
    batch_size: Histogram
    handler_seconds: Histogram
    commit_seconds: Histogram
    _settled: dict[str, Counter] = field(default_factory=dict)
    """The outcome counters' children, looked up once each: `count` runs once per delivery."""

    @classmethod
    def for_consumer(cls, consumer: str) -> ConsumerMetrics:
        """The children labelled with `consumer` (created on first use)."""
        return cls(
            consumer=consumer,
            held=_HELD.labels(consumer),
            ready=_READY.labels(consumer),
            pending=_PENDING.labels(consumer),
            batch_size=_BATCH.labels(consumer),
            handler_seconds=_HANDLER.labels(consumer),
            commit_seconds=_COMMIT.labels(consumer),
        )

    def count(self, outcome: StrEnum, n: int = 1) -> None:
        """Count `n` deliveries settled as `outcome` (processed, duplicate, retry, dead_lettered)."""
        counter = self._settled.get(outcome.value)
        if counter is None:
            counter = self._settled[outcome.value] = _EVENTS.labels(self.consumer, outcome.value)
        counter.inc(n)


METRICS_HOST_ENV = "LANES_METRICS_HOST"
DEFAULT_METRICS_HOST = "127.0.0.1"
"""Loopback unless told otherwise: a container, scraped from outside, sets LANES_METRICS_HOST=0.0.0.0."""


def serve_metrics(port: int, host: str | None = None) -> None:
    """Expose `/metrics` on `port` from a background thread, on `host` (else LANES_METRICS_HOST, else loopback)."""
    start_http_server(port, addr=host or os.environ.get(METRICS_HOST_ENV) or DEFAULT_METRICS_HOST)
