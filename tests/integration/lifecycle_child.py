"""Child process for the lifecycle's crash and concurrency tests: one lifecycle replica for one job.

Usage: lifecycle_child.py NATS_URL DATABASE_URL DURABLE JOB_ID DIE_PER_MILLE
JOB_ID `*` reads every job's events (the service's own consumer, with the test's short timings).
With DIE_PER_MILLE > 0 it also kills itself with SIGKILL at random instants: before the handler, after
the handler ran but before the commit, before the outbox is published, before the ack, and (fifty times
as often, the narrowest window) right after a transition was appended to the log, before the commit.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent))

from nats.aio.msg import Msg
from support.lifecycle import lifecycle_spec

import lanes_runtime.consumer as consumer_module
from lanes_contract.client import connect_nats, publish_encoded
from lanes_contract.events import Event
from lanes_lifecycle.adapters import unit_of_work as unit_of_work_module
from lanes_lifecycle.entrypoints.service import SERVICE, job_event_handler
from lanes_runtime.consumer import EventConsumer, Handler, HandlerContext
from lanes_runtime.store import apply_migrations, apply_runtime_migrations, create_pool


def main() -> None:
    nats_url, database_url, durable, job_id, per_mille = sys.argv[1:6]
    chance = int(per_mille) / 1000

    def maybe_die() -> None:
        if random.random() < chance:  # noqa: S311 - a crash point, not cryptography
            os.kill(os.getpid(), signal.SIGKILL)

    def dying(handle_job_event: Handler) -> Handler:
        async def handler(event: Event, ctx: HandlerContext) -> Sequence[Event]:
            maybe_die()
            outputs = await handle_job_event(event, ctx)
            maybe_die()  # the transition is on the log, the transaction not yet committed
            return outputs

        return handler

    publish = publish_encoded
    ack = Msg.ack

    async def dying_publish(*args: Any, **kwargs: Any) -> Any:
        maybe_die()
        return await publish(*args, **kwargs)

    async def dying_ack(self: Msg) -> None:
        maybe_die()
        await ack(self)

    appended = unit_of_work_module.publish_transition  # type: ignore[attr-defined]

    async def dying_append(*args: Any, **kwargs: Any) -> int:
        seq = await appended(*args, **kwargs)
        if random.random() < chance * 50:  # noqa: S311 - a crash point, not cryptography
            os.kill(os.getpid(), signal.SIGKILL)
        return seq

    consumer_module.publish_encoded = dying_publish  # type: ignore[attr-defined]
    unit_of_work_module.publish_transition = dying_append  # type: ignore[attr-defined]
    Msg.ack = dying_ack  # type: ignore[method-assign]

    async def run() -> None:
        nc = await connect_nats(nats_url, name=f"lifecycle-child-{os.getpid()}")
        pool = await create_pool(database_url)
        await apply_runtime_migrations(pool)
        assert SERVICE.migrations is not None
        await apply_migrations(pool, "lifecycle", SERVICE.migrations)
        print("ready", flush=True)  # noqa: T201 - the parent waits for this line
        handler = dying(job_event_handler(nc.jetstream()))
        await EventConsumer(nc, pool, lifecycle_spec(durable, job_id), handler).run(asyncio.Event())

    asyncio.run(run())


if __name__ == "__main__":
    main()
