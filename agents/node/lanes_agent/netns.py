"""Real links between simulated nodes: one network namespace per node, joined by a bridge.

Each simulated node gets a namespace `lanes-<node>` with its own `eth0` and address on a private subnet; the
other end of that veth pair sits on a bridge in the host's namespace. A node's ranks run inside its
namespace, so torch.distributed's traffic between nodes crosses real (virtual) links, and cutting a node's
link (`ip link set <its veth> down`, as `lanes drill --kind link-down` does) really cuts it.

The agent itself stays in the host's namespace, where NATS is: it publishes for every node it runs. The bridge
has an address of its own (`HOST_ADDRESS`), so the host reaches every node at the node's address: the router
sends a request to a replica listening there, as it would to a replica on another machine.
Names derive from the node's name, so a drill on the same host finds a node's link without asking the agent.
Needs root and iproute2; without them ranks share the host's network and the agent says why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

INTERFACE = "eth0"
"""The node's interface inside its namespace (ranks bind to it: GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)."""
SUBNET = "10.77"
"""Nodes get 10.77.<i / 250>.<i % 250 + 2>/16 (up to 12,500 nodes on one bridge)."""
_MAX_NODES = 12_500
HOST_ADDRESS = f"{SUBNET}.255.254"
"""The host's address on the bridge (beyond every node's: nodes stop at 10.77.49.251)."""


def namespace_of(node: str) -> str:
    """The network namespace of a simulated node."""
    return f"lanes-{node}"


def link_of(node: str) -> str:
    """The host's end of the node's veth pair (at most 15 characters, as the kernel requires)."""
    return "lv" + hashlib.sha256(node.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class NodeLink:
    """Where a simulated node sits on the bridge."""

    node: str
    address: str
    namespace: str
    link: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)  # noqa: S603, S607 - iproute2, fixed arguments


class NodeNetworks:
    """The namespaces, veth pairs and bridge of a set of simulated nodes; `up` makes them, `down` removes them."""

    def __init__(self, nodes: Sequence[str], bridge: str | None = None) -> None:
        if len(nodes) > _MAX_NODES:
            msg = f"at most {_MAX_NODES} simulated nodes share one bridge"
            raise ValueError(msg)
        self.bridge = bridge or "lbr" + hashlib.sha256(",".join(sorted(nodes)).encode()).hexdigest()[:10]
        self.links = {
            node: NodeLink(node, f"{SUBNET}.{i // 250}.{i % 250 + 2}", namespace_of(node), link_of(node))
            for i, node in enumerate(sorted(nodes))
        }

    @staticmethod
    def unavailable() -> str | None:
        """Why nodes cannot get namespaces here, or None when they can."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "iproute2 (`ip`) is not installed"
        if not Path("/proc/self/ns/net").exists():
            return "this kernel has no network namespaces"
        return None

    def up(self) -> dict[str, NodeLink]:
        """Make the bridge and every node's namespace, veth pair and address (what an earlier run left goes first)."""
        self.down()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{HOST_ADDRESS}/16", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for link in self.links.values():
            _ip("netns", "add", link.namespace)
            _ip("link", "add", link.link, "type", "veth", "peer", "name", INTERFACE, "netns", link.namespace)
            _ip("link", "set", link.link, "master", self.bridge, "up")
            _ip("-n", link.namespace, "addr", "add", f"{link.address}/16", "dev", INTERFACE)
            _ip("-n", link.namespace, "link", "set", INTERFACE, "up")
            _ip("-n", link.namespace, "link", "set", "lo", "up")
        return dict(self.links)

    def down(self) -> None:
        """Remove the namespaces (their veth pairs go with them) and the bridge; what is not there is skipped."""
        for link in self.links.values():
            subprocess.run(["ip", "netns", "del", link.namespace], check=False, capture_output=True)  # noqa: S603, S607
            subprocess.run(["ip", "link", "del", link.link], check=False, capture_output=True)  # noqa: S603, S607
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)  # noqa: S603, S607

    def command(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the node's namespace (`ip netns exec` execs it: the pid stays the rank's)."""
        return ["ip", "netns", "exec", self.links[node].namespace, *argv]

    def address(self, node: str) -> str:
        """The node's address, where its ranks listen (rank 0's is the rendezvous endpoint)."""
        return self.links[node].address


def link_is_up(node: str) -> bool | None:
    """Whether the host's end of the node's link is up (None: the node has no such link here)."""
    try:
        state = Path(f"/sys/class/net/{link_of(node)}/operstate").read_text().strip()
    except OSError:
        return None
    return state != "down"


def set_link(node: str, *, up: bool) -> None:
    """Bring the node's link down or up, from the host's side (a drill's cable pull)."""
    _ip("link", "set", link_of(node), "up" if up else "down")


# Shaping a node's link (`lanes drill --kind link-slow`). This kernel has no `sch_netem` (`tc qdisc add ... netem`
# says "Specified qdisc kind is unknown") and no iptables, so neither added delay nor random drops can be had;
# `tbf` and `htb` are built in. A token-bucket rate limit is what a degraded link does to a collective: each
# packet leaves only once the bucket has its bytes, so a step's small all-reduces queue behind one another.
# Measured on the drill workload (4 gloo ranks, 4 namespaces, one node shaped both ways, 1.6 kB burst): at
# 256 kbit/s every rank's collective wait rose from ~0.03 s to ~0.14 s a step (step time +80%); at 64 kbit/s
# to ~0.67 s; at 16 kbit/s to ~3.1 s. Each end of the veth is shaped, so both directions degrade: the host's
# end limits what the node receives, the namespace's `eth0` what it sends.
SLOW_RATE = "256kbit"
"""The rate `link-slow` limits a node's link to: a step about 1.8 times as long, far from any timeout."""
_BURST_BYTES = 1600
"""The bucket: one full-size frame (MTU 1500 and its headers), so every packet passes, one at a time."""
_QUEUE_LATENCY = "400ms"
"""How long a packet may wait in the bucket's queue before it is dropped (TCP resends it)."""


def _tbf(*prefix: str, device: str, rate: str) -> None:
    subprocess.run(  # noqa: S603 - tc, fixed arguments
        ["tc", *prefix, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,  # noqa: S607
         "burst", str(_BURST_BYTES), "latency", _QUEUE_LATENCY],
        check=True, capture_output=True, text=True,
    )  # fmt: skip


def shape_link(node: str, rate: str = SLOW_RATE) -> None:
    """Rate-limit the node's link both ways (a `tbf` on each end of its veth): a degraded link, still up."""
    _tbf(device=link_of(node), rate=rate)
    _tbf("-n", namespace_of(node), device=INTERFACE, rate=rate)


def unshape_link(node: str) -> None:
    """Give the node's link its full rate back (each end's default queue); an end already gone is skipped."""
    for prefix, device in (((), link_of(node)), (("-n", namespace_of(node)), INTERFACE)):
        subprocess.run(["tc", *prefix, "qdisc", "del", "dev", device, "root"], check=False, capture_output=True)  # noqa: S603, S607


def throttled_packets(links: Sequence[str]) -> dict[str, int]:
    """Per host-side link, the packets its queue held back or dropped (a port's discard and pause counters).

    One `tc` call reads every link of the host's namespace; a link without a shaping queue counts 0.
    """
    try:
        argv = ["tc", "-s", "-j", "qdisc", "show"]
        shown = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=5).stdout  # noqa: S603
        rows = json.loads(shown or "[]")
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    wanted = set(links)
    counts = dict.fromkeys(links, 0)
    for row in rows if isinstance(rows, list) else []:
        device = row.get("dev") if isinstance(row, dict) else None
        if device in wanted:
            counts[device] += int(row.get("overlimits") or 0) + int(row.get("drops") or 0)
    return counts
