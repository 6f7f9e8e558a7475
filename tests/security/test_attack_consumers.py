"""Attacks on the services' durable consumers, as each identity `lanes up` hands out, on a real NATS with auth.

Issue 34, item 1: with `$JS.API.>` open to every identity, a node agent stopped the audit copy
(`CONSUMER.CREATE.LANES_JOBS.audit` with no filter, or `CONSUMER.DELETE.LANES_JOBS.audit`), and deleting
`lifecycle-jobs` or re-filtering `scheduler-jobs` stopped jobs. Each identity now creates, reads, deletes
and pulls only its own durables (by name); a reader creates, pulls and deletes consumers named in the
subject (`read-<random>`), and is denied every durable of the deployment by name. Each attack
here is sent raw (the way an attacker would, not through a helper that could refuse first), and must be
refused by the server, leaving the victim's consumer as it was.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig
from support.waiting import eventually

from lanes_contract.client import LanesClient, connect_nats, denied_operations
from lanes_contract.errors import PermissionDeniedError
from lanes_contract.events import JobSubmitted, JobSubmittedData
from lanes_contract.identities import SERVICE_IDENTITIES, identity_named
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS
from lanes_runtime.reader import Selection, iter_stream
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]

VICTIMS = {"audit": "audit", "lifecycle-jobs": "lifecycle", "scheduler-jobs": "scheduler"}
"""Each attacked durable and the identity that owns it."""
ATTACKERS = ("agent-node-1", "producer", "observer", "cli", "telemetry", "router", "console")
"""A node agent and an outside producer (the hostile cases), and identities that own other consumers or read."""


def durable_config(durable: str) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        filter_subjects=list(JOBS.subjects),
        ack_wait=60.0,
    )


async def connect_as(nats: EmbeddedNats, identity: str) -> NatsClient:
    return await connect_nats(nats.url_for(identity), name=f"as-{identity}")


@pytest.fixture
async def victims(secured_nats: EmbeddedNats) -> EmbeddedNats:
    """The attacked durables, each created by its owner (which also proves an owner may create its own)."""
    for durable, owner in VICTIMS.items():
        nc = await connect_as(secured_nats, owner)
        try:
            await nc.jetstream().add_consumer(JOBS.name, config=durable_config(durable))
        finally:
            await nc.close()
    return secured_nats


async def assert_refused(nc: NatsClient, subject: str, body: Mapping[str, object] | None = None) -> None:
    """The server refuses a request this identity may not send (it drops it and reports the violation)."""
    with pytest.raises(PermissionDeniedError):
        await nc.request(subject, json.dumps(body or {}).encode(), timeout=1.0)

    async def reported() -> bool:
        return any(f'"{subject.lower()}"' in text.lower() for text in denied_operations(nc))

    await eventually(reported, timeout_s=10.0, what=f"the server to refuse {subject}")


async def assert_untouched(nats: EmbeddedNats) -> None:
    """Every victim still exists as its owner made it (read as the admin)."""
    admin = await connect_nats(nats.url, name="inspector")
    try:
        for durable in VICTIMS:
            info = await admin.jetstream().consumer_info(JOBS.name, durable)
            assert info.config.filter_subjects == list(JOBS.subjects), durable
            assert info.config.durable_name == durable
    finally:
        await admin.close()


def attacks(durable: str) -> dict[str, tuple[str, Mapping[str, object]]]:
    """The reproductions of issue 34 against one durable, as raw JetStream API requests."""
    stream = JOBS.name

    def re_filtered(filter_subject: str) -> Mapping[str, object]:
        return {
            "stream_name": stream,
            "config": {"name": durable, "ack_policy": "explicit", "filter_subject": filter_subject},
        }

    return {
        "re-filter through the named create": (f"$JS.API.CONSUMER.CREATE.{stream}.{durable}", re_filtered("")),
        "re-filter through the named create with a filter token": (
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.lanes.job.nothing",
            re_filtered("lanes.job.nothing"),
        ),
        "re-filter through the legacy durable create": (
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            {"stream_name": stream, "config": {"durable_name": durable, "ack_policy": "explicit"}},
        ),
        "delete": (f"$JS.API.CONSUMER.DELETE.{stream}.{durable}", {}),
        "pull its messages away": (f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", {"batch": 10, "no_wait": True}),
        "read its state": (f"$JS.API.CONSUMER.INFO.{stream}.{durable}", {}),
    }


@pytest.mark.parametrize("attacker", ATTACKERS)
async def test_no_identity_may_re_filter_delete_or_pull_another_identitys_durable(
    victims: EmbeddedNats, attacker: str
) -> None:
    identity = identity_named(attacker)
    assert identity is not None
    nc = await connect_as(victims, attacker)
    try:
        await asyncio.gather(
            *(
                assert_refused(nc, subject, body)
                for durable in VICTIMS
                for subject, body in attacks(durable).values()
                # a reader may ask about any consumer (its own ordered ones have names the server made up)
                if not (identity.reads and subject.startswith("$JS.API.CONSUMER.INFO."))
            )
        )
    finally:
        await nc.close()
    await assert_untouched(victims)


@pytest.mark.parametrize(
    "attacker",
    ["agent-node-1", "producer", "observer", "scheduler", "lifecycle", "telemetry", "audit", "cli", "router"],
)
async def test_no_identity_may_create_a_consumer_that_names_a_durable_in_its_body(
    victims: EmbeddedNats, attacker: str
) -> None:
    """The unnamed create takes the consumer's name from the body: `{"name": "audit", ...}` re-filtered the audit
    copy (the server updates an existing consumer there). Before, every reader could send it; now no one but the
    admin may (readers name their consumers in the subject)."""
    nc = await connect_as(victims, attacker)
    try:
        body: Mapping[str, object] = {
            "stream_name": JOBS.name,
            "config": {"name": "audit", "ack_policy": "explicit", "ack_wait": 60_000_000_000, "filter_subject": ""},
        }
        await assert_refused(nc, f"$JS.API.CONSUMER.CREATE.{JOBS.name}", body)
    finally:
        await nc.close()
    await assert_untouched(victims)


@pytest.mark.parametrize("reader", ["cli", "router"])
async def test_a_reader_cannot_reach_a_durable_through_a_body_that_names_it_under_a_name_of_its_own(
    victims: EmbeddedNats, reader: str
) -> None:
    """A reader may create consumers named in the subject; the name in the subject is the one the server uses."""
    nc = await connect_as(victims, reader)
    try:
        for config in ({"name": "audit"}, {"durable_name": "audit"}):
            body = {"stream_name": JOBS.name, "config": {**config, "ack_policy": "explicit", "filter_subject": ""}}
            answer = await nc.request(f"$JS.API.CONSUMER.CREATE.{JOBS.name}.read-mine", json.dumps(body).encode())
            reply = json.loads(answer.data)
            if "error" not in reply:  # refused, or made under the subject's name: never the body's
                assert reply["name"] == "read-mine", reply
                assert await nc.jetstream().delete_consumer(JOBS.name, "read-mine")
    finally:
        await nc.close()
    await assert_untouched(victims)


async def test_a_forged_ack_on_another_identitys_consumer_is_refused(victims: EmbeddedNats, unique: str) -> None:
    """An ack (or +TERM) names the consumer in its subject: an agent could otherwise skip the audit's messages."""
    nc = await connect_as(victims, "agent-node-1")
    try:
        forged = f"$JS.ACK.{JOBS.name}.audit.1.1.1.0.0"
        await nc.publish(forged, b"+TERM")

        async def reported() -> bool:
            return any(f'"{forged.lower()}"' in text.lower() for text in denied_operations(nc))

        await eventually(reported, timeout_s=10.0, what="the forged ack to be refused")
    finally:
        await nc.close()
    del unique


@pytest.mark.parametrize("identity", [i.name for i in SERVICE_IDENTITIES if i.durables])
async def test_each_service_creates_reads_pulls_acks_and_deletes_its_own_durables(
    secured_nats: EmbeddedNats, identity: str, unique: str
) -> None:
    owner = identity_named(identity)
    assert owner is not None
    async with await LanesClient.connect(secured_nats.url_for("cli"), source="lanes/cli") as cli:
        job = f"own-{unique}"
        spec = JobSpec(name="own", workers=1, gpus_per_worker=1)
        await cli.publish(JobSubmitted(source="lanes/cli", jobid=job, attempt=1, data=JobSubmittedData(spec=spec)))
    nc = await connect_as(secured_nats, identity)
    try:
        js = nc.jetstream(timeout=5.0)
        for durable in owner.durables:
            config = ConsumerConfig(
                durable_name=durable, ack_policy=AckPolicy.EXPLICIT, filter_subjects=[f"lanes.job.{job}.>"]
            )
            await js.add_consumer(JOBS.name, config=config)
            assert (await js.consumer_info(JOBS.name, durable)).num_pending == 1
            sub = await js.pull_subscribe_bind(durable, stream=JOBS.name)
            (msg,) = await sub.fetch(1, timeout=5.0)
            await msg.ack_sync()
            await sub.unsubscribe()
            # A service may hear about its own consumer (a loop that heals listens for its deletion).
            deleted = await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.DELETED.{JOBS.name}.{durable}")
            assert await js.delete_consumer(JOBS.name, durable)
            assert (await deleted.next_msg(timeout=20.0)).subject.endswith(f".{durable}")
            await deleted.unsubscribe()
    finally:
        await nc.close()
    assert not denied_operations(nc)


@pytest.mark.parametrize("identity", ["cli", "router", "platform"])
async def test_a_reader_replays_the_log_through_a_consumer_of_its_own_and_leaves_none_behind(
    secured_nats: EmbeddedNats, identity: str, unique: str
) -> None:
    job = f"read-{unique}"
    async with await LanesClient.connect(secured_nats.url_for("cli"), source="lanes/cli") as cli:
        spec = JobSpec(name="read", workers=1, gpus_per_worker=1)
        await cli.publish(JobSubmitted(source="lanes/cli", jobid=job, attempt=1, data=JobSubmittedData(spec=spec)))
    nc = await connect_as(secured_nats, identity)
    try:
        read = [msg.subject async for msg in iter_stream(nc.jetstream(), Selection(JOBS.name, f"lanes.job.{job}.>"))]
    finally:
        await nc.close()
    assert read == [f"lanes.job.{job}.submitted"]
    assert not denied_operations(nc)
    admin = await connect_nats(secured_nats.url, name="inspector")
    try:
        left = [c.name for c in await admin.jetstream().consumers_info(JOBS.name) if c.name.startswith("read-")]
    finally:
        await admin.close()
    assert left == []
