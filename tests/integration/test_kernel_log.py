"""The node agent's kernel log reader on this machine's real /dev/kmsg (root): from now, resumed, and through a
stopped bus."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import Counter
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from support.cli import lanes_process
from support.restartable_nats import RestartableNats
from support.waiting import eventually

from lanes_agent.kmsg import KmsgReader, Position, boot_id, boot_time
from lanes_agent.launcher import LocalLauncher
from lanes_contract.client import PUBLISH_TRIES, PUBLISH_TRY_S, connect_nats
from lanes_contract.codec import decode
from lanes_contract.streams import TELEMETRY, provision_streams
from lanes_runtime.failures import is_infrastructure
from lanes_runtime.reader import Selection, iter_stream
from lanes_sandbox.embedded import EmbeddedNats

KMSG = Path("/dev/kmsg")
pytestmark = pytest.mark.skipif(not os.access(KMSG, os.R_OK | os.W_OK), reason="needs a readable, writable /dev/kmsg")


def _write(line: str) -> None:
    # A record is complete at its newline: without one the kernel holds it open for a continuation.
    with KMSG.open("w") as kmsg:
        kmsg.write(f"<6>{line}\n")


def _mine(reader: KmsgReader, tag: str) -> list[str]:
    return [r.text for r in reader.available() if tag in r.text]


def test_a_first_start_reads_from_now_and_a_restart_resumes_after_the_last_record_handled() -> None:
    tag = uuid.uuid4().hex[:8]
    _write(f"lanes test {tag} before the agent started")
    boot = boot_id()
    first = KmsgReader(KMSG, None, boot)
    _write(f"lanes test {tag} one")
    _write(f"lanes test {tag} two")
    records = [r for r in first.available() if tag in r.text]
    first.close()
    assert [r.text for r in records] == [f"lanes test {tag} one", f"lanes test {tag} two"]
    assert records[0].sequence + 1 == records[1].sequence
    # Timestamps are since boot; in wall time they fall within this test.
    assert abs((boot_time() + records[1].since_boot) - (boot_time() + records[0].since_boot)).total_seconds() < 60

    # The agent handled "one" and was killed; restarted, it reads "two" (still in the ring buffer) and what came
    # after, and never "one" again.
    _write(f"lanes test {tag} three")
    resumed = KmsgReader(KMSG, Position(boot, records[0].sequence), boot)
    assert _mine(resumed, tag) == [f"lanes test {tag} two", f"lanes test {tag} three"]
    resumed.close()

    # A position from another boot is meaningless here: start from now.
    other = KmsgReader(KMSG, Position("another-boot", records[0].sequence), boot)
    _write(f"lanes test {tag} four")
    assert _mine(other, tag) == [f"lanes test {tag} four"]
    other.close()


def _xid_line(tag: str, number: int) -> str:
    """An Xid 79 line naming no process: the agent's one node's evidence, told apart by `tag` and `number`."""
    return (
        f"NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. {tag} {number}"
    )


async def _stored_lines(js: JetStreamContext, node: str, tag: str) -> Counter[str]:
    """How many times each kernel line with `tag` is stored on LANES_TELEMETRY as the node's evidence."""
    stored: Counter[str] = Counter()
    async for msg in iter_stream(js, Selection(TELEMETRY.name, f"lanes.tel.{node}.>")):
        event = decode(msg.subject, msg.headers, msg.data)
        lines = getattr(event.data, "lines", ())
        stored.update(line for line in lines if tag in line)
    return stored


@pytest.mark.real_servers
@pytest.mark.slow
async def test_the_follower_outlives_a_stopped_bus_and_every_line_arrives_exactly_once(tmp_path: Path) -> None:
    tag = f"lanes-bus-stopped-{uuid.uuid4().hex[:8]}"
    node = "node-1"
    # Longer than a publish may take before it gives up (every try timed out): the follower meets failures.
    outage_s = PUBLISH_TRIES * PUBLISH_TRY_S + 4
    with RestartableNats(tmp_path / "nats") as nats:
        nc = await connect_nats(nats.url, name="tests")
        js = nc.jetstream()
        await provision_streams(js)
        agent_args = ("agent", "--node", node, "--state-dir", str(tmp_path / "agent"), "--kernel-log", str(KMSG))
        try:
            async with lanes_process(*agent_args, "--heartbeat", "1", env={"NATS_URL": nats.url}) as agent:
                # The follower reads from the moment it opens the log: warm-up lines until one arrives.
                async def following() -> bool:
                    _write(_xid_line(f"{tag}-warm-up", 0))
                    return bool(await _stored_lines(js, node, f"{tag}-warm-up"))

                await eventually(following, timeout_s=60, what="the follower reading the kernel log")
                _write(_xid_line(tag, 1))
                await eventually(
                    lambda: _has(js, node, tag, 1), timeout_s=30, what="the line written before the outage"
                )

                nats.stop()  # the process ends: every publish fails, reconnects are refused
                for number in (2, 3, 4):
                    _write(_xid_line(tag, number))
                await asyncio.sleep(outage_s)
                _write(_xid_line(tag, 5))
                nats.start()
                _write(_xid_line(tag, 6))  # read by a follower that is still running

                await eventually(lambda: _has(js, node, tag, 6), timeout_s=120, what="every line after the outage")
                assert agent.returncode is None
                stored = await _stored_lines(js, node, f"{tag} ")
        finally:
            await nc.close()
    assert stored == Counter({_xid_line(tag, number): 1 for number in range(1, 7)})


async def _has(js: JetStreamContext, node: str, tag: str, count: int) -> bool:
    try:
        return len(await _stored_lines(js, node, f"{tag} ")) >= count
    except Exception as exc:
        if is_infrastructure(exc):
            return False  # the test's own connection is still coming back from the outage
        raise


@pytest.mark.real_servers
async def test_a_line_the_bus_refuses_is_skipped_and_the_follower_reads_on(
    secured_nats: EmbeddedNats, tmp_path: Path
) -> None:
    # node-1's identity following the kernel log as node-2's: the bus refuses every line it publishes.
    tag = f"lanes-refused-{uuid.uuid4().hex[:8]}"
    nc = await connect_nats(secured_nats.url_for("agent-node-1"), name="agent-node-1")
    position = tmp_path / "kmsg.position"
    launcher = LocalLauncher(
        nc,
        frozenset({"node-2"}),
        durable="agent-node-1",
        kernel_log=KMSG,
        kernel_log_position=position,
        state_dir=tmp_path / "ranks",
        heartbeat_s=60,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(launcher.run(stop))
    ours = KmsgReader(KMSG, None, boot_id())
    try:

        async def following() -> bool:
            _write(f"{tag} warm-up")  # a plain line: no evidence, but its position is stored
            return Position.load(position) is not None

        await eventually(following, timeout_s=30, what="the follower storing its position")
        _write(_xid_line(tag, 1))
        _write(_xid_line(tag, 2))
        written = [r.sequence for r in ours.available() if r.text.startswith("NVRM") and tag in r.text]

        async def past_both() -> bool:
            stored = Position.load(position)
            return stored is not None and stored.sequence >= written[-1]

        await eventually(past_both, timeout_s=30, what="the follower past both refused lines")
        assert len(written) == 2
        assert not running.done()
    finally:
        ours.close()
        stop.set()
        await running
        await nc.close()
