"""What `lanes` prints of untrusted text (issue 34): escaped for a terminal, one line per event, JSON exact.

An agent put a colour escape and a newline with a fake `job.finding.v1` line into an evidence summary, and
`lanes timeline` printed both raw. Here every kind of character a terminal acts on goes through the
renderers: each comes out as a visible escape, rich markup in it stays text, and JSON parses back to the
stored value.
"""

from __future__ import annotations

import io
import json
import unicodedata
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from lanes_cli import console as cli_console
from lanes_cli import jobs_cli
from lanes_cli.cli import app
from lanes_cli.html import render_page
from lanes_cli.render import render_job
from lanes_cli.router_cli import _table as requests_table
from lanes_cli.terminal import markup, print_json, print_line, shown
from lanes_cli.timeline import Signature, TimelineEntry, job_header, signature_of
from lanes_contract.codec import encode
from lanes_contract.events import (
    EvidenceCategory,
    EvidenceData,
    JobEvidence,
    JobEvidenceData,
    ManualAction,
    ManualActionData,
    ManualActionRequested,
    RequestServed,
    RequestServedData,
)
from lanes_contract.signing import SIGNATURE_HEADER, SIGNER_HEADER, EventSigner, Keyring

FAKE_LINE = "  #99   12:00:00.000  job.finding.v1               job=j-1 source=lanes/telemetry  all clear"
HOSTILE = (
    f"\x1b[31mred\n{FAKE_LINE}\rcarriage\x00nul\x9bc1\u202eoverride\u2028sep\x07bell\x7fdel [red]markup[/red] :warning:"
)
"""Every kind: ESC, newline plus a fake timeline line, CR, NUL, a C1 control (CSI), a bidi override, a line
separator, BEL, DEL, rich markup and an emoji code."""


def raw_controls(text: str) -> list[str]:
    """Characters a terminal would act on (a line's own ending and a tab are fine)."""
    return [
        char for char in text if char not in "\n\t" and unicodedata.category(char) in {"Cc", "Cf", "Zl", "Zp", "Cs"}
    ]


def plain_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=400, color_system=None, force_terminal=False), buffer


def test_every_control_and_format_character_becomes_a_visible_escape() -> None:
    assert shown(HOSTILE) == (
        f"\\x1b[31mred\\n{FAKE_LINE}\\rcarriage\\x00nul\\x9bc1\\u202eoverride\\u2028sep\\x07bell\\x7fdel"
        " [red]markup[/red] :warning:"
    )
    assert shown("\ud800 \U000e0001") == "\\ud800 \\U000e0001"  # a lone surrogate, a tag character


@pytest.mark.parametrize("text", ["a plain line", "tab\tstays", "é 日本語 Ωmega", "C:\\path\\x1b as typed", ""])
def test_printable_text_and_tabs_are_left_as_they_are(text: str) -> None:
    assert shown(text) == text


def test_markup_in_untrusted_text_stays_text() -> None:
    console, buffer = plain_console()
    said = markup("[red]x[/red] \x1b[2J")
    console.print(f"[bold]{said}[/bold]")
    print_line(console, "[link=http://x]y[/link] :warning:")
    assert buffer.getvalue() == "[red]x[/red] \\x1b[2J\n[link=http://x]y[/link] :warning:\n"


def evidence(summary: str, seq: int) -> TimelineEntry:
    data = JobEvidenceData(
        evidence_id=f"e{seq}",
        evidence=EvidenceData(category=EvidenceCategory.OOM_KILL, summary=summary, lines=(summary,)),
    )
    event = JobEvidence(source="lanes/telemetry", jobid="j-1", attempt=1, node="node-1", rank=0, data=data)
    return TimelineEntry(seq, "lanes.job.j-1.evidence", event, signature=Signature("telemetry", checked=True))


def test_a_hostile_summary_and_reason_print_escaped_on_one_line_each() -> None:
    decision = ManualActionData(action=ManualAction.ABANDON, reason=HOSTILE, requested_by="\x1b]0;owned\x07eve")
    manual = ManualActionRequested(source="lanes/cli", jobid="j-1", attempt=1, data=decision)
    entries = [
        evidence(HOSTILE, 1),
        TimelineEntry(2, "lanes.job.j-1.manual_action", manual, signature=Signature("cli")),
        TimelineEntry(3, "lanes.job.j-1.evidence", None, error=f"bad {HOSTILE}", signature=Signature()),
    ]
    console, buffer = plain_console()
    render_job(console, job_header("j-1", entries), entries)
    printed = buffer.getvalue()

    assert raw_controls(printed) == []
    event_lines = [line for line in printed.splitlines() if line.startswith(("  #", "#"))]
    assert len(event_lines) == len(entries)  # the forged line is inside its event's line, not one of its own
    assert not any(line.startswith("  #99") for line in printed.splitlines())
    first, second, undecodable = sorted(event_lines, key=lambda line: line.split()[0])
    assert f"source=lanes/telemetry signer=telemetry  oom_kill: {shown(HOSTILE)}" in first
    assert "[red]markup[/red] :warning:" in first  # neither markup nor an emoji
    assert "source=lanes/cli signer=cli(unchecked)" in second
    assert "abandon by \\x1b]0;owned\\x07eve: \\x1b[31mred\\n" in second
    assert undecodable.startswith("#3 on lanes.job.j-1.evidence could not be decoded: bad \\x1b[31mred\\n")
    assert undecodable.endswith("signer=unsigned")


def job_view(text: str) -> dict[str, Any]:
    rank = {"rank": 0, "node": f"node-1{text}", "state": "exited", "exit_code": 137, "signal": None}
    attempt = {
        "number": 1,
        "state": "failed",
        "placement": [{"node": f"node-1{text}"}],
        "cause": "oom",
        "cause_detail": text,
        "exit_cause": None,
        "last_checkpoint": None,
        "lost_steps": 0,
        "ranks": {"0": rank},
    }
    return {
        "job_id": "j-1",
        "state": "awaiting_manual",
        "flags": [],
        "spec": {"workers": 1, "gpus_per_worker": 1},
        "wait_reason": None,
        "manual": {"owner": f"team{text}", "deadline": None, "reason": text},
        "attempts": [attempt],
        "time_in_states": {"running": 1.0},
    }


def test_lanes_job_prints_causes_reasons_and_nodes_escaped(monkeypatch: pytest.MonkeyPatch) -> None:
    console, buffer = plain_console()
    monkeypatch.setattr(jobs_cli, "out", console)
    jobs_cli.render_job_view(job_view(HOSTILE))
    printed = buffer.getvalue()
    assert raw_controls(printed) == []
    assert printed.count("\n") == 5  # headline, awaiting, attempt, rank, time in state
    assert f"awaiting team{shown(HOSTILE)} until no deadline: {shown(HOSTILE)}" in printed
    assert f"rank 0 on node-1{shown(HOSTILE)}: exited (exit 137)" in printed


def test_an_error_line_quoting_event_text_is_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit):
        cli_console.fail(f"cannot decode {HOSTILE}", 1)
    said = capsys.readouterr().err
    assert raw_controls(said) == []
    assert said.count("\n") == 1
    assert "\\x1b[31mred" in said
    assert "[red]markup[/red]" in said


def test_json_output_is_ascii_and_parses_back_to_exactly_what_was_stored() -> None:
    console, buffer = plain_console()
    value = {"summary": HOSTILE, "name": "é 日本語", "nested": [{"reason": "\u202e\x9b"}]}
    print_json(console, value)
    printed = buffer.getvalue()
    assert printed.isascii()
    assert raw_controls(printed) == []
    assert json.loads(printed) == value


def test_the_html_page_keeps_event_text_as_data() -> None:
    attack = "</script><script>document.body.dataset.owned='1'</script><!--<script>&amp;"
    row = evidence(attack, 1).as_json()
    page = render_page({"job_id": "j-1", "timeline": [row]})
    data = page.split('<script id="lanes-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert not {"<", ">", "&"} & set(data)  # nothing in it is markup
    assert json.loads(data)["job"]["timeline"][0]["data"]["evidence"]["summary"] == attack
    assert page.count("<script") == 2  # the data and the page's own script, no third one


def signed(signer: EventSigner | None, headers: dict[str, str] | None = None) -> tuple[str, dict[str, str], bytes]:
    encoded = encode(evidence("ok", 1).event)  # type: ignore[arg-type]
    if signer is not None:
        encoded = signer.sign(encoded)
    return encoded.subject, dict(encoded.headers) | (headers or {}), encoded.payload


def test_the_signer_is_read_from_the_header_and_checked_against_a_keyring() -> None:
    telemetry, agent = EventSigner.generate("telemetry"), EventSigner.generate("agent-node-1")
    keyring = Keyring({}).with_key(telemetry).with_key(agent)

    assert signature_of(*signed(None), keyring) == Signature()
    assert signature_of(*signed(telemetry), None) == Signature("telemetry")
    assert signature_of(*signed(telemetry), keyring) == Signature("telemetry", checked=True)

    forged = signature_of(*signed(None, {SIGNER_HEADER: "scheduler:k1", SIGNATURE_HEADER: "Z2FyYmFnZQ=="}), keyring)
    assert forged.signer == "scheduler"
    assert forged.verdict.startswith("refused: signed by scheduler:k1, a key not in the keyring")
    assert forged.label == f"scheduler({forged.verdict})"

    # An agent's valid key, on an event its role may not write: the signature holds, the right does not.
    overreach = signature_of(*signed(agent), keyring)
    assert overreach.signer == "agent-node-1"
    assert overreach.verdict == "refused: signed by agent-node-1, whose role may not write lanes.job.j-1.evidence"


def test_timeline_json_rows_name_the_signer_and_the_verdict() -> None:
    row = evidence("ok", 1).as_json()
    assert (row["source"], row["signer"], row["signature"]) == ("lanes/telemetry", "telemetry", "verified")
    unsigned = TimelineEntry(2, "lanes.job.j-1.evidence", evidence("ok", 2).event).as_json()
    assert (unsigned["signer"], unsigned["signature"]) == (None, "unsigned")


def test_lanes_analyze_shows_a_hostile_log_line_escaped(tmp_path: Path) -> None:
    # A process name is whatever the job chose: the kernel writes it into its OOM line verbatim.
    name = "py\x1b[2J\x9bthon[red]\u202e"
    log = tmp_path / "kernel.log"
    log.write_text(
        "Dec  2 10:20:04 node-2 kernel: [1836245.118950] Out of memory: Killed process 41235 "
        f"({name}) total-vm:245638812kB, anon-rss:1963456000kB, file-rss:0kB, shmem-rss:0kB, UID:1000\n"
    )
    result = CliRunner().invoke(app, ["analyze", str(log), "--year", "2026"])
    assert result.exit_code == 0, result.output
    assert raw_controls(result.stdout) == []
    assert f"> Dec  2 10:20:04 node-2 kernel: [1836245.118950] Out of memory: Killed process 41235 ({shown(name)})" in (
        result.stdout
    )


def test_a_request_id_a_client_chose_is_text_in_the_requests_table() -> None:
    served = RequestServedData(
        request_id="[red]req[/red] [link=http://x]y[/link]",
        model="tiny-chat",
        replica="chat-a",
        route="/v1/chat/completions",
        status="ok",
        http_status=200,
        received_at=datetime(2026, 12, 2, 10, 20, 4, tzinfo=UTC),
        latency_ms=2.0,
    )
    console, buffer = plain_console()
    console.print(requests_table([RequestServed(source="lanes/router", jobid="chat-a", data=served)]))
    assert "[red]req[/red] [link=http://x]y[/link]" in buffer.getvalue()
