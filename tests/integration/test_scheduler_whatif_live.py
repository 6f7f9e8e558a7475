"""The scheduler what-if over a log the real scheduler wrote (NATS + PostgreSQL): every decision reproduced.

The scheduler service places, holds back and releases a few gangs on two nodes; the test then reads its node
and job streams back as the log `lanes replay` would give, and `replay_scheduler` with the log's own cluster
must give every recorded `job_placed` the same GPUs and every `job_waiting` the same reason, in order.
"""

from __future__ import annotations

import pytest
from nats.js import JetStreamContext
from support.waiting import eventually
from test_scheduler_service import Cluster, running

from lanes_contract.codec import decode
from lanes_contract.events import Event, JobPlaced
from lanes_contract.streams import JOBS, NODES
from lanes_runtime.settings import ServerUrls
from lanes_scheduler.views import replay_scheduler

pytestmark = pytest.mark.real_servers


async def _stream(js: JetStreamContext, stream: str, subject: str) -> list[Event]:
    """Every event of `subject` in `stream`, in stream order."""
    info = await js.stream_info(stream, subjects_filter=subject)
    total = sum((info.state.subjects or {}).values())
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True)
    events: list[Event] = []
    try:
        while len(events) < total:
            msg = await sub.next_msg(timeout=5)
            events.append(decode(msg.subject, msg.headers, msg.data))
    finally:
        await sub.unsubscribe()
    return events


async def _recorded_log(c: Cluster) -> list[Event]:
    js = c.conns.nc.jetstream()
    events = [e for n in c.nodes.values() for e in await _stream(js, NODES.name, f"lanes.node.{n}.>")]
    events += [e for j in c.jobs.values() for e in await _stream(js, JOBS.name, f"lanes.job.{j}.>")]
    return sorted(events, key=lambda e: e.time)


async def _placed(c: Cluster, name: str) -> bool:
    return bool(await c.status(name) in {"placed", "done"})


async def test_the_replay_of_a_live_schedulers_log_reproduces_every_decision(urls: ServerUrls, unique: str) -> None:
    async with running(urls, unique, ["wide", "next", "small"], ["n1", "n2"]) as c:
        for name in ("n1", "n2"):
            await c.node(name)
        await c.nodes_known(2)
        await c.submit("wide", workers=2, gpus_per_worker=8)
        await eventually(lambda: _placed(c, "wide"), what="wide placed")
        await c.submit("next", workers=1, gpus_per_worker=8)
        await eventually(lambda: _is_waiting(c, "next"), what="next waits")
        await c.submit("small", workers=1, gpus_per_worker=4)
        await eventually(lambda: _is_waiting(c, "small"), what="small waits")
        await c.finish("wide")
        await eventually(lambda: _placed(c, "next"), what="next placed once wide ended")
        await eventually(lambda: _placed(c, "small"), what="small placed once wide ended")
        await c.finish("next")
        await c.finish("small")

        async def on_the_log() -> bool:
            return sum(isinstance(e, JobPlaced) for e in await _recorded_log(c)) == 3

        await eventually(on_the_log, what="three placements on the log")
        log = await _recorded_log(c)

    result = (await replay_scheduler(log)).as_json()

    assert result["replay_check"]["differences"] == []
    assert result["replay_check"]["recorded"] == 3
    assert result["replay_check"]["reproduced"] == 3
    assert result["wait_reasons"]["old"] == {"capacity_short": 2}
    assert result["double_booked"] == {"old": 0, "new": 0}


async def _is_waiting(c: Cluster, name: str) -> bool:
    return await c.reason(name) == "capacity_short"
