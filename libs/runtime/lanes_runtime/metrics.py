"""Prometheus metrics of the consumer runtime (prefix `lanes_`, labelled by consumer, never by job).

The families live in the process's default registry, so `/metrics` (`serve_metrics`) shows every consumer
the process runs. Label values are consumer names: a handful per service, never an unbounded set. The same
port answers `/readyz` (200 only while every consumer of the process is ready, as `lanes_consumer_ready` says)
and `/healthz` (200 while the process serves), so an orchestrator's probe needs no client of its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

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


_READY_METRIC = "lanes_consumer_ready"


def not_ready(registry: CollectorRegistry = REGISTRY) -> list[str] | None:
    """The consumers of the process that are not ready; None while none has said anything yet."""
    said = {
        sample.labels["consumer"]: sample.value
        for family in registry.collect()
        if family.name == _READY_METRIC
        for sample in family.samples
    }
    return None if not said else sorted(consumer for consumer, value in said.items() if value != 1)


_StartResponse = Callable[[str, list[tuple[str, str]]], Any]
_WsgiApp = Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]


def probes_and_metrics(
    registry: CollectorRegistry = REGISTRY,
) -> Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]:
    """The WSGI application of the metrics port: `/readyz`, `/healthz`, and Prometheus's `/metrics` otherwise."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in {"/readyz", "/healthz"}:
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        if path == "/healthz":
            status, said = "200 OK", "ok"
        elif (waiting := not_ready(registry)) is None:
            status, said = "503 Service Unavailable", "no consumer has started yet"
        elif waiting:
            status, said = "503 Service Unavailable", "not ready: " + ", ".join(waiting)
        else:
            status, said = "200 OK", "ready"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [said.encode() + b"\n"]

    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class names it so
        """Probes come every few seconds: not a line each in the service's log."""


def serve_metrics(port: int, host: str | None = None) -> None:
    """Serve `/metrics`, `/readyz` and `/healthz` on `port` from a background thread.

    It listens on `host`, else LANES_METRICS_HOST, else loopback.
    """
    server = make_server(
        host or os.environ.get(METRICS_HOST_ENV) or DEFAULT_METRICS_HOST,
        port,
        probes_and_metrics(),
        ThreadingWSGIServer,
        handler_class=_Quiet,
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
