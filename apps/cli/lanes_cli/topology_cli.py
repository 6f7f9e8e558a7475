"""`lanes topology import | show | export | state`: the cluster model from files, the live view, Slurm out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import asyncpg
import typer

from lanes_cli.console import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    fail,
    load_settings,
    out,
    print_big_json,
    require,
    run_async,
)
from lanes_cli.input_files import read_text_file
from lanes_cli.limits import MAX_TOPOLOGY_BYTES, excerpt
from lanes_cli.node_health import node_health
from lanes_cli.scheduling import leaked_allocations
from lanes_cli.timeline import read_stream
from lanes_cli.topology_formats import (
    FORMATS,
    TopologyFormatError,
    export_slurm,
    node_from_matrix,
    parse_k8s_labels,
    parse_native,
    parse_nvidia_smi,
    parse_slurm,
)
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.events import (
    CLUSTER_POLICY_NODE,
    AgentHeartbeat,
    ClusterPolicySet,
    ClusterPolicySetData,
    Lane,
    NodeRegistered,
    NodeRegisteredData,
    NodeStateChanged,
    NodeStateChangedData,
    utc_now,
)
from lanes_contract.ids import derived_event_id, is_valid_token
from lanes_contract.streams import BEATS, NODES
from lanes_contract.topology import LEVELS, Cluster, Level, Node, NodeState
from lanes_runtime.reader import Selection, count
from lanes_runtime.store import create_pool
from lanes_scheduler import views as scheduler
from lanes_scheduler.views import CapacityView

app = typer.Typer(help="The cluster model: import it from Slurm, Kubernetes, nvidia-smi or YAML; show; export.")
SOURCE = "lanes/topology"


def parse_cluster(text: str, fmt: str, *, node: str | None = None, defaults: dict[str, Any] | None = None) -> Cluster:
    """Parse a topology in one of FORMATS; raises TopologyFormatError naming the line."""
    if fmt == "slurm":
        return parse_slurm(text, defaults=defaults)
    if fmt == "labels":
        return parse_k8s_labels(text)
    if fmt == "nvidia-smi":
        if not node:
            raise TopologyFormatError(None, "--node is required with --format nvidia-smi (the matrix is one node's)")
        return Cluster(nodes=(node_from_matrix(node, parse_nvidia_smi(text), **(defaults or {})),))
    return parse_native(text)


def _parse(path: Path, fmt: str, node: str | None, defaults: dict[str, Any]) -> Cluster:
    if fmt not in FORMATS:
        fail(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}", EXIT_BAD_INPUT)
    text = read_text_file(path, max_bytes=MAX_TOPOLOGY_BYTES, what=f"a topology file is text ({fmt} format)")
    try:
        return parse_cluster(text, fmt, node=node, defaults=defaults)
    except TopologyFormatError as exc:
        fail(f"{path}: {exc}", EXIT_BAD_INPUT)


def node_json(node: Node) -> dict[str, Any]:
    """A node with its domain at every level, as `show --json` and `import --dry-run` print it."""
    return {
        "node_id": node.node_id,
        "gpu_model": node.gpu_model,
        "gpus": node.gpus,
        "gpu_memory_gib": node.gpu_memory_gib,
        "pool": node.pool,
        "rack": node.rack,
        "domains": {level.value: node.domain(level) for level in LEVELS if level is not Level.CLUSTER},
        "state": node.status.state.value,
        "state_reason": node.status.reason,
        "state_owner_lane": node.status.owner_lane,
        "labels": node.labels,
    }


def registration(node: Node) -> NodeRegistered:
    """The inventory event of a node (its id derives from the content, so importing twice stores it once)."""
    data = NodeRegisteredData(
        gpu_model=node.gpu_model,
        gpus=node.gpus,
        gpu_memory_gib=node.gpu_memory_gib,
        labels=node.labels,
        nvlink_domain=node.nvlink_domain,
        leaf=node.leaf,
        spine=node.spine,
        rack=node.rack,
        pool=node.pool,
    )
    event_id = derived_event_id(node.node_id, NodeRegistered.model_fields["type"].default, data.model_dump_json())
    return NodeRegistered(id=event_id, source=SOURCE, node=node.node_id, data=data)


@app.command("import")
def import_(  # noqa: PLR0917 - typer maps each parameter to an option
    file: Annotated[Path, typer.Argument(help="The topology file.")],
    fmt: Annotated[str, typer.Option("--format", help=f"One of: {', '.join(FORMATS)}.")] = "lanes",
    node: Annotated[str | None, typer.Option(help="Node id (for --format nvidia-smi).")] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs per node where the format has none (slurm).")] = None,
    gpu_model: Annotated[str | None, typer.Option(help="GPU model where the format has none.")] = None,
    gpu_memory: Annotated[int | None, typer.Option(help="GiB per GPU where the format has none.")] = None,
    pool: Annotated[str | None, typer.Option(help="Pool of the imported nodes where the format has none.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Parse and print; publish nothing.")] = False,
) -> None:
    """Read a topology file and publish its nodes (and pools/quotas) to the timeline for the scheduler."""
    settings = load_settings(quiet=True)
    if node is not None and not is_valid_token(node):
        fail(f"--node {excerpt(node)} must be 1-128 characters from A-Z a-z 0-9 _ -", EXIT_BAD_INPUT)
    defaults = {
        k: v
        for k, v in {"gpus": gpus, "gpu_model": gpu_model, "gpu_memory_gib": gpu_memory, "pool": pool}.items()
        if v is not None
    }
    cluster = _parse(file, fmt, node, defaults)
    summary = {"nodes": len(cluster.nodes), "gpus": sum(n.gpus for n in cluster.nodes)}
    if dry_run:
        print_big_json(summary | {"cluster": [node_json(n) for n in cluster.nodes]})
        return
    nats_url = require(settings.nats_url, "NATS_URL")

    async def publish() -> int:
        async with await LanesClient.connect(nats_url, source=SOURCE) as client:
            for n in cluster.nodes:
                await client.publish(registration(n))
            if cluster.policy.pools or cluster.policy.tenants:
                data = ClusterPolicySetData(policy=cluster.policy)
                await client.publish(ClusterPolicySet(source=SOURCE, node=CLUSTER_POLICY_NODE, data=data))
        return len(cluster.nodes)

    published = run_async(publish)
    out.print_json(json.dumps(summary | {"published": published}))


@app.command()
def state(
    node: Annotated[str, typer.Argument(help="Node id.")],
    new_state: Annotated[NodeState, typer.Argument(metavar="STATE", help="ready, cordoned, draining or unhealthy.")],
    reason: Annotated[str, typer.Option(help="Why (shown to every job this blocks).")] = "",
    lane: Annotated[Lane, typer.Option(help="The lane that owns the change.")] = Lane.PLATFORM,
) -> None:
    """Cordon, drain, mark unhealthy or make ready one node (one Lanes knows); waiting jobs see who and why."""
    settings = load_settings(quiet=True)
    if not is_valid_token(node):
        fail(f"node {excerpt(node)} must be 1-128 characters from A-Z a-z 0-9 _ -", EXIT_BAD_INPUT)
    nats_url = require(settings.nats_url, "NATS_URL")

    async def publish() -> int:
        async with await LanesClient.connect(nats_url, source="lanes/cli") as client:
            # Only a node Lanes has heard of (registered, or seen by an adapter): a typo must not publish.
            if await count(client.js, Selection(NODES.name, f"lanes.node.{node}.>")) == 0:
                fail(f"unknown node {node!r}: no events on lanes.node.{node}.>", EXIT_NOT_FOUND)
            data = NodeStateChangedData(state=new_state, reason=reason)
            return await client.publish(NodeStateChanged(source=client.source, node=node, lane=lane, data=data))

    out.print_json(json.dumps({"node": node, "state": new_state.value, "seq": run_async(publish)}))


async def live_view(database_url: str) -> dict[str, Any]:
    """Nodes with domains, state and free GPUs, free GPUs per domain, policy and leaked allocations."""
    pool = await create_pool(database_url, max_size=1)
    try:
        async with pool.acquire() as conn:
            nodes = await scheduler.nodes(conn)
            view = CapacityView(nodes, await scheduler.policy(conn), await scheduler.holdings(conn))
            leaks = await leaked_allocations(conn)
    finally:
        await pool.close()
    domains: dict[str, dict[str, dict[str, int]]] = {}
    for level in (Level.NVLINK, Level.LEAF, Level.SPINE):
        for n in nodes:
            entry = domains.setdefault(level.value, {}).setdefault(
                n.domain(level), {"nodes": 0, "gpus": 0, "free_gpus": 0}
            )
            entry["nodes"] += 1
            entry["gpus"] += n.gpus
            entry["free_gpus"] += len(view.free[n.node_id])
    return {
        "nodes": [
            node_json(n) | {"free_gpus": len(view.free[n.node_id]), "holders": list(view.holders_of([n.node_id]))}
            for n in nodes
        ],
        "domains": domains,
        "policy": view.policy.model_dump(mode="json"),
        "leaked_allocations": leaks,
    }


@app.command()
def show(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """The cluster as the scheduler sees it now: nodes, their domains, state and free GPUs."""
    settings = load_settings(quiet=True)
    database_url = require(settings.database_url, "DATABASE_URL")

    async def load() -> dict[str, Any]:
        try:
            return await live_view(database_url)
        except asyncpg.UndefinedTableError:
            fail("DATABASE_URL holds no scheduler projection yet: no scheduler has run against it", EXIT_NOT_FOUND)

    view = run_async(load)
    if as_json:
        out.print_json(json.dumps(view))
        return
    for n in view["nodes"]:
        d = n["domains"]
        out.print(
            f"{n['node_id']:<16} {n['state']:<9} {n['free_gpus']}/{n['gpus']} {n['gpu_model']:<10} "
            f"nvlink={d['nvlink']} leaf={d['leaf']} spine={d['spine']} pool={n['pool']}",
            highlight=False,
        )
    for leak in view["leaked_allocations"]:
        out.print(f"[red]leaked[/red] {leak['job_id']}/{leak['attempt']}: {leak['gpus']} GPUs; {leak['why']}")


@app.command()
def export(
    source: Annotated[
        Path | None, typer.Option("--from", help="Convert this file instead of the live cluster.")
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help=f"Format of --from: {', '.join(FORMATS)}.")] = "lanes",
    block: Annotated[bool, typer.Option("--block", help="Block plugin (NVLink domains) instead of the tree.")] = False,
) -> None:
    """Print a Slurm topology.conf for the live cluster (DATABASE_URL) or for a file."""
    settings = load_settings(quiet=True)
    if source is not None:
        cluster = _parse(source, fmt, None, {})
    else:
        database_url = require(settings.database_url, "DATABASE_URL")

        async def load() -> Cluster:
            pool = await create_pool(database_url, max_size=1)
            try:
                async with pool.acquire() as conn:
                    return Cluster(nodes=tuple(await scheduler.nodes(conn)))
            finally:
                await pool.close()

        cluster = run_async(load)
    typer.echo(export_slurm(cluster, block=block), nl=False)


async def agent_reports(nats_url: str) -> tuple[list[AgentHeartbeat], dict[str, int]]:
    """The latest heartbeat of each node's agent, and the GPUs each node was last registered with."""
    nc = await connect_nats(nats_url, name="lanes-topology-agents")
    try:
        js = nc.jetstream()
        beats = [e.event for e in await read_stream(js, Selection(BEATS.name, "lanes.beat.>"))]
        registrations = await read_stream(js, Selection(NODES.name, "lanes.node.*.registered"))
    finally:
        await nc.close()
    registered = {e.event.node: e.event.data.gpus for e in registrations if isinstance(e.event, NodeRegistered)}
    return [b for b in beats if isinstance(b, AgentHeartbeat)], {n: g for n, g in registered.items() if n}


@app.command()
def agents(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """The node agents as their heartbeats say: alive or silent, what they run, each node's GPUs and faults.

    Exits 1 when any node has a problem (a silent agent, an unreadable kernel log or nvidia-smi, GPUs
    missing against the registration, uncorrectable ECC errors or a pending repair).
    """
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    beats, registered = run_async(lambda: agent_reports(nats_url))
    rows = node_health(beats, registered, utc_now())
    if as_json:
        out.print_json(json.dumps([row.as_json() for row in rows]))
    for row in [] if as_json else rows:
        inventory = row.inventory
        if inventory is None:
            has = "-"
        elif inventory.gpus:
            has = f"{len(inventory.gpus)}x {inventory.gpus[0].name}"
        else:
            has = f"{inventory.cpus} CPUs {inventory.memory_gib:g} GiB"
        heard = "never" if row.heard_s_ago is None else f"{row.heard_s_ago:.0f}s ago"
        mark = "[red]problem[/red]" if row.problems else "[green]ok[/green]"
        out.print(f"{row.node:<16} {mark:<22} heard {heard:<9} ranks={row.running_ranks:<3} {has}", highlight=False)
        for problem in row.problems:
            out.print(f"    {problem}", highlight=False, markup=False)
    if any(row.problems for row in rows):
        raise typer.Exit(EXIT_FAILED)
