"""Child process for the crash tests: runs a consumer and kills itself with SIGKILL at a chosen point.

Usage: crash_consumer.py NATS_URL DATABASE_URL JOB_ID (ack|publish)
- ack: after the transaction committed and the outputs were published, just before the ack.
- publish: after the transaction committed, just before the first output is published.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent))

from nats.aio.msg import Msg
from support.contract import EFFECTS_DDL, record_effect, spec_for

import lanes_runtime.consumer as consumer_module
from lanes_contract.client import connect_nats
from lanes_runtime.store import apply_runtime_migrations, create_pool


def die(*_args: Any, **_kwargs: Any) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)


async def main(nats_url: str, database_url: str, job_id: str, point: str) -> None:
    nc = await connect_nats(nats_url, name="crash-child")
    pool = await create_pool(database_url)
    await apply_runtime_migrations(pool)
    await pool.execute(EFFECTS_DDL)
    if point == "ack":
        Msg.ack = die  # type: ignore[method-assign]
    else:
        consumer_module.publish_encoded = die  # type: ignore[attr-defined]
    consumer = consumer_module.EventConsumer(nc, pool, spec_for(job_id), record_effect)
    await consumer.run(asyncio.Event())


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
