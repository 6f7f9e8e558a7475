"""Pre-publishing an event's id (issue 34, item 2), on a real NATS with auth, as the identities that would do it.

JetStream de-duplicates on `Nats-Msg-Id` across every subject of a stream, and a submission's id is
`derived_event_id(job_id, type)`, which anyone can compute. Before: an agent published a heartbeat carrying a
future job's submission id, `lanes submit` printed a sequence (the attacker's message) and exited 0, and the
job never existed; `lanes import` reported `already_present` for events it never stored. Now the publish
checks the message stored under the id and says the id is taken; an import reports a conflict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient
from support.cli import run_lanes_async

from lanes_contract.client import ImportOutcome, LanesClient, connect_nats, import_event, publish_encoded
from lanes_contract.codec import MSG_ID_HEADER, encode
from lanes_contract.errors import EventIdConflictError
from lanes_contract.events import (
    Heartbeat,
    HeartbeatData,
    JobSubmitted,
    JobSubmittedData,
)
from lanes_contract.ids import derived_event_id
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]

SUBMITTED = JobSubmitted.model_fields["type"].default


def submission(job: str, *, name: str = "victim") -> JobSubmitted:
    """The submission the job API makes for `job`: its id derived from the job id, as anyone can compute."""
    spec = JobSpec(name=name, workers=1, gpus_per_worker=1)
    return JobSubmitted(
        id=derived_event_id(job, SUBMITTED), source="lanes/api", jobid=job, attempt=1, data=JobSubmittedData(spec=spec)
    )


async def squat(nats: EmbeddedNats, job: str) -> int:
    """As `agent-node-1`: a rank heartbeat (a subject an agent may write) carrying the future submission's id in
    every header that names it, built by hand as an attacker would; returns its sequence."""
    victim = encode(submission(job))
    beat = Heartbeat(source="agent/node-1", jobid=job, attempt=1, node="node-1", rank=0, data=HeartbeatData(step=1))
    heartbeat = encode(beat)
    headers = {**heartbeat.headers, MSG_ID_HEADER: victim.headers[MSG_ID_HEADER], "ce-id": victim.headers["ce-id"]}
    nc = await connect_nats(nats.url_for("agent-node-1"), name="squatter")
    try:
        ack = await nc.jetstream().publish(heartbeat.subject, heartbeat.payload, headers=headers, stream=JOBS.name)
    finally:
        await nc.close()
    assert not ack.duplicate
    return ack.seq


async def stored_on(nc: NatsClient, subject: str) -> int:
    info = await nc.jetstream().stream_info(JOBS.name, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def test_a_pre_published_id_makes_the_submission_fail_not_pass_as_stored(
    secured_nats: EmbeddedNats, unique: str
) -> None:
    job = f"squatted-{unique}"
    squatted_at = await squat(secured_nats, job)
    async with await LanesClient.connect(secured_nats.url_for("lifecycle"), source="lanes/api") as lifecycle:
        with pytest.raises(EventIdConflictError, match="already used by another event") as refused:
            await lifecycle.publish(submission(job))
        assert f"sequence {squatted_at}" in str(refused.value)
        assert f"lanes.job.{job}.heartbeat" in str(refused.value)
        assert await stored_on(lifecycle._nc, f"lanes.job.{job}.submitted") == 0


async def test_an_honest_re_send_is_still_stored_once(secured_nats: EmbeddedNats, unique: str) -> None:
    """A handler that runs again after a crash builds its derived event anew (another time): that is a re-send."""
    job = f"resent-{unique}"
    async with await LanesClient.connect(secured_nats.url_for("lifecycle"), source="lanes/api") as lifecycle:
        first = await lifecycle.publish(submission(job))
        again = await lifecycle.publish(submission(job))
        assert again == first
        assert await stored_on(lifecycle._nc, f"lanes.job.{job}.submitted") == 1


async def test_the_job_api_answers_a_squatted_submission_with_an_error_and_no_sequence(
    job_api: EmbeddedNats, unique: str
) -> None:
    job = f"api-squatted-{unique}"
    await squat(job_api, job)
    cli = await connect_nats(job_api.url_for("cli"), name="cli")
    try:
        body = {"job_id": job, "spec": {"name": "victim", "workers": 1, "gpus_per_worker": 1}}
        answer = await cli.request("lanes.api.job.submit", json.dumps(body).encode(), timeout=10)
        reply: dict[str, Any] = json.loads(answer.data)
    finally:
        await cli.close()
    assert reply["ok"] is False
    assert "seq" not in reply
    assert "already used by another event" in reply["message"]


async def test_an_import_reports_a_conflict_never_already_present(secured_nats: EmbeddedNats, unique: str) -> None:
    squatted, altered, fresh = f"imp-squat-{unique}", f"imp-alter-{unique}", f"imp-fresh-{unique}"
    await squat(secured_nats, squatted)
    nc = await connect_nats(secured_nats.url_for("cli"), name="lanes-import")
    try:
        js = nc.jetstream()
        # The same id and subject, stored first with other data: an export that does not match the log.
        await publish_encoded(js, encode(submission(altered, name="original")), stream=JOBS.name)
        exported = [encode(submission(job)) for job in (squatted, altered, fresh)]  # each read once from a file
        outcomes = [await import_event(js, event, stream=JOBS.name) for event in exported]
        again = await import_event(js, exported[2], stream=JOBS.name)
    finally:
        await nc.close()
    assert [o.outcome for o in outcomes] == [ImportOutcome.CONFLICT, ImportOutcome.CONFLICT, ImportOutcome.STORED]
    assert "already used by another event" in outcomes[0].detail
    assert "other content" in outcomes[1].detail
    assert again.outcome is ImportOutcome.ALREADY_PRESENT
    assert again.seq == outcomes[2].seq


async def test_lanes_submit_of_a_squatted_job_fails_and_prints_no_sequence(
    secured_nats: EmbeddedNats, unique: str, tmp_path: Path
) -> None:
    """The reproduction as the issue gives it: before, `lanes submit` printed the attacker's sequence, exit 0."""
    job = f"cli-squatted-{unique}"
    await squat(secured_nats, job)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"job_id: {job}\nname: victim\nworkers: 1\ngpus_per_worker: 1\n")
    ran = await run_lanes_async(None, "submit", str(spec), env={"NATS_URL": secured_nats.url_for("cli")})
    assert ran.returncode != 0
    assert ran.stdout == ""
    assert "already used by another event" in ran.stderr
