"""One router process: the registry feed, the HTTP front, health probes, leases and provenance, wired together.

`RouterRunner` is a `Runner`, so `lanes serve router` and `lanes up` run it next to the other services;
`python -m lanes_router` runs it alone (it needs NATS and Redis, not PostgreSQL). The bound URL is known
once the registry has been rebuilt from the log and the socket listens: `await runner.url()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
from collections.abc import Iterable

import aiohttp
import redis.asyncio as aioredis
import structlog
from aiohttp import web
from nats.aio.client import Client as NatsClient

from lanes_contract.client import LanesClient
from lanes_contract.events import Event, NodeStateChanged, ReplicaState
from lanes_contract.streams import JOBS, NODES, REQUESTS, provision_streams
from lanes_contract.topology import NodeState
from lanes_router.adapters.health_store import RedisFailureCounter
from lanes_router.adapters.leases import RedisLeases
from lanes_router.adapters.metrics import Labels, RouterMetrics
from lanes_router.adapters.provenance import ProvenancePublisher
from lanes_router.adapters.registry_feed import RegistryFeed
from lanes_router.domain.health import PenaltyPolicy
from lanes_router.domain.replicas import Replica, ReplicaRegistry
from lanes_router.entrypoints.config import RouterConfig
from lanes_router.entrypoints.guard import ConnectionGuard
from lanes_router.entrypoints.http import RouterHttp
from lanes_router.service_layer.dispatch import Dispatcher
from lanes_router.service_layer.health import SOURCE, HealthMonitor, ProbeResult

log = structlog.get_logger(__name__)
LOST_HOLDS = frozenset({"recovery", "lifecycle", "node"})
"""Who, taking a replica out, means it is lost (its streams move now); passive ejection may be one bad try."""


class RouterRunner:
    """The router as a `Runner`: serve HTTP until `stop`, then let in-flight requests finish and flush."""

    def __init__(self, nc: NatsClient, redis: aioredis.Redis, config: RouterConfig | None = None) -> None:
        self.name = "router"
        self.config = config or RouterConfig.from_env()
        self._nc = nc
        self._redis = redis
        self.router_name = f"{socket.gethostname()}-{os.getpid()}"
        self.registry = ReplicaRegistry()
        self._http: RouterHttp | None = None
        self.metrics = RouterMetrics()
        self.leases = RedisLeases(
            redis,
            ttl_s=self.config.lease_ttl_s,
            owner=self.router_name,
            answer_timeout_s=self.config.shared_state_timeout_s,
        )
        self.provenance = ProvenancePublisher(nc.jetstream())
        self.feed = RegistryFeed(nc, self._fold)
        policy = PenaltyPolicy(
            failures_to_eject=self.config.failures_to_eject,
            base_s=self.config.penalty_base_s,
            max_s=self.config.penalty_max_s,
        )
        self.health = HealthMonitor(
            self.registry,
            RedisFailureCounter(redis),
            LanesClient(nc, SOURCE),
            self._probe,
            policy=policy,
            probe_interval_s=self.config.probe_interval_s,
            ready_probe_interval_s=self.config.ready_probe_interval_s,
            apply=self._fold,
        )
        self.dispatcher = Dispatcher(self.registry, self.leases)
        self._bound: asyncio.Future[str] | None = None
        self._listener: asyncio.Server | None = None
        self.guard: ConnectionGuard | None = None
        self._probe_session: aiohttp.ClientSession | None = None
        self._register_gauges()

    async def url(self) -> str:
        """The URL the router answers on, once it does (e.g. `http://127.0.0.1:41234`)."""
        return await self._bound_future()

    def _bound_future(self) -> asyncio.Future[str]:
        if self._bound is None:
            self._bound = asyncio.get_running_loop().create_future()
        return self._bound

    async def provision(self) -> None:
        """The streams the router reads and writes (idempotent; the composition root has usually done it)."""
        await provision_streams(self._nc.jetstream(), (JOBS, NODES, REQUESTS))

    async def run(self, stop: asyncio.Event) -> None:
        """Rebuild the registry, listen, serve until `stop`; then drain in-flight requests and flush provenance."""
        inner_stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=self.config.probe_timeout_s)
        self._probe_session = aiohttp.ClientSession(timeout=timeout)
        http = self._http = RouterHttp(
            config=self.config,
            registry=self.registry,
            dispatcher=self.dispatcher,
            health=self.health,
            submit_provenance=self.provenance.submit,
            metrics=self.metrics,
            source=SOURCE,
            router_name=self.router_name,
            ready=self.feed.caught_up.is_set,
        )
        runner = web.AppRunner(
            http.application(),
            shutdown_timeout=self.config.shutdown_timeout_s,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self.config.idle_timeout_s,
        )
        background = [
            asyncio.create_task(self.feed.run(inner_stop), name="router-feed"),
            asyncio.create_task(self.leases.run(inner_stop), name="router-leases"),
            asyncio.create_task(self.provenance.run(inner_stop), name="router-provenance"),
        ]
        listening = False
        try:
            if not await self._until_caught_up(background[0], stop):
                return
            background.append(asyncio.create_task(self.health.run(inner_stop), name="router-health"))
            await runner.setup()
            listening = True
            await self._listen(runner)
            url = self._url_of(runner)
            log.info("router listening", url=url, router=self.router_name, replicas=len(self.registry.all()))
            if not (bound := self._bound_future()).done():  # a waiter that gave up (a Ctrl-C) cancelled it
                bound.set_result(url)
            await stop.wait()
        finally:
            # Stop taking connections, let the requests in flight finish (bounded), then stop the helpers,
            # which release the leases and publish the last provenance events.
            if self._listener is not None:
                self._listener.close()
            if listening:
                await runner.cleanup()
            inner_stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            await self._probe_session.close()
            log.info("router stopped", published=self.provenance.published, dropped=self.provenance.dropped)

    async def _listen(self, runner: web.AppRunner) -> None:
        config = self.config
        # The HTTP server's protocols behind a guard: a cap on connections and a deadline for request heads.
        server = runner.server
        if server is None:
            msg = "the HTTP runner is not set up"
            raise RuntimeError(msg)
        self.guard = ConnectionGuard(
            server, max_connections=config.max_connections, header_timeout_s=config.header_timeout_s
        )
        loop = asyncio.get_running_loop()
        try:
            self._listener = await loop.create_server(self.guard, config.host, config.port, backlog=1024)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or config.strict_port or config.port == 0:
                raise
            log.warning("router port taken; listening on a free port instead", port=config.port)
            self._listener = await loop.create_server(self.guard, config.host, 0, backlog=1024)

    async def _until_caught_up(self, feed: asyncio.Task[None], stop: asyncio.Event) -> bool:
        """Whether the registry was rebuilt (False: asked to stop first); raises if the feed failed."""
        caught_up = asyncio.ensure_future(self.feed.caught_up.wait())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({caught_up, feed, stopping}, return_when=asyncio.FIRST_COMPLETED)
        caught_up.cancel()
        stopping.cancel()
        if self.feed.caught_up.is_set():
            return True
        if feed.done():
            feed.result()  # the feed failed: raise its error
            msg = "the registry feed stopped before it caught up"
            raise RuntimeError(msg)
        return False

    def _url_of(self, _runner: web.AppRunner) -> str:
        sockets = self._listener.sockets if self._listener is not None else ()
        for address in (sock.getsockname() for sock in sockets):
            if isinstance(address, tuple):
                host, port = address[0], address[1]
                host = f"[{host}]" if ":" in host else host
                return f"http://{host}:{port}"
        return f"http://{self.config.host}:{self.config.port}"

    def _fold(self, event: Event) -> None:
        if isinstance(event, NodeStateChanged) and event.data.state is NodeState.UNHEALTHY:
            self._cut_streams(
                (r.replica_id for r in self.registry.all() if r.node == event.node_key),
                f"its node {event.node_key} is unhealthy ({event.data.reason or 'no reason given'})",
            )
        transition = self.registry.apply(event)
        if transition is None:
            return
        after = transition.after
        if after.state in {ReplicaState.GONE, ReplicaState.UNHEALTHY} and after.hold in LOST_HOLDS:
            self._cut_streams((after.replica_id,), f"the replica is {after.state.value} ({after.hold})")
        elif after.state is ReplicaState.DRAINING and self._http is not None:
            before = transition.before
            if before is None or before.state is not ReplicaState.DRAINING:
                self._hand_over_after_drain(after)
        self.metrics.transitions[(("model", after.model), ("state", after.state.value))] += 1
        with contextlib.suppress(RuntimeError):  # folded before the loop runs (tests): nothing to schedule
            self.health.observe(transition)

    def _hand_over_after_drain(self, draining: Replica) -> None:
        """After the spec's drain timeout, the streams a still-draining replica sends move to another one."""
        timeout_s = draining.serving.failover.drain_timeout_s
        if timeout_s is None:
            return

        def over() -> None:
            now = self.registry.get(draining.replica_id)
            # The same drain still (not readied and drained again, not gone): hand its streams over.
            if now is not None and now.state is ReplicaState.DRAINING and now.generation == draining.generation:
                self._cut_streams((draining.replica_id,), f"the replica drained for {timeout_s:g}s")

        with contextlib.suppress(RuntimeError):  # folded before the loop runs (tests): nothing is streaming
            asyncio.get_running_loop().call_later(timeout_s, over)

    def _cut_streams(self, replica_ids: Iterable[str], why: str) -> None:
        if self._http is None:
            return  # not serving yet (the rebuild's replay): no stream to move
        for replica_id in replica_ids:
            if moved := self._http.cut_streams(replica_id, why):
                log.info("streams moved off a lost replica", replica=replica_id, streams=moved, why=why)

    async def _probe(self, endpoint: str) -> ProbeResult:
        assert self._probe_session is not None  # noqa: S101 - opened in run()
        try:
            async with self._probe_session.get(f"{endpoint}/health") as answer:
                return "ok" if answer.status == 200 else "error"  # noqa: PLR2004 - HTTP OK
        except aiohttp.ClientConnectorError:
            return "refused"
        except TimeoutError:
            return "timeout"
        except aiohttp.ClientError:
            return "error"

    def _register_gauges(self) -> None:
        def replicas() -> list[tuple[Labels, float]]:
            counts: dict[Labels, int] = {}
            for replica in self.registry.all():
                labels = (("model", replica.model), ("version", replica.version), ("state", replica.state.value))
                counts[labels] = counts.get(labels, 0) + 1
            return [(labels, float(n)) for labels, n in sorted(counts.items())]

        self.metrics.gauge("replicas", "Replicas by model, version and state.", replicas)
        self.metrics.gauge("leases_held", "Concurrency leases this router holds.", lambda: [((), self.leases.held)])
        self.metrics.gauge(
            "provenance_queued", "Request events waiting to be published.", lambda: [((), self.provenance.queued)]
        )
        self.metrics.gauge(
            "provenance_published", "Request events published.", lambda: [((), self.provenance.published)]
        )
        self.metrics.gauge(
            "provenance_dropped", "Request events dropped (queue full).", lambda: [((), self.provenance.dropped)]
        )
