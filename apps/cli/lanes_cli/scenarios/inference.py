"""Inference scenario for `lanes demo`: two replicas under light load, one replica's node fails.

Two inference jobs serve `tiny-chat` version v1, each a real OpenAI-compatible server process (the toy
replica) on its own node, behind the router. A few clients stream chat completions through the router
the whole time. Then the node of replica A fails: its server process is killed with SIGKILL and the node's
kernel log reports the GPU falling off the bus (Xid 79). With `through_kernel` that line is written to
/dev/kmsg and the node agent reads it there, as on a GPU node; otherwise the scenario publishes what the
agent would have read. Requests that had not received a byte move to replica B without the client
noticing; the ones streaming from A at that instant are continued on B from the token where A stopped
(the client still sees one whole stream; provenance records the move, and the clients' tally counts them
as `continued_on_another_replica`). Telemetry elects the Xid as the first error, recovery marks the
replica unhealthy, cordons the node and asks for a replacement attempt with the same model version once
A's GPUs are released; the router puts it back in rotation after a health check. At the end both replicas
are drained and cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from nats.aio.msg import Msg

from lanes_agent.faults import write_kernel_line
from lanes_contract.client import LanesClient, publish_encoded
from lanes_contract.codec import decode, encode
from lanes_contract.errors import DecodeError
from lanes_contract.events import (
    CancelRequested,
    CommandData,
    JobStateChanged,
    JobSubmitted,
    JobSubmittedData,
    RankStarted,
    ReplicaState,
    ReplicaStateChanged,
    RequestServed,
)
from lanes_contract.ids import derived_event_id, new_event_id
from lanes_contract.jobs import JobSpec, JobState, Owners, ProtectionMode, ServingSpec, WorkloadClass
from lanes_contract.streams import REQUESTS, TELEMETRY
from lanes_evidence.evidence import evidence_event
from lanes_evidence.parsers import SourceContext, parse_lines
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.service import Connections

SOURCE = "lanes/demo"
MODEL, VERSION = "tiny-chat", "v1"
CLIENTS = 3
"""Concurrent clients, each streaming one request after another: light load."""
_PROMPT = [{"role": "user", "content": "Which lane owns an Xid 79?"}]


@dataclass
class ClientTally:
    """What the clients saw: each request's outcome as the client experienced it."""

    outcomes: Counter[str] = field(default_factory=Counter)

    def as_json(self) -> dict[str, int]:
        """`ok`, `error_event` (a stream cut with an error event), `http_<status>` counts.

        And `continued_on_another_replica`: how many `ok` streams moved mid-way (read from their provenance).
        """
        return dict(sorted(self.outcomes.items()))


@dataclass(frozen=True)
class InferenceDemo:
    """The two replica jobs, the node that failed, and what the clients saw."""

    replica_job_ids: tuple[str, str]
    failed_node: str
    clients: dict[str, int]


class _Replicas:
    """What the scenario waits for on the replicas' timelines: pids, router states, releases."""

    def __init__(self) -> None:
        self.pids: dict[tuple[str, int], tuple[str, int]] = {}
        self.ready: set[tuple[str, int]] = set()
        self.released: set[tuple[str, int]] = set()
        self._changed = asyncio.Condition()

    async def on_message(self, msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            event = decode(msg.subject, msg.headers, msg.data)
            key = (event.job_key, event.attempt or 1)
            if isinstance(event, RankStarted) and event.node and event.data.pid:
                self.pids[key] = (event.node, event.data.pid)
            elif isinstance(event, ReplicaStateChanged) and event.data.state is ReplicaState.READY:
                self.ready.add(key)
            elif isinstance(event, JobStateChanged) and event.data.to_state is JobState.RELEASED:
                self.released.add(key)
            else:
                return
            async with self._changed:
                self._changed.notify_all()

    async def wait(self, what: str, check: Any, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(check)
        except TimeoutError:
            msg = f"the inference scenario timed out waiting for {what}"
            raise TimeoutError(msg) from None


def replica_spec(name: str) -> JobSpec:
    """One replica of tiny-chat v1: a whole node (so the two replicas never share one), a toy server."""
    command = (sys.executable, "-m", "lanes_sandbox.toy_replica", "--model", MODEL, "--version", VERSION)
    return JobSpec(
        name=name,
        workload_class=WorkloadClass.INFERENCE,
        workers=1,
        gpus_per_worker=4,
        command=(*command, "--port", "0", "--tokens", "12", "--token-delay-ms", "25"),
        serving=ServingSpec(model=MODEL, version=VERSION, protection=ProtectionMode.QUEUE, queue_timeout_s=5.0),
        owners=Owners(platform="serving-oncall", host="node-oncall"),
    )


async def _client(session: aiohttp.ClientSession, url: str, tally: ClientTally, stop: asyncio.Event) -> None:
    body = {"model": MODEL, "messages": _PROMPT, "stream": True, "max_tokens": 12}
    while not stop.is_set():
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:  # noqa: PLR2004 - HTTP OK
                await response.read()
                tally.outcomes[f"http_{response.status}"] += 1
                await asyncio.sleep(0.1)
                continue
            outcome = "ok"
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: {") and "error" in json.loads(line.removeprefix("data: ")):
                    outcome = "error_event"
            tally.outcomes[outcome] += 1


async def _continued_streams(conns: Connections, since: datetime) -> int:
    """How many of the model's requests since `since` moved to another replica mid-stream and completed."""
    moved = 0
    async for msg in iter_stream(conns.nc.jetstream(), Selection(REQUESTS.name, f"lanes.req.{MODEL}.>", since=since)):
        with contextlib.suppress(DecodeError):
            event = decode(msg.subject, msg.headers, msg.data)
            if isinstance(event, RequestServed) and event.data.continuations and event.data.status == "ok":
                moved += 1
    return moved


async def _node_fails(conns: Connections, node: str, pid: int, *, through_kernel: bool) -> None:
    """Kill the replica's server, and the node's kernel log says the GPU fell off the bus."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    xid = f"NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=python3, GPU has fallen off the bus."
    if through_kernel:
        write_kernel_line(xid)  # the launcher follows /dev/kmsg and names the replica by its pid
        return
    at = datetime.now(UTC)
    line = f"{at:%b} {at.day:2d} {at:%H:%M:%S} {node} kernel: [{at.timestamp() % 1e6:.6f}] {xid}"
    context = SourceContext(origin=f"{node}/kern.log", node=node, year=at.year, tz=UTC)
    for number, evidence in enumerate(parse_lines([line], context)):
        event = evidence_event(evidence, source=f"agent/{node}", node=node, time=at)
        event = event.model_copy(update={"id": derived_event_id(f"xid-{node}-{pid}", event.type, str(number))})
        await publish_encoded(conns.nc.jetstream(), encode(event), stream=TELEMETRY.name)


async def replica_node_fails(
    conns: Connections, router_url: str, *, timeout_s: float = 90.0, through_kernel: bool = False
) -> InferenceDemo:
    """Run the scenario against a stack with every service, a launcher and a router at `router_url`."""
    suffix = new_event_id()[-12:]
    chat_a, chat_b = f"demo-chat-a-{suffix}", f"demo-chat-b-{suffix}"
    replicas = _Replicas()
    subs = [await conns.nc.subscribe(f"lanes.job.{job}.>", cb=replicas.on_message) for job in (chat_a, chat_b)]
    client = LanesClient(conns.nc, SOURCE)
    tally, stop = ClientTally(), asyncio.Event()
    try:
        for job_id, name in ((chat_a, "chat-a"), (chat_b, "chat-b")):
            spec = replica_spec(name)
            await client.publish(JobSubmitted(source=SOURCE, jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec)))
        await replicas.wait("both replicas ready", lambda: {(chat_a, 1), (chat_b, 1)} <= replicas.ready, timeout_s)
        load_started = datetime.now(UTC)
        async with aiohttp.ClientSession() as session:
            load = [asyncio.create_task(_client(session, router_url, tally, stop)) for _ in range(CLIENTS)]
            try:
                await asyncio.sleep(1.5)  # steady state under load before the fault
                node, pid = replicas.pids[(chat_a, 1)]
                await _node_fails(conns, node, pid, through_kernel=through_kernel)
                await replicas.wait("replica A's attempt released", lambda: (chat_a, 1) in replicas.released, timeout_s)
                await replicas.wait(
                    "a replacement of replica A ready", lambda: (chat_a, 2) in replicas.ready, timeout_s
                )
                await asyncio.sleep(1.0)  # the replacement takes traffic
            finally:
                stop.set()
                await asyncio.gather(*load)
        for job_id in (chat_a, chat_b):
            data = CommandData(reason="demo over: scale down", requested_by="demo")
            await client.publish(CancelRequested(source=SOURCE, jobid=job_id, data=data))
        await replicas.wait(
            "both replicas released",
            lambda: (chat_a, 2) in replicas.released and (chat_b, 1) in replicas.released,
            timeout_s,
        )
        # Provenance is published off the request path; by now (both replicas released) it is stored.
        if continued := await _continued_streams(conns, load_started):
            tally.outcomes["continued_on_another_replica"] = continued
    finally:
        for sub in subs:
            await sub.unsubscribe()
    return InferenceDemo((chat_a, chat_b), node, tally.as_json())
