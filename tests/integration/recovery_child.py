"""Child process for recovery's crash test: the recovery service (consumer and timers) SIGKILLing itself mid-decision.

Usage: recovery_child.py NATS_URL DATABASE_URL DURABLE JOB_IDS POINT
JOB_IDS is comma-separated. POINT says where the process dies, the first time it gets there:
- decide: the decision is made and written to PostgreSQL, the transaction not yet committed;
- publish: the transaction committed, the decision not yet published;
- published: the decision published, the outbox row not yet deleted and the event not acknowledged;
- none: it runs until killed by the test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent))

import lanes_runtime.consumer as consumer_module
from lanes_contract.client import connect_nats, publish_encoded
from lanes_recovery.adapters import repository
from lanes_recovery.adapters.policies import default_policy
from lanes_recovery.entrypoints.service import consumer_for_jobs, recovery_service
from lanes_recovery.entrypoints.timers import RecoveryTimers
from lanes_recovery.service_layer.handlers import Recovery
from lanes_runtime.consumer import EventConsumer
from lanes_runtime.store import apply_migrations, apply_runtime_migrations, create_pool


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    if point == "decide":
        record = repository.record_decision

        async def record_then_die(*args: Any, **kwargs: Any) -> None:
            await record(*args, **kwargs)
            die()

        repository.record_decision = record_then_die
    elif point in {"publish", "published"}:

        async def publish(js: Any, encoded: Any, **kwargs: Any) -> Any:
            deciding = encoded.subject.endswith(".recovery_decided")
            if deciding and point == "publish":
                die()
            stored = await publish_encoded(js, encoded, **kwargs)
            if deciding:
                die()
            return stored

        consumer_module.publish_encoded = publish  # type: ignore[attr-defined]


async def main(nats_url: str, database_url: str, durable: str, job_ids: str, point: str) -> None:
    arm(point)
    nc = await connect_nats(nats_url, name=f"recovery-child-{os.getpid()}")
    pool = await create_pool(database_url)
    await apply_runtime_migrations(pool)
    service = recovery_service(default_policy)
    assert service.migrations is not None
    await apply_migrations(pool, service.name, service.migrations)
    spec = dataclasses.replace(
        consumer_for_jobs(tuple(job_ids.split(",")), durable),
        ack_wait_s=1.0,
        redelivery_delays_s=(0.2,),
        max_deliver=50,
    )
    recovery = Recovery(default_policy)
    print("ready", flush=True)  # noqa: T201 - the parent waits for this line
    forever = asyncio.Event()
    await asyncio.gather(
        EventConsumer(nc, pool, spec, recovery.handle_job_event).run(forever),
        RecoveryTimers(nc, pool, recovery, tick_s=0.1).run(forever),
    )


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
