"""What a node agent says about its nodes themselves: that it is alive, and how their links are.

Heartbeats (every `heartbeat_s`, with what the node runs and its inventory) go to their own stream and are
dropped, not held, when the bus is away: the next one says the same, and newer. Link changes and a link
holding packets back are the node's network evidence, held through outages like all evidence.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime

import structlog

from lanes_agent import netns
from lanes_agent.inventory import node_inventory
from lanes_contract.events import (
    AgentHeartbeat,
    AgentHeartbeatData,
    Event,
    EvidenceCategory,
    EvidenceData,
    utc_now,
)
from lanes_contract.streams import BEATS, TELEMETRY
from lanes_evidence.evidence import Evidence, evidence_event

log = structlog.get_logger(__name__)

Publish = Callable[[Event, str], Awaitable[None]]

_LINK_POLL_S = 0.2
_THROTTLE_EVERY = 5
"""Link polls per read of the links' throttle counters (one `tc` call for all of them: once a second)."""
_INVENTORY_EVERY = 6
"""Beats between re-reads of the inventory (nvidia-smi takes a while; ECC counts and repairs change)."""


class LinkWatch:
    """Each simulated node's link, in its own network namespace, watched as an agent watches its NICs."""

    def __init__(self, networks: netns.NodeNetworks, publish_held: Publish) -> None:
        self._networks = networks
        self._publish_held = publish_held

    async def run(self, stop: asyncio.Event) -> None:
        """Report each node's link going down or up, as a node agent watching its NICs does (network lane).

        And a link that holds packets back (its port's discard and throttle counters rise) as port errors, once
        per episode: a degraded link fails nothing, and this is what names the node behind it, where the
        collectives' timings say only that the job's network slowed (telemetry's slowdown reads both).
        """
        was = dict.fromkeys(self._networks.links, True)
        counters: dict[str, int] = {}
        throttling: set[str] = set()
        polls = 0
        while not stop.is_set():
            if polls % _THROTTLE_EVERY == 0:
                counters = await self._report_throttled(counters, throttling)
            polls += 1
            for node in sorted(self._networks.links):
                up = netns.link_is_up(node)
                if up is None or up == was[node]:
                    continue
                was[node] = up
                category = EvidenceCategory.LINK_UP if up else EvidenceCategory.LINK_DOWN
                what = f"link {netns.link_of(node)} of {node} is {'up' if up else 'down'}"
                data = EvidenceData(category=category, summary=what, origin="agent: link state")
                now = utc_now()
                found = Evidence(data=data, time=now, node=node)
                await self._publish_held(
                    evidence_event(found, source=f"agent/{node}", node=node, time=now), TELEMETRY.name
                )
            await asyncio.sleep(_LINK_POLL_S)

    async def _report_throttled(self, before: dict[str, int], throttling: set[str]) -> dict[str, int]:
        """Read every node's link counters once; report a link whose count rose (and did not the read before).

        Returns the counts, for the next read.
        """
        links = {netns.link_of(node): node for node in self._networks.links}
        now_counts = await asyncio.to_thread(netns.throttled_packets, sorted(links))
        for link, count in sorted(now_counts.items()):
            node = links[link]
            rising = link in before and count > before[link]
            if not rising:
                throttling.discard(node)
                continue
            if node in throttling:
                continue  # the same episode: said once
            throttling.add(node)
            what = f"link {link} of {node} held back or dropped {count - before[link]} packets in a second"
            data = EvidenceData(
                category=EvidenceCategory.PORT_ERRORS, summary=what, origin="agent: link counters", interface=link
            )
            at = utc_now()
            found = Evidence(data=data, time=at, node=node)
            await self._publish_held(evidence_event(found, source=f"agent/{node}", node=node, time=at), TELEMETRY.name)
        return now_counts


class Heartbeats:
    """An agent's beats for each of its nodes."""

    def __init__(
        self,
        agent: str,
        nodes: frozenset[str],
        running: Mapping[str, int],
        kernel_log_state: Callable[[], str],
        *,
        send: Publish,
        interval_s: float,
        nvidia_smi: str | None,
    ) -> None:
        self._agent = agent
        self._nodes = nodes
        self._running = running
        """Ranks running now, per node (the agent keeps it)."""
        self._kernel_log_state = kernel_log_state
        self._send = send
        self._heartbeat_s = interval_s
        self._nvidia_smi = nvidia_smi
        self._started_at: datetime = utc_now()

    async def run(self, stop: asyncio.Event) -> None:
        """Say each node's agent is alive, every `heartbeat_s`, with what it runs and the node's inventory.

        A beat that cannot be sent is dropped, not held: the next one says the same, and newer.
        """
        inventory = None
        beats = 0
        unsent: set[str] = set()  # nodes whose last beat failed: an outage is said when it starts and ends
        while not stop.is_set():
            if beats % _INVENTORY_EVERY == 0:
                inventory = await asyncio.to_thread(node_inventory, self._nvidia_smi)
            beats += 1
            assert inventory is not None  # noqa: S101 - read on the first beat
            for node in sorted(self._nodes):
                data = AgentHeartbeatData(
                    agent=self._agent,
                    started_at=self._started_at,
                    interval_s=self._heartbeat_s,
                    running_ranks=self._running[node],
                    kernel_log=self._kernel_log_state()[:512],
                    inventory=inventory,
                )
                beat = AgentHeartbeat(source=f"agent/{node}", node=node, data=data)
                try:
                    await self._send(beat, BEATS.name)
                except Exception as exc:  # noqa: BLE001 - the agent runs its ranks without the bus too
                    if node not in unsent:
                        log.warning("heartbeats not sent", node=node, error=str(exc) or type(exc).__name__)
                    unsent.add(node)
                    continue
                if node in unsent:
                    unsent.discard(node)
                    log.info("heartbeats sent again", node=node)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self._heartbeat_s)
