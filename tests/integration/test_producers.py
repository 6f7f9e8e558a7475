"""docs/producers.md: the `nats pub` example, sent as written with a bare NATS client, is a valid event."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import nats
import pytest

from lanes_contract.codec import decode
from lanes_contract.events import RankExited
from lanes_contract.streams import JOBS, provision_streams
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.settings import ServerUrls

pytestmark = pytest.mark.real_servers
DOC = Path(__file__).resolve().parents[2] / "docs" / "producers.md"


def _nats_pub_example() -> tuple[str, bytes, dict[str, str]]:
    block = re.search(r"```sh\n(nats pub .*?)```", DOC.read_text(), re.DOTALL)
    assert block is not None, "docs/producers.md has no `nats pub` example"
    args = shlex.split(block[1].replace("\\\n", " "))
    subject, body = args[2], args[3]
    headers = dict(value.split(":", 1) for flag, value in zip(args[4::2], args[5::2], strict=True) if flag == "-H")
    return subject, body.encode(), headers


async def test_the_documented_nats_pub_is_a_valid_event_stored_once(own_urls: ServerUrls) -> None:
    subject, body, headers = _nats_pub_example()
    nc = await nats.connect(own_urls.nats_url)
    try:
        js = nc.jetstream()
        await provision_streams(js)
        for _ in range(2):  # a producer that retries: the same id is stored once
            await js.publish(subject, body, headers=headers)
        stored = [msg async for msg in iter_stream(js, Selection(stream=JOBS.name, subject=subject))]
    finally:
        await nc.close()
    assert len(stored) == 1
    event = decode(stored[0].subject, stored[0].headers, stored[0].data)
    assert isinstance(event, RankExited)
    assert (event.jobid, event.attempt, event.node, event.rank, event.source) == (
        "train-42",
        1,
        "node-17",
        3,
        "ci/runner-7",
    )
    assert (event.data.exit_code, event.data.signal) == (3, None)
