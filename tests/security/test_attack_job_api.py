"""The job API under auth (issue 34, item 5), with the lifecycle's real JobApi serving as the `lifecycle` identity.

Before: only the admin could send `lanes.api.job.*`, the serving identity could not reply ("permissions violation
for publish to _INBOX..."), and any identity could join the `lanes-job-api` queue group and take half the
requests. Now the CLI asks, the lifecycle answers (once per request: `allow_responses`), and no one else may
ask, listen, or join the group.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from support.waiting import eventually

from lanes_contract.client import connect_nats, denied_operations
from lanes_contract.errors import PermissionDeniedError
from lanes_contract.identities import JOB_API, JOB_API_QUEUE
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]


async def ask(nc: NatsClient, operation: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await nc.request(f"lanes.api.job.{operation}", json.dumps(body).encode(), timeout=10)
    return dict(json.loads(reply.data))


def submission(job: str) -> dict[str, Any]:
    return {"job_id": job, "spec": {"name": "api", "workers": 1, "gpus_per_worker": 1}}


async def refusal_of(nc: NatsClient, fragment: str) -> None:
    async def reported() -> bool:
        return any(fragment.lower() in text.lower() for text in denied_operations(nc))

    await eventually(reported, timeout_s=10.0, what=f"the server to refuse {fragment}")


async def test_the_cli_asks_and_the_lifecycle_answers_under_auth(job_api: EmbeddedNats, unique: str) -> None:
    cli = await connect_nats(job_api.url_for("cli"), name="cli")
    try:
        answered = await ask(cli, "submit", submission(f"api-{unique}"))
    finally:
        await cli.close()
    assert answered["ok"] is True, answered
    assert answered["job_id"] == f"api-{unique}"
    assert answered["seq"] > 0


@pytest.mark.parametrize("identity", ["agent-node-1", "producer", "observer", "scheduler", "router"])
async def test_no_identity_but_the_cli_may_send_a_job_api_request(
    job_api: EmbeddedNats, identity: str, unique: str
) -> None:
    nc = await connect_nats(job_api.url_for(identity), name=identity)
    try:
        with pytest.raises(PermissionDeniedError):
            await nc.request("lanes.api.job.cancel", json.dumps({"job_id": f"x-{unique}"}).encode(), timeout=1.0)
        await refusal_of(nc, 'publish to "lanes.api.job.cancel"')
    finally:
        await nc.close()


@pytest.mark.parametrize("identity", ["agent-node-1", "cli", "producer", "scheduler", "audit"])
async def test_no_identity_but_the_lifecycle_may_join_the_job_api_group_or_overhear_it(
    job_api: EmbeddedNats, identity: str, unique: str
) -> None:
    """An attacker in the queue group would take half the requests; a plain subscriber would see (and could
    answer first) every one. Both subscriptions are refused, and every request is answered by the lifecycle."""
    taken: list[Msg] = []

    async def steal(msg: Msg) -> None:
        taken.append(msg)

    attacker = await connect_nats(job_api.url_for(identity), name=f"thief-{identity}")
    cli = await connect_nats(job_api.url_for("cli"), name="cli")
    try:
        await attacker.subscribe(JOB_API, queue=JOB_API_QUEUE, cb=steal)
        await refusal_of(attacker, f'subscription to "{JOB_API}"')
        await attacker.subscribe("lanes.api.>", cb=steal)
        await refusal_of(attacker, 'subscription to "lanes.api.>"')
        # An unknown operation is answered without the database: what matters is who answers.
        answers = [await ask(cli, f"probe{n}", {"job_id": f"none-{unique}"}) for n in range(6)]
    finally:
        await attacker.close()
        await cli.close()
    assert [answer["error"] for answer in answers] == ["bad_input"] * 6
    assert not taken
