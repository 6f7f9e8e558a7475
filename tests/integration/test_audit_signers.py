"""`lanes audit verify --keyring` end to end: producers sign, the recorder keeps every header in the chain,
and verify names the one event injected with stolen credentials but signed by a role that may not write it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.cli import LANES, run_lanes_async
from support.contract import submission
from support.processes import interruptible
from support.waiting import eventually

from lanes_audit.adapters.signing import Signer
from lanes_audit.domain.chain import ProblemKind
from lanes_audit.entrypoints.recorder import AuditRecorder
from lanes_cli.audit_cli import verify
from lanes_cli.console import EXIT_FAILED
from lanes_contract.client import SIGNING_KEY_ENV, LanesClient, connect_nats
from lanes_contract.events import JobPlaced, JobPlacedData, RankAssignment, RankExited, RankExitedData
from lanes_contract.signing import KEYRING_ENV
from lanes_contract.streams import JOBS
from lanes_runtime.settings import ServerUrls
from lanes_runtime.store import apply_migrations, apply_runtime_migrations, create_pool, migrations_of
from lanes_sandbox.embedded import KEYRING_FILE, EmbeddedNats

pytestmark = pytest.mark.real_servers


def placed(job: str) -> JobPlaced:
    data = JobPlacedData(assignments=(RankAssignment(rank=0, node="node-1", gpus=(0,)),))
    return JobPlaced(source="lanes/scheduler", jobid=job, attempt=1, data=data)


async def _record(nats: EmbeddedNats, database_url: str) -> None:
    pool = await create_pool(database_url)
    nc = await connect_nats(nats.url_for("audit"), name="audit")
    try:
        await apply_runtime_migrations(pool)
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
    assert "signed by cli, whose role may not write lanes.job.stolen-" in forged[3]


def _lanes(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LANES, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_the_readme_walkthrough_signs_and_verifies_clean(tmp_path: Path) -> None:
    # `lanes up`, its export lines pasted into another shell, a submit, then `lanes audit verify` with the
    # keyring the exports name: before, the exports lacked the signing key and verify failed at the submit.
    env = {k: v for k, v in os.environ.items() if k not in {"NATS_URL", "DATABASE_URL", "REDIS_URL"}}
    env = {k: v for k, v in env.items() if k not in {SIGNING_KEY_ENV, KEYRING_ENV}} | {"LANES_LOG_FORMAT": "json"}
    up = subprocess.Popen(
        [LANES, "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=interruptible,  # noqa: PLW1509 - only sets a signal disposition before exec
    )
    try:
        assert up.stdout is not None
        exports: dict[str, str] = {}
        for line in up.stdout:  # the export lines, then the fleet line
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").strip().partition("=")
                exports[name] = value
            elif "Ctrl-C to stop" in line:
                break
        expected = ["NATS_URL", "DATABASE_URL", "REDIS_URL", SIGNING_KEY_ENV, KEYRING_ENV, "LANES_CONSOLE_TOKEN"]
        assert sorted(exports) == sorted(expected)
        assert Path(exports[SIGNING_KEY_ENV]).name == "cli.key"  # the operator's key, not the platform's
        assert Path(exports[KEYRING_ENV]).name == KEYRING_FILE
        shell = env | exports
        spec = tmp_path / "job.yaml"
        spec.write_text("job_id: walkthrough-1\nname: walkthrough\nworkers: 2\ngpus_per_worker: 1\n")
        submitted = _lanes("submit", str(spec), env=shell)
        assert submitted.returncode == 0, submitted.stderr
        submitted_seq = json.loads(submitted.stdout)["seq"]

        deadline = time.monotonic() + 120
        while True:
            shown = _lanes("job", "walkthrough-1", "--json", env=shell)
            if shown.returncode == 0 and json.loads(shown.stdout)["state"] == "released":
                break
            assert time.monotonic() < deadline, shown.stdout + shown.stderr
            time.sleep(0.5)
        while True:  # every verify is clean; wait only for the copy to reach the submit and what followed it
            verified = _lanes("audit", "verify", "--json", env=shell)  # --keyring from LANES_KEYRING
            assert verified.returncode == 0, verified.stdout + verified.stderr
            verdict = json.loads(verified.stdout)
            assert verdict["ok"] is True, verdict
            if verdict["links"] > submitted_seq:
                break
            assert time.monotonic() < deadline, verdict
            time.sleep(0.5)
        assert "audit chain verified" in _lanes("audit", "verify", env=shell).stdout
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=30)
