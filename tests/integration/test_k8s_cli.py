"""`lanes k8s watch` as a user runs it: a kubeconfig pointing at the test API server, real NATS, SIGTERM to stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.cli import lanes_process, run_lanes_async
from support.k8s_api import FakeKubeApi
from support.waiting import eventually

from lanes_contract.client import connect_nats
from lanes_contract.codec import decode
from lanes_contract.events import NodeStateChanged
from lanes_contract.streams import NODES
from lanes_contract.topology import NodeState
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.settings import ServerUrls

pytestmark = [pytest.mark.real_servers, pytest.mark.slow]  # starts the `lanes` CLI as a process

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"


def kubeconfig(tmp_path: Path, server: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "tests",
        "clusters": [{"name": "tests", "cluster": {"server": server}}],
        "users": [{"name": "observer", "user": {"token": "not-checked-by-the-test-server"}}],
        "contexts": [{"name": "tests", "context": {"cluster": "tests", "user": "observer"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_lanes_k8s_watch_publishes_node_states_and_stops_on_sigterm(own_urls: ServerUrls, tmp_path):
    api = FakeKubeApi()
    await api.start()
    for line in (DATA / "node-states.ndjson").read_text().splitlines():
        item = json.loads(line)
        await api.apply(item["type"], item["object"])  # listed at start: the node as it is now (ready again)
    cordoned = json.loads((DATA / "node-states.ndjson").read_text().splitlines()[1])["object"]
    state = tmp_path / "state.json"
    args = ("k8s", "watch", "--kubeconfig", str(kubeconfig(tmp_path, api.url)), "--state-file", str(state))
    nc = await connect_nats(own_urls.nats_url, name="tests-k8s-cli")  # woken by messages on the node subjects
    try:
        async with lanes_process(
            *args, "--outbox", str(tmp_path / "outbox.ndjson"), env={"NATS_URL": own_urls.nats_url}
        ) as proc:

            async def watching() -> bool:
                return bool(api.watch_requests("nodes"))

            await eventually(watching, timeout_s=90, what="the observer watching nodes")  # the CLI's start, under load
            await api.apply("MODIFIED", cordoned)

            async def cordon_published() -> bool:
                return any(e.data.state is NodeState.CORDONED for e in await published(own_urls))

            await eventually(cordon_published, what="the cordon on the node stream", nc=nc, subjects=["lanes.node.>"])
            proc.terminate()
            assert await proc.wait() == 0
    finally:
        await nc.close()
        await api.stop()
    (event,) = [e for e in await published(own_urls) if e.data.state is NodeState.CORDONED]
    assert event.node == "gpu-node-1-cluster-local"
    saved = json.loads(state.read_text())
    assert int(saved["streams"]["Node:*"]["resourceVersion"]) >= 1005


async def published(urls: ServerUrls) -> list[NodeStateChanged]:
    nc = await connect_nats(urls.nats_url, name="tests-k8s-cli-read")
    try:
        found = []
        async for msg in iter_stream(nc.jetstream(), Selection(NODES.name, "lanes.node.>")):
            event = decode(msg.subject, msg.headers, msg.data)
            if isinstance(event, NodeStateChanged):
                found.append(event)
        return found
    finally:
        await nc.close()


async def test_a_kubeconfig_it_cannot_use_is_refused_with_why(own_urls: ServerUrls, tmp_path):
    ran = await run_lanes_async(own_urls, "k8s", "watch", "--kubeconfig", str(tmp_path / "missing"))
    assert ran.returncode == 2
    assert "cannot read the kubeconfig" in ran.stderr
