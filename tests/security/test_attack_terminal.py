"""Hostile text and forged sources on a real NATS, read back by `lanes timeline` and `lanes incident` (issue 34).

The reproductions: an agent put a colour escape and a newline with a fake `job.finding.v1` line into an
evidence summary, and `lanes timeline` printed both raw; a `rank_exited` forged from `agent-node-1`'s
connection with `ce-source: lanes/scheduler` and a garbage `Lanes-Signer` showed as `source=lanes/scheduler`.
Here the same events are stored as each identity would publish them (the telemetry service copies an
agent's evidence summary verbatim), with `--reason` / `--by` of `lanes recover` carrying the same text.
Every command prints one line per event, no raw control character, and the signer next to the claimed
source; JSON output parses back to exactly what was stored.
"""

from __future__ import annotations

import json
import unicodedata

import pytest
from support.cli import run_lanes

from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.codec import encode
from lanes_contract.events import (
    EvidenceCategory,
    EvidenceData,
    FindingCause,
    JobEvidence,
    JobEvidenceData,
    JobFinding,
    JobFindingData,
    JobSubmitted,
    JobSubmittedData,
    Lane,
    RankExited,
    RankExitedData,
)
from lanes_contract.jobs import JobSpec
from lanes_contract.signing import SIGNATURE_HEADER, SIGNER_HEADER
from lanes_contract.streams import JOBS
from lanes_sandbox.embedded import KEYRING_FILE, EmbeddedNats

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]

FAKE_LINE = "  #99   12:00:00.000  job.finding.v1               job={job} source=lanes/telemetry  all clear"
HOSTILE = "\x1b[31mred\n{fake}\rcarriage\x00nul\x9bc1\u202eoverride [red]markup[/red]"
"""ESC (a colour), a newline and a fake timeline line, CR, NUL, a C1 CSI, a bidi override and rich markup."""
SHOWN = "\\x1b[31mred\\n{fake}\\rcarriage\\x00nul\\x9bc1\\u202eoverride [red]markup[/red]"
"""How `lanes timeline` prints it."""


def raw_controls(text: str) -> list[str]:
    """Characters a terminal would act on (a line's own ending is fine)."""
    return [char for char in text if char != "\n" and unicodedata.category(char) in {"Cc", "Cf", "Zl", "Zp"}]


async def store_hostile_timeline(nats: EmbeddedNats, job: str, hostile: str) -> None:
    """A submitted job, evidence and a finding with the hostile text, and the forged rank exit of the reproduction."""
    spec = JobSpec(name="terminal", workers=1, gpus_per_worker=1)
    for identity, event in (
        ("cli", JobSubmitted(source="lanes/cli", jobid=job, data=JobSubmittedData(spec=spec))),
        (
            "telemetry",
            JobEvidence(
                source="lanes/telemetry",
                jobid=job,
                attempt=1,
                node="node-1",
                rank=0,
                data=JobEvidenceData(
                    evidence_id="e-1",
                    evidence=EvidenceData(category=EvidenceCategory.OOM_KILL, summary=hostile, lines=(hostile,)),
                ),
            ),
        ),
        (
            "telemetry",
            JobFinding(
                source="lanes/telemetry",
                jobid=job,
                attempt=1,
                data=JobFindingData(
                    version=1,
                    first_error=FindingCause(
                        category="oom_kill", lane=Lane.HOST, node="node-1", rank=0, summary=hostile, evidence=(hostile,)
                    ),
                    stage="runtime",
                    confidence=0.9,
                    owner=hostile,
                ),
            ),
        ),
    ):
        async with await LanesClient.connect(
            nats.url_for(identity), source=event.source, signer=nats.signer_for(identity)
        ) as client:
            await client.publish(event)
    forged = RankExited(
        source="lanes/scheduler", jobid=job, attempt=1, node="node-1", rank=0, data=RankExitedData(exit_code=1)
    )
    encoded = encode(forged)
    headers = dict(encoded.headers) | {SIGNER_HEADER: "scheduler:k1-forged", SIGNATURE_HEADER: "AAAA"}
    nc = await connect_nats(nats.url_for("agent-node-1"), name="as-agent-node-1")
    try:
        await nc.jetstream().publish(encoded.subject, encoded.payload, headers=headers, stream=JOBS.name)
    finally:
        await nc.close()


async def test_hostile_text_prints_escaped_one_line_per_event_with_the_signer_beside_the_source(
    secured_nats: EmbeddedNats, unique: str
) -> None:
    job = f"terminal-{unique}"
    fake = FAKE_LINE.format(job=job)
    hostile, shown = HOSTILE.format(fake=fake), SHOWN.format(fake=fake)
    await store_hostile_timeline(secured_nats, job, hostile)
    env: dict[str, str | None] = {
        "NATS_URL": secured_nats.url_for("cli"),
        "LANES_SIGNING_KEY_FILE": str(secured_nats.credentials_dir / "cli.key"),
        "LANES_KEYRING": str(secured_nats.credentials_dir / KEYRING_FILE),
    }

    # The operator's own `--reason` and `--by`, echoed back as ASCII JSON and stored exactly.
    recovered = run_lanes(None, "recover", job, "--abandon", "--reason", hostile, "--by", f"eve{hostile}", env=env)
    assert recovered.returncode == 0, recovered.stderr
    assert recovered.stdout.isascii()
    assert json.loads(recovered.stdout)["reason"] == hostile

    shown_timeline = run_lanes(None, "timeline", job, env=env)
    assert shown_timeline.returncode == 0, shown_timeline.stderr
    printed = shown_timeline.stdout
    assert raw_controls(printed) == []
    rows = [line for line in printed.splitlines() if line.startswith("  #")]
    assert len(rows) == 5  # submitted, evidence, finding, the forged exit, the manual action: the fake line is none
    assert not any(line.lstrip().startswith("#99") for line in printed.splitlines())
    (evidence,) = [row for row in rows if "job.evidence.v1" in row]
    assert evidence.endswith(f"source=lanes/telemetry signer=telemetry  oom_kill: {shown}")
    (forged,) = [row for row in rows if "job.rank_exited.v1" in row]
    assert "source=lanes/scheduler signer=scheduler(refused: signed by scheduler:k1-forged, a key not in" in forged
    (manual,) = [row for row in rows if "job.manual_action.v1" in row]
    assert f"source=lanes/cli signer=cli  abandon by eve{shown}: {shown}" in manual

    as_json = run_lanes(None, "timeline", job, "--json", env=env)
    assert as_json.returncode == 0, as_json.stderr
    assert as_json.stdout.isascii()
    timeline = json.loads(as_json.stdout)["timeline"]
    by_type = {row["type"].split(".")[-2]: row for row in timeline}
    assert by_type["evidence"]["data"]["evidence"]["summary"] == hostile  # exact, byte for byte
    assert (by_type["evidence"]["signer"], by_type["evidence"]["signature"]) == ("telemetry", "verified")
    assert by_type["rank_exited"]["source"] == "lanes/scheduler"
    assert by_type["rank_exited"]["signer"] == "scheduler"
    assert by_type["rank_exited"]["signature"].startswith("refused: signed by scheduler:k1-forged")

    incident = run_lanes(None, "incident", job, env=env)
    assert incident.returncode == 0, incident.stderr
    assert incident.stdout.isascii()
    assert raw_controls(incident.stdout) == []
    bundle = json.loads(incident.stdout)
    assert bundle["summary"]["first_error"]["detail"] == hostile  # what was stored, exactly
    assert bundle["summary"]["owner"] == hostile

    # Without a keyring the header is only a claim, and the row says so.
    unchecked = run_lanes(None, "timeline", job, env=env | {"LANES_KEYRING": None})
    assert unchecked.returncode == 0, unchecked.stderr
    assert "source=lanes/scheduler signer=scheduler(unchecked)" in unchecked.stdout
    assert "source=lanes/telemetry signer=telemetry(unchecked)" in unchecked.stdout
