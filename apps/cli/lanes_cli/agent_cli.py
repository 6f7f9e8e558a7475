"""`lanes agent`: the node agent as a process of its own, one per (real or simulated) node.

It needs only NATS: it runs the ranks the scheduler places on its nodes and reports them, follows the
kernel log when asked, and beats for each node with the node's inventory (GPUs from nvidia-smi where
present). Its ledger (`--state-dir`) is what makes it safe to kill and restart: each rank runs at most once,
and a restarted agent settles the ranks its earlier run left.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from lanes_agent.launcher import HEARTBEAT_S, STOP_GRACE_S, LocalLauncher
from lanes_agent.netns import NodeNetworks
from lanes_agent.ras_poll import DEFAULT_RAS_COMMAND, RAS_STALL_S, RasPolling
from lanes_cli.console import EXIT_BAD_INPUT, EXIT_FAILED, err, fail, load_settings, require, run_async
from lanes_cli.limits import MAX_OPTION_SECONDS, excerpt
from lanes_contract.client import connect_nats
from lanes_contract.ids import is_valid_token
from lanes_runtime.service import stop_on_signals

DEFAULT_STATE_DIR = Path.home() / ".lanes" / "agent"
_NAMED_UP_TO = 48
"""Longer lists of nodes name the consumer by a hash (JetStream names stay short)."""


def register(app: typer.Typer) -> None:
    """Add `lanes agent` to the CLI."""
    app.command()(agent)


def durable_name(nodes: list[str]) -> str:
    """The agent's JetStream consumer: its own per set of nodes (two agents never take each other's placements)."""
    joined = "-".join(sorted(nodes))
    if len(joined) <= _NAMED_UP_TO:
        return f"agent-{joined}"
    return f"agent-{hashlib.sha256(joined.encode()).hexdigest()[:16]}"


def node_networks(nodes: list[str]) -> NodeNetworks | None:
    """Each node's network namespace, made; or None (said on stderr) where they cannot be made."""
    why = NodeNetworks.unavailable()
    if why is not None:
        err.print(f"--netns: {why}; the nodes share this host's network")
        return None
    networks = NodeNetworks(nodes)
    try:
        networks.up()
    except subprocess.CalledProcessError as exc:
        networks.down()
        fail(f"--netns: `{' '.join(map(str, exc.cmd))}` failed: {(exc.stderr or '').strip()}", EXIT_FAILED)
    err.print(f"nodes in network namespaces on bridge {networks.bridge}: " + ", ".join(
        f"{link.node}={link.address}" for link in networks.links.values()
    ))  # fmt: skip
    return networks


def agent(  # noqa: PLR0917 - typer maps each parameter to an option
    node: Annotated[list[str], typer.Option("--node", help="A node this agent runs ranks for (repeatable).")],
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help=f"The ledger of started ranks (default {DEFAULT_STATE_DIR}/<consumer>); keep it across restarts."
        ),
    ] = None,
    kernel_log: Annotated[
        Path | None,
        typer.Option(help="Follow this kernel log (/dev/kmsg, as root); its resume position is kept in the state dir."),
    ] = None,
    stop_grace: Annotated[
        float,
        typer.Option(
            help="Seconds between SIGTERM and SIGKILL when a gang is stopped.", min=0.1, max=MAX_OPTION_SECONDS
        ),
    ] = STOP_GRACE_S,
    netns: Annotated[
        bool, typer.Option("--netns", help="Each node's ranks in a network namespace of its own (root).")
    ] = False,
    heartbeat: Annotated[
        float,
        typer.Option(
            help="Seconds between heartbeats (each with the node's inventory; see `lanes topology agents`).",
            min=0.1,
            max=MAX_OPTION_SECONDS,
        ),
    ] = HEARTBEAT_S,
    ras: Annotated[
        bool,
        typer.Option(
            "--ras",
            help="When a rank's collective times out or its steps stop for --ras-stall seconds, ask NCCL's RAS "
            "(once per attempt) and publish its report as this node's evidence of the job.",
        ),
    ] = False,
    ras_command: Annotated[
        str, typer.Option(help="The RAS client and its flags, split as a shell would (with --ras).")
    ] = DEFAULT_RAS_COMMAND,
    ras_stall: Annotated[
        float,
        typer.Option(
            help="Seconds without a step after which a rank counts as stalled (with --ras).",
            min=1.0,
            max=MAX_OPTION_SECONDS,
        ),
    ] = RAS_STALL_S,
) -> None:
    """Run the ranks placed on these nodes until SIGTERM or Ctrl-C (needs NATS_URL only)."""
    settings = load_settings()
    url = require(settings.nats_url, "NATS_URL")
    for name in node:
        if not is_valid_token(name):
            fail(f"invalid node name {excerpt(name)}: letters, digits, '-' and '_' only", EXIT_BAD_INPUT)
    durable = durable_name(node)
    directory = state_dir or DEFAULT_STATE_DIR / durable

    try:
        polling = RasPolling.from_command_line(ras_command, stall_s=ras_stall) if ras else None
    except ValueError as exc:
        fail(f"--ras-command: {exc}", EXIT_BAD_INPUT)
    networks = node_networks(node) if netns else None

    async def serve() -> None:
        nc = await connect_nats(url, name=durable)
        try:
            launcher = LocalLauncher(
                nc,
                frozenset(node),
                durable=durable,
                stop_grace_s=stop_grace,
                kernel_log=kernel_log,
                kernel_log_position=directory / "kmsg.position" if kernel_log else None,
                state_dir=directory / "ranks",
                networks=networks,
                heartbeat_s=heartbeat,
                ras=polling,
            )
            err.print(f"agent for {', '.join(sorted(node))}: consumer {durable}, ledger {directory}")
            await launcher.run(stop_on_signals())
        finally:
            await nc.close()

    try:
        run_async(serve)
    except KeyboardInterrupt:
        err.print("stopped")
    finally:
        if networks is not None:
            networks.down()
