"""`lanes replay` on a real server: selection, order, resumption, and nothing left behind."""

from __future__ import annotations

import json

import pytest
from support.cli import run_lanes_async
from support.contract import submission
from support.waiting import eventually

from lanes_contract.client import LanesClient
from lanes_contract.codec import decode
from lanes_contract.events import NodeRegistered, NodeRegisteredData
from lanes_contract.streams import JOBS
from lanes_runtime import reader
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers


async def _replay(nats_url: str, *args: str) -> tuple[int, list[dict[str, object]], str]:
    # Replay needs NATS alone: the other servers' URLs are removed.
    result = await run_lanes_async(
        None, "replay", *args, env={"NATS_URL": nats_url, "DATABASE_URL": None, "REDIS_URL": None}
    )
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    return result.returncode, lines, result.stderr


async def test_replay_of_a_job_is_its_whole_timeline_in_order_and_resumable(
    lanes: LanesClient, servers: ServerUrls, unique: str
) -> None:
    job_id = f"replay-{unique}"
    published = [await lanes.publish(submission(job_id)) for _ in range(5)]
    await lanes.publish(submission(f"other-{unique}"))  # not selected

    code, lines, _ = await _replay(servers.nats_url, "--job", job_id)
    assert code == 0
    assert [int(str(line["sequence"])) for line in lines] == published
    for line in lines:
        assert line["specversion"] == "1.0"
        assert line["jobid"] == job_id
        # Each line is a structured-mode CloudEvent that decodes back into the catalogue.
        event = decode(f"lanes.job.{job_id}.submitted", {}, json.dumps(line).encode())
        assert event.attempt == 1

    code, resumed, _ = await _replay(servers.nats_url, "--job", job_id, "--from-seq", str(published[2]))
    assert [int(str(line["sequence"])) for line in resumed] == published[2:]
    code, window, _ = await _replay(
        servers.nats_url, "--job", job_id, "--from-seq", str(published[1]), "--to-seq", str(published[3])
    )
    assert [int(str(line["sequence"])) for line in window] == published[1:4]

    ephemeral = [c.name for c in await lanes.js.consumers_info(JOBS.name) if c.config.durable_name is None]
    assert ephemeral == []  # every replay removed its consumer


async def test_replay_of_a_node_and_validation_of_every_event(
    lanes: LanesClient, servers: ServerUrls, unique: str
) -> None:
    node = f"node-{unique}"
    for gpus in (4, 8):
        data = NodeRegisteredData(gpu_model="H100", gpus=gpus, gpu_memory_gib=80)
        await lanes.publish(NodeRegistered(source="tests", node=node, data=data))
    code, lines, _ = await _replay(servers.nats_url, "--node", node, "--validate")
    assert code == 0
    assert [line["data"]["gpus"] for line in lines] == [4, 8]  # type: ignore[index]


async def test_replay_reports_an_invalid_event_instead_of_skipping_it(
    lanes: LanesClient, servers: ServerUrls, unique: str
) -> None:
    job_id = f"junk-{unique}"
    await lanes.js.publish(f"lanes.job.{job_id}.submitted", b"not json", headers={"ce-specversion": "1.0"})
    await lanes.publish(submission(job_id))
    code, lines, _ = await _replay(servers.nats_url, "--job", job_id, "--validate")
    assert code == 0
    assert len(lines) == 2
    assert "error" in lines[0]
    assert lines[1]["jobid"] == job_id


async def test_replay_refuses_contradictory_or_bad_options(servers: ServerUrls) -> None:
    code, _, stderr = await _replay(servers.nats_url, "--job", "a", "--node", "b")
    assert code == 2
    assert "choose one of" in stderr
    code, _, stderr = await _replay(servers.nats_url, "--job", "a", "--pace", "fast")
    assert code == 2
    assert "--pace" in stderr
    code, _, stderr = await _replay(servers.nats_url, "--job", "never-seen")
    assert code == 3


async def test_a_read_that_waits_longer_than_its_consumer_lives_goes_on_where_it_was(
    lanes: LanesClient, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paced replay or a merge may leave a read's consumer idle past its lifetime: the server removes it, and
    the read makes another from the next sequence, so nothing is skipped or yielded twice."""
    monkeypatch.setattr(reader, "READER_IDLE_S", 1.0)
    job_id = f"lapsed-{unique}"
    published = [await lanes.publish(submission(job_id)) for _ in range(300)]  # more than one batch of 256
    selection = reader.Selection(JOBS.name, f"lanes.job.{job_id}.>")

    async def ours() -> list[str]:
        consumers = await lanes.js.consumers_info(JOBS.name)
        return [c.name for c in consumers if c.config.filter_subject == selection.subject]

    seen: list[int] = []
    lapsed = False
    async for msg in reader.iter_stream(lanes.js, selection):
        seen.append(msg.metadata.sequence.stream)
        if len(seen) == 256 and not lapsed:  # the first batch taken; the next pull comes after the lapse
            (name,) = await ours()

            async def gone(name: str = name) -> bool:
                return name not in await ours()

            await eventually(gone, timeout_s=30, what="the idle reader's consumer removed by the server")
            lapsed = True
    assert lapsed
    assert seen == published
    assert await ours() == []  # the second consumer is deleted when the read ends
