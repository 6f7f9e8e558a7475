"""Who may write the timeline: per-identity permissions on a real NATS server with auth on.

The attacks of issue 16, replayed against the server: an anonymous client, a forged placement and a forged
rank exit from identities that may not write them, an agent speaking for another node, and a stream cut
short (`update_stream(max_msgs=10)`), purged or deleted by anyone but the admin.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest
from nats.js.errors import NotFoundError

from lanes_audit.views import ProblemKind, SignedMessage, check_signers
from lanes_contract.client import LanesClient, connect_nats, denied_operations
from lanes_contract.errors import AuthenticationError, PermissionDeniedError
from lanes_contract.events import (
    EvidenceCategory,
    EvidenceData,
    JobPlaced,
    JobPlacedData,
    RankAssignment,
    RankExited,
    RankExitedData,
    RawEvidence,
    ResourcesReleased,
    ResourcesReleasedData,
)
from lanes_contract.identities import (
    PEOPLE_IDENTITIES,
    PLATFORM,
    SERVICE_IDENTITIES,
    agent_identity,
    may_publish,
)
from lanes_contract.signing import Keyring
from lanes_contract.streams import ALL_STREAMS, DEAD, JOBS
from lanes_runtime.reader import Selection, iter_stream
from lanes_sandbox.embedded import KEYRING_FILE, EmbeddedNats

pytestmark = pytest.mark.asyncio

NON_ADMIN = ("scheduler", "lifecycle", "audit", "cli", "producer", "platform", "agent-node-1")
"""One of each kind: every non-admin permission is built by the same rule (`nats_permissions`)."""


@contextlib.asynccontextmanager
async def client_as(nats: EmbeddedNats, identity: str, source: str) -> AsyncIterator[LanesClient]:
    async with await LanesClient.connect(nats.url_for(identity), source=source) as client:
        yield client


async def stored_on(nats: EmbeddedNats, subject: str) -> int:
    """How many messages the job stream holds on `subject` (read as the admin)."""
    nc = await connect_nats(nats.url, name="inspector")
    try:
        info = await nc.jetstream().stream_info(JOBS.name, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


def placement(job: str) -> JobPlaced:
    assignments = (RankAssignment(rank=0, node="node-1", gpus=(0,)),)
    return JobPlaced(source="lanes/scheduler", jobid=job, attempt=1, data=JobPlacedData(assignments=assignments))


def rank_exit(job: str, node: str) -> RankExited:
    return RankExited(source=f"agent/{node}", jobid=job, attempt=1, node=node, rank=0, data=RankExitedData(exit_code=0))


async def test_a_connection_without_credentials_or_with_a_wrong_password_is_refused(
    secured_nats: EmbeddedNats,
) -> None:
    with pytest.raises(AuthenticationError, match="without credentials"):
        await connect_nats(secured_nats.address, name="anonymous")
    wrong = secured_nats.url_for("cli").replace("@", "-guessed@")
    with pytest.raises(AuthenticationError, match="'cli'") as refused:
        await connect_nats(wrong, name="guesser")
    assert "-guessed" not in str(refused.value)  # the message never repeats a password


@pytest.mark.parametrize("identity", ["cli", "producer", "lifecycle", "agent-node-1"])
async def test_only_the_scheduler_places_a_forged_placement_is_refused_by_the_server(
    secured_nats: EmbeddedNats, unique: str, identity: str
) -> None:
    forged = placement(f"forged-{unique}")
    async with client_as(secured_nats, identity, "lanes/scheduler") as client:
        with pytest.raises(PermissionDeniedError, match=r"lanes\.job\..*\.placed"):
            await client.publish(forged)
    assert await stored_on(secured_nats, forged.nats_subject()) == 0

    async with client_as(secured_nats, "scheduler", "lanes/scheduler") as scheduler:
        genuine = placement(f"genuine-{unique}")
        assert await scheduler.publish(genuine) > 0
        released = ResourcesReleased(
            source="lanes/scheduler",
            jobid=genuine.job_key,
            attempt=1,
            data=ResourcesReleasedData(nodes=("node-1",), gpus=1),
        )
        assert await scheduler.publish(released) > 0


@pytest.mark.parametrize("identity", ["cli", "scheduler", "lifecycle", "recovery", "router"])
async def test_a_forged_rank_exit_from_anyone_but_an_agent_is_refused(
    secured_nats: EmbeddedNats, unique: str, identity: str
) -> None:
    forged = rank_exit(f"stuck-{unique}", "node-1")
    async with client_as(secured_nats, identity, "agent/node-1") as client:
        with pytest.raises(PermissionDeniedError, match="rank_exited"):
            await client.publish(forged)
    assert await stored_on(secured_nats, forged.nats_subject()) == 0


async def test_an_agent_speaks_only_for_its_own_node(secured_nats: EmbeddedNats, unique: str) -> None:
    def evidence_on(node: str) -> RawEvidence:
        data = EvidenceData(category=EvidenceCategory.RAW, summary=f"probe {unique}")
        return RawEvidence(source="agent/node-1", node=node, jobid=f"job-{unique}", data=data)

    async with client_as(secured_nats, "agent-node-1", "agent/node-1") as agent:
        assert await agent.publish(evidence_on("node-1")) > 0
        with pytest.raises(PermissionDeniedError, match=r"lanes\.tel\.node-2\."):
            await agent.publish(evidence_on("node-2"))
        assert await agent.publish(rank_exit(f"job-{unique}", "node-1")) > 0


@pytest.mark.parametrize("identity", NON_ADMIN)
async def test_no_identity_but_the_admin_may_cut_purge_delete_or_create_a_stream(
    secured_nats: EmbeddedNats, unique: str, identity: str
) -> None:
    nc = await connect_nats(secured_nats.url_for(identity), name=f"attacker-{identity}")
    try:
        js = nc.jetstream(timeout=1.0)
        jobs = (await js.stream_info(JOBS.name)).config
        attacks: dict[str, Callable[[], Awaitable[object]]] = {
            "truncate": lambda: js.update_stream(replace(jobs, max_msgs=10)),
            "purge": lambda: js.purge_stream(DEAD.name),
            "delete": lambda: js.delete_stream(DEAD.name),
            "create": lambda: js.add_stream(name=f"ROGUE_{unique}", subjects=[f"rogue.{unique}.>"]),
        }
        for attack, run in attacks.items():
            # The server drops a request this identity may not send and says so: refused at once, typed.
            with pytest.raises(PermissionDeniedError):
                await run()
            assert any("$js.api.stream" in text.lower() for text in denied_operations(nc)), attack
    finally:
        await nc.close()

    admin = await connect_nats(secured_nats.url, name="admin-check")
    try:
        ajs = admin.jetstream()
        for spec in ALL_STREAMS:
            config = (await ajs.stream_info(spec.name)).config
            assert config.max_msgs in {None, -1}, f"{spec.name} was cut to {config.max_msgs}"
        with pytest.raises(NotFoundError):
            await ajs.stream_info(f"ROGUE_{unique}")
    finally:
        await admin.close()


async def test_the_admin_may_manage_streams(secured_nats: EmbeddedNats, unique: str) -> None:
    admin = await connect_nats(secured_nats.url, name="admin")
    try:
        js = admin.jetstream()
        await js.add_stream(name=f"SCRATCH_{unique}", subjects=[f"scratch.{unique}.>"])
        await js.delete_stream(f"SCRATCH_{unique}")
    finally:
        await admin.close()


async def test_every_identity_may_publish_each_subject_of_its_role(secured_nats: EmbeddedNats, unique: str) -> None:
    """The table is what the server enforces: each allowed subject (wildcards filled in) is stored."""
    for identity in (*SERVICE_IDENTITIES, *PEOPLE_IDENTITIES, PLATFORM, agent_identity("node-1")):
        nc = await connect_nats(secured_nats.url_for(identity.name), name=identity.name)
        try:
            js = nc.jetstream(timeout=5.0)
            for pattern in identity.publishes:
                subject = pattern.replace("*", f"k{unique}").replace(">", f"probe.{unique}")
                assert may_publish(identity, subject)
                ack = await js.publish(subject, b"{}")
                assert ack.seq > 0, (identity.name, subject)
        finally:
            await nc.close()


async def test_an_injection_with_stolen_credentials_of_the_wrong_role_is_flagged_by_the_signer_check(
    secured_nats: EmbeddedNats, unique: str
) -> None:
    """`platform` credentials stolen (the server lets them place), used with the thief's own `cli` key:
    the server stores the placement, and the audit's signer check names it, while the genuine one passes."""
    genuine_job, forged_job = f"genuine-{unique}", f"forged-{unique}"
    async with await LanesClient.connect(
        secured_nats.url_for("scheduler"), source="lanes/scheduler", signer=secured_nats.signer_for("scheduler")
    ) as scheduler:
        await scheduler.publish(placement(genuine_job))
    async with await LanesClient.connect(
        secured_nats.url_for("platform"), source="lanes/scheduler", signer=secured_nats.signer_for("cli")
    ) as thief:
        await thief.publish(placement(forged_job))

    nc = await connect_nats(secured_nats.url, name="auditor")
    try:
        messages = [
            SignedMessage(msg.metadata.sequence.stream, msg.subject, msg.headers, msg.data)
            async for msg in iter_stream(nc.jetstream(), Selection(JOBS.name, "lanes.job.*.placed"))
            if msg.subject.split(".")[2] in {genuine_job, forged_job}
        ]
    finally:
        await nc.close()
    assert len(messages) == 2
    keyring = Keyring.load(secured_nats.credentials_dir / KEYRING_FILE)
    assert check_signers(messages[:1], keyring) == []
    (problem,) = check_signers(messages, keyring)
    assert problem.kind is ProblemKind.FORGED
    assert forged_job in problem.detail
    assert "signed by cli" in problem.detail
