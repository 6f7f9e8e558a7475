"""`lanes audit verify --keyring` end to end: producers sign, the recorder keeps every header in the chain,
and verify names the one event injected with stolen credentials but signed by a role that may not write it."""

from __future__ import annotations

import asyncio
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.cli import run_lanes_async
from support.contract import submission
from support.waiting import eventually

from lanes_audit.adapters.signing import Signer
from lanes_audit.domain.chain import ProblemKind
from lanes_audit.entrypoints.recorder import AuditRecorder
from lanes_cli.audit_cli import verify
from lanes_cli.console import EXIT_FAILED
from lanes_contract.client import SIGNING_KEY_ENV, LanesClient, connect_nats
from lanes_contract.events import JobPlaced, JobPlacedData, RankAssignment, RankExited, RankExitedData
from lanes_contract.streams import JOBS
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_migrations, create_pool, migrations_of
from lanes_sandbox.embedded import KEYRING_FILE, EmbeddedNats

pytestmark = pytest.mark.real_servers


def placed(job: str) -> JobPlaced:
    data = JobPlacedData(assignments=(RankAssignment(rank=0, node="node-1", gpus=(0,)),))
    return JobPlaced(source="lanes/scheduler", jobid=job, attempt=1, data=data)


async def _record(nats: EmbeddedNats, database_url: str) -> None:
    pool = await create_pool(database_url)
    nc = await connect_nats(nats.url_for("audit"), name="audit")
    try:
        await apply_migrations(pool, "audit", migrations_of("lanes_audit.adapters"))
        recorder = AuditRecorder(nc, pool, signer=Signer(Ed25519PrivateKey.generate()), checkpoint_every=2)
        stop = asyncio.Event()
        task = asyncio.create_task(recorder.run(stop))
        last = (await nc.jetstream().stream_info(JOBS.name)).state.last_seq

        async def caught_up() -> bool:
            return bool(await pool.fetchval("SELECT coalesce(max(seq), 0) >= $1 FROM audit_links", last))

        await eventually(caught_up, timeout_s=60, what="the recorder to reach the end of the stream")
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    finally:
        await nc.close()
        await pool.close()


async def test_verify_names_the_event_signed_by_a_role_that_may_not_write_it(
    secured_nats: EmbeddedNats, urls: ServerUrls, unique: str
) -> None:
    async def signed_as(identity: str, creds: str | None = None) -> LanesClient:
        return await LanesClient.connect(
            secured_nats.url_for(creds or identity),
            source=f"lanes/{identity}",
            signer=secured_nats.signer_for(identity),
        )

    async with await signed_as("scheduler") as scheduler:
        await scheduler.publish(placed(f"job-{unique}"))
    async with await signed_as("agent-node-1") as agent:
        exited = RankExitedData(exit_code=0)
        await agent.publish(
            RankExited(source="agent/node-1", jobid=f"job-{unique}", attempt=1, node="node-1", rank=0, data=exited)
        )
    await _record(secured_nats, urls.database_url)
    clean = await verify(secured_nats.url, urls.database_url, None, secured_nats.keyring)
    assert clean.problem is None, clean.as_json()

    # Stolen `platform` credentials (the server lets them place) with the thief's own `cli` key.
    async with await signed_as("cli", creds="platform") as thief:
        await thief.publish(placed(f"stolen-{unique}"))
    await _record(secured_nats, urls.database_url)
    verdict = await verify(secured_nats.url, urls.database_url, None, secured_nats.keyring)
    assert verdict.problem is not None
    assert verdict.problem.kind is ProblemKind.FORGED
    assert verdict.problem.seq == 3
    assert "signed by cli" in verdict.problem.detail
    # Without the keyring, verify proves completeness only, and the copy is complete.
    assert (await verify(secured_nats.url, urls.database_url, None)).problem is None


async def test_a_forgery_behind_an_earlier_one_is_still_named_as_the_cli_sees_it(
    secured_nats: EmbeddedNats, urls: ServerUrls, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The walkthrough: an unsigned CLI submit first (the exports lacked the key), a forgery later.
    # Verify stopped at the first, so the forgery behind it went unnamed.
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    async with await LanesClient.connect(secured_nats.url_for("cli"), source="lanes/cli") as unsigned:
        await unsigned.publish(submission(f"job-{unique}"))
    async with await LanesClient.connect(
        secured_nats.url_for("scheduler"), source="lanes/scheduler", signer=secured_nats.signer_for("scheduler")
    ) as scheduler:
        await scheduler.publish(placed(f"job-{unique}"))
    async with await LanesClient.connect(
        secured_nats.url_for("platform"), source="lanes/cli", signer=secured_nats.signer_for("cli")
    ) as thief:
        await thief.publish(placed(f"stolen-{unique}"))
    await _record(secured_nats, urls.database_url)

    as_cli = ServerUrls(secured_nats.url_for("cli"), urls.database_url, urls.redis_url)
    keyring = str(secured_nats.credentials_dir / KEYRING_FILE)
    ran = await run_lanes_async(as_cli, "audit", "verify", "--keyring", keyring)
    assert ran.returncode == EXIT_FAILED, ran.stdout + ran.stderr
    assert "forged: 2 (first at sequence 1: lanes.job." in ran.stderr
    assert "; sequences 1, 3" in ran.stderr  # the unsigned submit and, behind it, the stolen placement

    verdict = json.loads((await run_lanes_async(as_cli, "audit", "verify", "--keyring", keyring, "--json")).stdout)
    assert [(kind["kind"], kind["count"], kind["seqs"]) for kind in verdict["problems"]] == [
        ("forged", 2, [[1, 1], [3, 3]])
    ]
    found = await verify(as_cli.nats_url, urls.database_url, None, secured_nats.keyring)
    forged = {problem.seq: problem.detail for problem in found.problems}
    assert set(forged) == {1, 3}
    assert "signed by cli, whose role may not write it" in forged[3]
