"""The live console on a real NATS server with every identity: its pages, its live feeds, and what it refuses.

The console connects as its own `console` identity (read-only), so every test here also shows that reading
through ephemeral consumers is all it needs. Events are published as the platform, as `lanes up` does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import tarfile
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client as NatsClient
from playwright.async_api import Browser, Page, async_playwright
from support.cli import LANES, run_lanes
from support.optional import CHROMIUM, chromium, require
from support.processes import interruptible
from support.waiting import eventually

from lanes_console.app import PAGE_ROWS, Operator, serve
from lanes_console.incident import BUNDLE_FILES
from lanes_console.viewers import tenant_keys
from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.errors import PermissionDeniedError
from lanes_contract.events import (
    AttemptRequested,
    AttemptRequestedData,
    EvidenceCategory,
    EvidenceData,
    FindingCause,
    Heartbeat,
    HeartbeatData,
    HostEvidence,
    JobEvidence,
    JobEvidenceData,
    JobFinding,
    JobFindingData,
    JobPlaced,
    JobPlacedData,
    JobSubmitted,
    JobSubmittedData,
    Lane,
    NodeRegistered,
    NodeRegisteredData,
    NodeStateChanged,
    NodeStateChangedData,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    RecoveryAction,
    RecoveryDecided,
    RecoveryDecidedData,
    ReplicaListening,
    ReplicaListeningData,
    RequestServed,
    RequestServedData,
)
from lanes_contract.jobs import JobSpec
from lanes_contract.streams import JOBS
from lanes_contract.topology import NodeState
from lanes_runtime.reader import READER_PREFIX
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = [pytest.mark.asyncio, pytest.mark.real_servers]
READ_BOUND_S = 30.0
"""How long a test waits for an event it expects on a feed before failing (a bound, not a measurement)."""


@dataclass
class Console:
    url: str
    nats: EmbeddedNats
    publisher: LanesClient
    reader: NatsClient


@pytest.fixture
async def console(secured_nats: EmbeddedNats) -> AsyncIterator[Console]:
    """The console served on a free port as the `console` identity; a platform client to publish with."""
    reader = await connect_nats(secured_nats.url_for("console"), name="console")
    publisher = await LanesClient.connect(
        secured_nats.url_for("platform"), source="lanes/tests", signer=secured_nats.signer_for("platform")
    )
    runner, url = await serve(reader, "127.0.0.1", 0)
    try:
        yield Console(url, secured_nats, publisher, reader)
    finally:
        await runner.cleanup()
        await publisher.close()
        await reader.close()


def submitted(job_id: str) -> JobSubmitted:
    spec = JobSpec(name="train", workers=2, gpus_per_worker=1)
    return JobSubmitted(source="lanes/tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))


def started(job_id: str, rank: int) -> RankStarted:
    return RankStarted(
        source="lanes/tests", jobid=job_id, attempt=1, node="node-1", rank=rank, data=RankStartedData(pid=100 + rank)
    )


def exited(job_id: str, rank: int, code: int) -> RankExited:
    return RankExited(
        source="lanes/tests", jobid=job_id, attempt=1, node="node-1", rank=rank, data=RankExitedData(exit_code=code)
    )


def evidence(job_id: str, summary: str) -> JobEvidence:
    found = EvidenceData(category=EvidenceCategory.OOM_KILL, summary=summary, lines=(summary,))
    return JobEvidence(
        source="lanes/tests",
        jobid=job_id,
        attempt=1,
        node="node-2",
        rank=1,
        data=JobEvidenceData(evidence_id=f"e-{job_id}", evidence=found),
    )


def finding(job_id: str, version: int) -> JobFinding:
    cause = FindingCause(category="oom_kill", lane=Lane.HOST, node="node-2", rank=1, summary="rank 1 OOM-killed")
    data = JobFindingData(version=version, first_error=cause, stage="steady_state", confidence=0.9, settled=True)
    return JobFinding(source="lanes/telemetry", jobid=job_id, attempt=1, lane=Lane.HOST, data=data)


@dataclass
class SseEvent:
    event: str
    data: Any
    id: str | None


class Feed:
    """An SSE response read event by event (`event:`, `id:`, `data:` lines, a blank line ends one)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.raw: list[str] = []

    async def next(self) -> SseEvent:
        fields: dict[str, str] = {}
        while True:
            line = (await asyncio.wait_for(self.response.content.readline(), READ_BOUND_S)).decode()
            assert line, "the feed ended"
            self.raw.append(line)
            line = line.rstrip("\n")
            if not line:
                if "data" in fields:
                    return SseEvent(fields.get("event", "message"), json.loads(fields["data"]), fields.get("id"))
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            assert name not in fields, f"a second {name!r} line in one event: {line!r}"
            fields[name] = value

    async def until(self, event: str) -> list[SseEvent]:
        """Every event up to and including the next one named `event`."""
        seen: list[SseEvent] = []
        while not seen or seen[-1].event != event:
            seen.append(await self.next())
        return seen

    async def next_named(self, event: str) -> SseEvent:
        return (await self.until(event))[-1]


async def open_feed(session: aiohttp.ClientSession, url: str, **headers: str) -> Feed:
    response = await session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_read=None))
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return Feed(response)


def rows_of(events: list[SseEvent]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.event == "row"]


async def publish(console: Console, *events: Any) -> list[int]:
    return [await console.publisher.publish(event) for event in events]


async def test_a_job_feed_replays_the_timeline_then_pushes_a_new_event_as_it_is_stored(
    console: Console, unique: str
) -> None:
    job = f"live-{unique}"
    seqs = await publish(console, submitted(job), started(job, 0), started(job, 1))
    async with aiohttp.ClientSession() as session:
        feed = await open_feed(session, f"{console.url}api/jobs/{job}/events")
        replayed = await feed.until("caught_up")
        assert [row["seq"] for row in rows_of(replayed)] == seqs
        assert [e.id for e in replayed if e.event == "row"] == [str(seq) for seq in seqs]  # id: is the sequence
        assert next(e for e in replayed if e.event == "first_error").data is None  # nothing failed yet

        (failed,) = await publish(console, exited(job, 1, 137))
        elected = await feed.next_named("first_error")
        assert elected.data["seq"] == failed
        assert elected.data["rank"] == 1
        row = await feed.next_named("row")
        assert (row.id, row.data["kind"], row.data["failure"]) == (str(failed), "rank_exited", True)
        assert row.data["summary"] == "exit 137"

        # A finding names the first error: it replaces the failed exit, whatever came first.
        (found,) = await publish(console, finding(job, 1))
        elected = await feed.next_named("first_error")
        assert (elected.data["seq"], elected.data["lane"], elected.data["category"]) == (found, "host", "oom_kill")


async def test_a_reconnecting_browser_resumes_after_its_last_event_id_without_gap_or_duplicate(
    console: Console, unique: str
) -> None:
    job = f"resume-{unique}"
    seqs = await publish(console, submitted(job), started(job, 0), exited(job, 0, 3), started(job, 1))
    async with aiohttp.ClientSession() as session:
        feed = await open_feed(session, f"{console.url}api/jobs/{job}/events", **{"Last-Event-ID": str(seqs[1])})
        resumed = await feed.until("caught_up")
        assert [row["seq"] for row in rows_of(resumed)] == seqs[2:]
        # The election still saw every event, also those the browser already had.
        assert next(e for e in resumed if e.event == "first_error").data["seq"] == seqs[2]

        bad = await session.get(f"{console.url}api/jobs/{job}/events", headers={"Last-Event-ID": "1; drop"})
        assert bad.status == 400
        assert "Last-Event-ID" in await bad.text()


async def test_the_filters_in_the_query_string_choose_the_rows_and_bad_ones_are_refused(
    console: Console, unique: str
) -> None:
    job = f"filters-{unique}"
    seqs = await publish(
        console, submitted(job), started(job, 0), exited(job, 0, 0), exited(job, 1, 9), evidence(job, "oom on node-2")
    )
    base = f"{console.url}api/jobs/{job}/events"
    async with aiohttp.ClientSession() as session:
        failures = rows_of(await (await open_feed(session, f"{base}?failures=1")).until("caught_up"))
        assert [row["seq"] for row in failures] == [seqs[3], seqs[4]]  # the clean exit is not a failure
        text = rows_of(await (await open_feed(session, f"{base}?q=OOM%20on%20node-%5Cd")).until("caught_up"))
        assert [row["seq"] for row in text] == [seqs[4]]  # a regex, case-insensitive
        lanes = rows_of(await (await open_feed(session, f"{base}?lane=platform")).until("caught_up"))
        assert {row["lane"] for row in lanes} == {"platform"}
        assert seqs[0] in [row["seq"] for row in lanes]

        for query, status, said in [
            ("q=%28unclosed", 400, "not a regular expression"),
            ("lane=kitchen", 400, "unknown lane"),
            ("failures=yes", 400, "failures must be 0 or 1"),
            ("q=" + "a" * 201, 400, "at most 200"),
            ("q=" + "a" * 3000, 414, "over 2048"),
        ]:
            for url in (f"{base}?{query}", f"{console.url}jobs/{job}?{query}"):
                refused = await session.get(url)
                assert refused.status == status, (url, refused.status)
                assert said in await refused.text()


async def test_the_job_page_opens_at_its_deep_link_and_escapes_what_it_is_given(console: Console, unique: str) -> None:
    job = f"page-{unique}"
    await publish(console, submitted(job))
    async with aiohttp.ClientSession() as session:
        page = await session.get(f"{console.url}jobs/{job}?failures=1&q=oom#seq=1")
        assert page.status == 200
        body = await page.text()
        assert f'data-job="{job}"' in body
        assert "default-src 'none'" in page.headers["Content-Security-Policy"]
        # Offline: every script and stylesheet is the console's own.
        links = re.findall(r'(?:src|href)="([^"]*)"', body)
        assert {"/static/console.css", "/static/job.js"} <= set(links)
        assert not [link for link in links if re.match(r"[a-z][a-z0-9+.-]*:|//", link, re.IGNORECASE)], links
        for asset in ("/static/console.css", "/static/job.js", "/static/jobs.js"):
            assert (await session.get(console.url.rstrip("/") + asset)).status == 200

        markup = await session.get(f"{console.url}jobs/%3Cscript%3Ealert(1)%3C%2Fscript%3E")
        assert markup.status == 400
        assert markup.content_type == "text/plain"
        assert "is not a job id" in await markup.text()
        wildcard = await session.get(f"{console.url}api/jobs/job.*/events")
        assert wildcard.status == 400
        unknown = await session.get(f"{console.url}jobs/nothing-{unique}")
        assert unknown.status == 404
        assert "unknown job" in await unknown.text()
        jobs = await session.get(console.url)
        assert jobs.status == 200
        assert "/static/jobs.js" in await jobs.text()


async def test_control_characters_and_markup_in_an_event_stay_data_in_the_feed(console: Console, unique: str) -> None:
    job = f"hostile-{unique}"
    said = "\x1b[31mred\r\nevent: row\ndata: {}\n\nid: 999999\n</script><img src=x onerror=alert(1)>"
    seqs = await publish(console, submitted(job), evidence(job, said))
    async with aiohttp.ClientSession() as session:
        feed = await open_feed(session, f"{console.url}api/jobs/{job}/events")
        rows = rows_of(await feed.until("caught_up"))
    assert [row["seq"] for row in rows] == seqs  # nothing the event said became an event of the feed
    hostile = rows[1]
    assert hostile["data"]["evidence"]["summary"] == said  # the data arrives as it was stored
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", hostile["summary"])  # the one-line summary has no control character
    assert all(line.startswith(("event: ", "id: ", "data: ", "retry: ", ":")) or line == "\n" for line in feed.raw)


async def test_the_jobs_feed_lists_jobs_and_follows_their_state(console: Console, unique: str) -> None:
    first, second = f"list-a-{unique}", f"list-b-{unique}"
    await publish(console, submitted(first))
    async with aiohttp.ClientSession() as session:
        feed = await open_feed(session, f"{console.url}api/jobs")
        listed = [e.data for e in await feed.until("caught_up") if e.event == "job"]
        assert [(u["job_id"], u["state"], u["name"]) for u in listed] == [(first, "submitted", "train")]

        await publish(console, submitted(second), finding(first, 1))
        update = (await feed.next_named("job")).data
        assert (update["job_id"], update["state"]) == (second, "submitted")
        update = (await feed.next_named("job")).data
        assert (update["job_id"], update["error_lane"]) == (first, "host")


async def test_a_closed_page_leaves_no_consumer_behind(console: Console, unique: str) -> None:
    job = f"closed-{unique}"
    await publish(console, submitted(job))
    admin = await connect_nats(console.nats.url, name="inspector")
    js = admin.jetstream()

    async def readers() -> int:
        return sum((info.name or "").startswith(READER_PREFIX) for info in await js.consumers_info(JOBS.name))

    async def none_left() -> bool:
        return await readers() == 0

    try:
        async with aiohttp.ClientSession() as session:
            feed = await open_feed(session, f"{console.url}api/jobs/{job}/events")
            await feed.until("caught_up")
            assert await readers() == 1
        # Deleted when the browser goes, not when the server would drop it idle (READER_IDLE_S, 30 s).
        await eventually(none_left, timeout_s=20.0, what="the feed's consumer to be deleted")
    finally:
        await admin.close()


async def test_the_console_identity_reads_and_can_do_nothing_else(console: Console, unique: str) -> None:
    with pytest.raises(PermissionDeniedError):
        await console.reader.request(f"lanes.job.x-{unique}.submitted", b"{}", timeout=1.0)
    with pytest.raises(PermissionDeniedError):
        await console.reader.request("lanes.api.job.cancel", b"{}", timeout=1.0)
    with pytest.raises(PermissionDeniedError):  # a durable of its own, named in the subject
        await console.reader.request(f"$JS.API.CONSUMER.DURABLE.CREATE.{JOBS.name}.console-{unique}", b"{}", timeout=1)


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Debian's Chromium, headless, driven by Playwright (never a browser Playwright downloads)."""
    require(CHROMIUM)
    binary = chromium()
    assert binary is not None
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=binary, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield launched
        finally:
            await launched.close()


async def open_page(browser: Browser, url: str) -> Page:
    context = await browser.new_context(viewport={"width": 1200, "height": 900})  # a browser profile of its own
    page = await context.new_page()
    refused: list[str] = []
    page.on("requestfailed", lambda request: refused.append(request.url))
    await page.goto(url)
    await page.wait_for_selector("body[data-caught-up='true']", timeout=READ_BOUND_S * 1000)
    assert not refused, refused
    return page


async def test_in_chromium_an_event_published_after_the_page_loaded_appears_in_the_swimlane(
    console: Console, browser: Browser, unique: str, tmp_path: Path
) -> None:
    job = f"browser-{unique}"
    seqs = await publish(console, submitted(job), started(job, 0), started(job, 1))
    page = await open_page(browser, f"{console.url}jobs/{job}")
    assert await page.locator("#events tbody tr").count() == len(seqs)
    assert await page.text_content("#first-error") == "No error on this timeline yet."

    (failed,) = await publish(console, exited(job, 1, 137))
    await page.wait_for_selector(f"tr.first-error[data-seq='{failed}']", timeout=READ_BOUND_S * 1000)
    assert await page.locator(f"#chart circle.first-error[data-seq='{failed}']").count() == 1
    assert "rank 1 ended with exit 137" in (await page.text_content("#first-error") or "")
    assert await page.get_attribute("#jump-first-error", "href") == f"#seq={failed}"
    shot = tmp_path / "job.png"
    await page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_in_chromium_a_deep_link_opens_at_its_event_and_a_filter_hides_what_it_should(
    console: Console, browser: Browser, unique: str
) -> None:
    job = f"deep-{unique}"
    attack = "<img src=x onerror=\"document.body.dataset.owned='1'\">\x1b[2J"
    seqs = await publish(
        console, submitted(job), started(job, 0), exited(job, 0, 0), exited(job, 1, 9), evidence(job, attack)
    )
    page = await open_page(browser, f"{console.url}jobs/{job}?failures=1#seq={seqs[3]}")
    shown = [
        int(seq) for seq in await page.locator("#events tbody tr").evaluate_all("rs => rs.map(r => r.dataset.seq)")
    ]
    assert shown == [seqs[3], seqs[4]]  # failures only: the clean exit and the starts are hidden
    assert await page.get_attribute(f"tr[data-seq='{seqs[3]}']", "class") == "event failure first-error selected"
    assert json.loads(await page.text_content("#detail") or "")["seq"] == seqs[3]
    assert await page.input_value("input[name=q]") == ""
    assert await page.is_checked("input[name=failures]")

    # The markup an event carries is text on the page: no element made of it, none of its script run.
    assert await page.locator("#events img").count() == 0
    assert await page.get_attribute("body", "data-owned") is None
    assert "<img src=x" in (await page.text_content(f"tr[data-seq='{seqs[4]}'] td.summary") or "")

    # Choosing a lane in the form is a new URL: the view it shows is the one a pasted link shows.
    await page.check("input[name=lane][value=host]")
    await page.uncheck("input[name=failures]")
    await page.click("button[type=submit]")
    await page.wait_for_selector("body[data-caught-up='true']")
    assert "lane=host" in page.url
    lanes = await page.locator("#events tbody tr").evaluate_all("rs => rs.map(r => r.dataset.lane)")
    assert lanes
    assert set(lanes) == {"host"}


async def test_in_chromium_the_jobs_list_shows_a_job_submitted_after_it_loaded(
    console: Console, browser: Browser, unique: str
) -> None:
    first, later = f"list-a-{unique}", f"list-b-{unique}"
    await publish(console, submitted(first))
    page = await open_page(browser, console.url)
    await page.wait_for_selector(f"tr[data-job='{first}']")
    await publish(console, submitted(later))
    await page.wait_for_selector(f"tr[data-job='{later}']", timeout=READ_BOUND_S * 1000)
    assert await page.get_attribute(f"tr[data-job='{later}'] a", "href") == f"/jobs/{later}"

    filtered = await open_page(browser, f"{console.url}?q=list-b")
    await filtered.wait_for_selector(f"tr[data-job='{later}']")
    assert await filtered.locator(f"tr[data-job='{first}']").count() == 0


async def read_exports(proc: asyncio.subprocess.Process) -> dict[str, str]:
    """The `export NAME=value` lines `lanes up` prints first."""
    assert proc.stdout is not None
    exported: dict[str, str] = {}
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line, "lanes up ended before printing its exports"
        if not line.startswith("export "):
            return exported
        name, _, value = line.removeprefix("export ").strip().partition("=")
        exported[name] = value


async def read_console_url(proc: asyncio.subprocess.Process) -> str:
    """The URL of the `console: <url>` line a `lanes` process prints (after any other lines)."""
    assert proc.stdout is not None
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line, "the process ended before printing the console's URL"
        if line.startswith("console: "):
            return line.removeprefix("console: ").strip()


async def test_lanes_console_serves_the_log_until_interrupted(console: Console, unique: str) -> None:
    job = f"cli-{unique}"
    await publish(console, submitted(job))
    proc = await asyncio.create_subprocess_exec(
        LANES,
        "console",
        "--port",
        "0",
        env=os.environ | {"NATS_URL": console.nats.url_for("console"), "LANES_LOG_FORMAT": "json"},
        stdout=asyncio.subprocess.PIPE,
        preexec_fn=interruptible,
    )
    try:
        link = await read_console_url(proc)
        match = re.fullmatch(r"(http://127\.0\.0\.1:\d+/)\?token=([\w-]+)", link)
        assert match, link
        url, token = match.groups()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
            assert (await session.get(f"{url}jobs/{job}")).status == 200
            rows = rows_of(await (await open_feed(session, f"{url}api/jobs/{job}/events")).until("caught_up"))
            assert [row["job_id"] for row in rows] == [job]
        async with aiohttp.ClientSession() as stranger:
            assert (await stranger.get(f"{url}api/jobs/{job}/events")).status == 401
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0

    refused = await asyncio.create_subprocess_exec(
        LANES, "console", "--port", "70000", stderr=asyncio.subprocess.PIPE, env=os.environ | {"NATS_URL": "x"}
    )
    _, said = await refused.communicate()
    assert refused.returncode == 2
    assert "--port" in said.decode()


@pytest.fixture
def own_tmp() -> Iterator[Path]:
    """A TMPDIR for the embedded servers of `lanes up`, which the embedded PostgreSQL's user may pass through."""
    root = Path(tempfile.mkdtemp(prefix="lanes-console-test-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
async def test_lanes_up_starts_the_console_and_prints_its_url(own_tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"NATS_URL", "DATABASE_URL", "REDIS_URL"}}
    proc = await asyncio.create_subprocess_exec(
        LANES,
        "up",
        "--nodes",
        "1",
        env=env | {"TMPDIR": str(own_tmp), "LANES_LOG_FORMAT": "json"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=interruptible,
    )
    try:
        exported = await read_exports(proc)
        link = await read_console_url(proc)
        url = link.split("?", 1)[0]
        assert link == f"{url}?token={exported['LANES_CONSOLE_TOKEN']}"
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:  # 127.0.0.1's
            page = await session.get(link)  # the printed link: its token becomes the browser's cookie
            assert page.status == 200
            assert str(page.url) == url
            assert "/static/jobs.js" in await page.text()
            await (await open_feed(session, f"{url}api/jobs")).until("caught_up")
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 60)
    assert proc.returncode == 0


def node_state(node: str, state: NodeState, reason: str) -> NodeStateChanged:
    return NodeStateChanged(
        source="lanes/tests", node=node, lane=Lane.HOST, data=NodeStateChangedData(state=state, reason=reason)
    )


def node_evidence(node: str, summary: str) -> HostEvidence:
    return HostEvidence(
        source=f"agent/{node}",
        node=node,
        data=EvidenceData(category=EvidenceCategory.GPU_XID, summary=summary, lines=(summary,)),
    )


async def test_a_node_feed_merges_its_state_and_its_evidence_live_and_resumes_each_stream(
    console: Console, unique: str
) -> None:
    node = f"node-{unique}"
    registered = NodeRegistered(
        source="lanes/tests", node=node, data=NodeRegisteredData(gpu_model="H100", gpus=8, gpu_memory_gib=80)
    )
    stored = await publish(console, registered, node_evidence(node, "Xid 79: fallen off the bus"))
    async with aiohttp.ClientSession() as session:
        page = await session.get(f"{console.url}nodes/{node}")
        assert page.status == 200
        assert f'data-feed="/api/nodes/{node}/events"' in await page.text()
        feed = await open_feed(session, f"{console.url}api/nodes/{node}/events")
        replayed = [e for e in await feed.until("caught_up") if e.event == "row"]
        assert sorted((e.data["stream"], e.data["seq"]) for e in replayed) == sorted(
            [("LANES_NODES", stored[0]), ("LANES_TELEMETRY", stored[1])]
        )
        assert next(e.data for e in replayed if e.data["stream"] == "LANES_TELEMETRY")["summary"] == (
            "gpu_xid: Xid 79: fallen off the bus"
        )
        last_id = replayed[-1].id
        assert last_id == f"{stored[0]}.{stored[1]}"  # the last sequence sent of each stream

        (cordoned,) = await publish(console, node_state(node, NodeState.UNHEALTHY, "Xid 79"))
        live = await feed.next_named("row")
        assert (live.data["seq"], live.data["summary"], live.data["failure"]) == (cordoned, "unhealthy (Xid 79)", True)
        assert live.id == f"{cordoned}.{stored[1]}"

        resumed = await open_feed(session, f"{console.url}api/nodes/{node}/events", **{"Last-Event-ID": last_id})
        assert [e.data["seq"] for e in await resumed.until("caught_up") if e.event == "row"] == [cordoned]

        for url, headers, status in [
            (f"{console.url}api/nodes/{node}/events", {"Last-Event-ID": "7"}, 400),
            (f"{console.url}nodes/nothing-{unique}", {}, 404),
            (f"{console.url}nodes/node.%3E", {}, 400),
        ]:
            assert (await session.get(url, headers=headers)).status == status, url


async def test_in_chromium_the_first_error_links_to_its_node_history(
    console: Console, browser: Browser, unique: str
) -> None:
    job, node = f"linked-{unique}", "node-1"
    await publish(console, submitted(job), exited(job, 0, 9), node_state(node, NodeState.CORDONED, "repeat offender"))
    page = await open_page(browser, f"{console.url}jobs/{job}")
    link = page.locator("#first-error a", has_text=node)
    assert await link.get_attribute("href") == f"/nodes/{node}"
    await link.click()
    await page.wait_for_selector("body[data-caught-up='true']")
    assert page.url == f"{console.url}nodes/{node}"
    assert "cordoned (repeat offender)" in (await page.text_content("#events") or "")
    assert "State: cordoned" in (await page.text_content("#state") or "")


def served(replica: str, request_id: str, *, failed: bool = False) -> RequestServed:
    data = RequestServedData(
        request_id=request_id,
        model="llama",
        replica=replica,
        route="/v1/chat/completions",
        status="failed" if failed else "ok",
        http_status=502 if failed else 200,
        received_at=datetime.now(UTC),
        latency_ms=12.5,
    )
    return RequestServed(source="lanes/router", jobid=replica, attempt=1, node="node-1", data=data)


async def test_a_replicas_requests_stream_live_and_resume(console: Console, unique: str) -> None:
    replica = f"replica-{unique}"
    stored = await publish(console, served(replica, "r-1"), served(replica, "r-2"), served(f"other-{unique}", "r-3"))
    async with aiohttp.ClientSession() as session:
        page = await session.get(f"{console.url}replicas/{replica}/requests")
        assert page.status == 200
        assert f'data-feed="/api/replicas/{replica}/requests"' in await page.text()
        feed = await open_feed(session, f"{console.url}api/replicas/{replica}/requests")
        rows = rows_of(await feed.until("caught_up"))
        assert [(row["seq"], row["data"]["request_id"]) for row in rows] == [(stored[0], "r-1"), (stored[1], "r-2")]

        (failed,) = await publish(console, served(replica, "r-4", failed=True))
        live = await feed.next_named("row")
        assert (live.id, live.data["data"]["status"]) == (str(failed), "failed")

        resumed = await open_feed(
            session, f"{console.url}api/replicas/{replica}/requests", **{"Last-Event-ID": str(stored[1])}
        )
        assert [row["seq"] for row in rows_of(await resumed.until("caught_up"))] == [failed]
        assert (await session.get(f"{console.url}replicas/none-{unique}/requests")).status == 404


async def test_in_chromium_an_inference_job_links_to_the_requests_its_replica_served(
    console: Console, browser: Browser, unique: str
) -> None:
    replica = f"serve-{unique}"
    listening = ReplicaListening(
        source="lanes/tests",
        jobid=replica,
        attempt=1,
        node="node-1",
        rank=0,
        data=ReplicaListeningData(endpoint="http://10.0.0.7:8000"),
    )
    await publish(console, submitted(replica), listening, served(replica, "req-one"))
    page = await open_page(browser, f"{console.url}jobs/{replica}")
    link = page.locator("#replica-requests")
    assert await link.get_attribute("href") == f"/replicas/{replica}/requests"
    await link.click()
    await page.wait_for_selector("body[data-caught-up='true']")
    assert "req-one" in (await page.text_content("#events") or "")


async def test_a_viewer_needs_the_token_a_bearer_a_link_that_sets_its_cookie(console: Console, unique: str) -> None:
    job = f"token-{unique}"
    await publish(console, submitted(job))
    token = f"viewer-{unique}"
    runner, url = await serve(console.reader, "127.0.0.1", 0, token)
    try:
        async with aiohttp.ClientSession() as stranger:
            for path in ("", f"jobs/{job}", f"api/jobs/{job}/events", "api/jobs", f"jobs/{job}?token=wrong-{unique}"):
                refused = await stranger.get(f"{url}{path}")
                assert refused.status == 401, path
                assert "LANES_CONSOLE_TOKEN" in await refused.text()
                assert refused.headers["WWW-Authenticate"] == "Bearer"
            assert (await stranger.get(f"{url}static/job.js")).status == 200  # the package's code, the same for all

        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as client:
            feed = await open_feed(client, f"{url}api/jobs/{job}/events")
            assert [row["job_id"] for row in rows_of(await feed.until("caught_up"))] == [job]

        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser_like:
            opened = await browser_like.get(f"{url}jobs/{job}?failures=1&token={token}")
            assert opened.status == 200
            assert str(opened.url) == f"{url}jobs/{job}?failures=1"  # the token left the address bar
            assert opened.history[0].status == 303
            cookie = opened.history[0].cookies["lanes_console_token"]
            assert (cookie.value, cookie["httponly"], cookie["samesite"]) == (token, True, "Strict")
            feed = await open_feed(browser_like, f"{url}api/jobs/{job}/events")  # the cookie is the credential now
            await feed.until("caught_up")
    finally:
        await runner.cleanup()


async def test_in_chromium_the_printed_link_opens_the_live_page_and_its_feed_carries_the_cookie(
    console: Console, browser: Browser, unique: str
) -> None:
    job = f"link-{unique}"
    await publish(console, submitted(job))
    token = f"viewer-{unique}"
    runner, url = await serve(console.reader, "127.0.0.1", 0, token)
    try:
        page = await open_page(browser, f"{url}jobs/{job}?token={token}")
        assert page.url == f"{url}jobs/{job}"
        (exit_seq,) = await publish(console, exited(job, 0, 1))
        await page.wait_for_selector(f"tr[data-seq='{exit_seq}']", timeout=READ_BOUND_S * 1000)
        again = await (await page.context.new_page()).goto(f"{url}jobs/{job}")  # the same browser: its cookie
        assert again is not None
        assert again.status == 200
        other = await browser.new_context()  # another browser (profile): no cookie
        refused = await (await other.new_page()).goto(f"{url}jobs/{job}")
        assert refused is not None
        assert refused.status == 401
        await other.close()
    finally:
        await runner.cleanup()


def placed(job_id: str, attempt: int, nodes: tuple[str, str]) -> JobPlaced:
    assignments = tuple(RankAssignment(rank=rank, node=node, gpus=(0,)) for rank, node in enumerate(nodes))
    return JobPlaced(
        source="lanes/scheduler",
        jobid=job_id,
        attempt=attempt,
        data=JobPlacedData(assignments=assignments, level="leaf", domain=f"leaf-{attempt}"),
    )


def heartbeat(job_id: str, attempt: int, rank: int, step: int) -> Heartbeat:
    return Heartbeat(
        source="lanes/tests", jobid=job_id, attempt=attempt, node="node-1", rank=rank, data=HeartbeatData(step=step)
    )


def resumed(job_id: str, attempt: int, step: int) -> AttemptRequested:
    data = AttemptRequestedData(reason="resume after host/oom_kill", resume_step=step, avoid_nodes=("node-2",))
    return AttemptRequested(source="lanes/lifecycle", jobid=job_id, attempt=attempt, data=data)


def decided(job_id: str, attempt: int, step: int) -> RecoveryDecided:
    data = RecoveryDecidedData(
        finding_id="f-1",
        first_error="host/oom_kill",
        policy="training-default",
        policy_version=1,
        workload_class="training",
        action=RecoveryAction.RESUME,
        reason="host-lane first error: cordon node-2 and resume",
        owner="host on-call",
        owner_lane=Lane.HOST,
        rollback="lanes topology state node-2 ready",
        expects="io.lanes.job.attempt_requested.v1",
        cordon=("node-2",),
        resume_step=step,
    )
    return RecoveryDecided(source="lanes/recovery", jobid=job_id, attempt=attempt, data=data)


def two_attempts(job: str) -> list[Any]:
    """Attempt 1 on node-1/node-2 dies of rank 1's OOM at step 120; attempt 2 resumes at step 100 on node-1/node-3."""
    return [
        submitted(job),
        placed(job, 1, ("node-1", "node-2")),
        started(job, 0),
        started(job, 1),
        heartbeat(job, 1, 0, 120),
        heartbeat(job, 1, 1, 118),
        exited(job, 1, 137),
        finding(job, 1),
        decided(job, 1, 100),
        resumed(job, 2, 100),
        placed(job, 2, ("node-1", "node-3")),
        heartbeat(job, 2, 0, 104),
        heartbeat(job, 2, 1, 103),
    ]


async def test_the_attempts_feed_compares_placement_ranks_first_error_and_decision(
    console: Console, unique: str
) -> None:
    job = f"attempts-{unique}"
    seqs = await publish(console, *two_attempts(job))
    async with aiohttp.ClientSession() as session:
        feed = await open_feed(session, f"{console.url}api/jobs/{job}/attempts?attempt=1&attempt=2")
        view = (await feed.next_named("attempts")).data
        one, two = view["shown"]
        assert (view["attempts"], one["attempt"], two["attempt"]) == ([1, 2], 1, 2)
        assert one["placement"] == {"0": "node-1", "1": "node-2"}
        assert two["placement"] == {"0": "node-1", "1": "node-3"}
        assert one["first_error"]["seq"] == seqs[7]  # the finding, not the exit before it
        assert one["first_error"]["category"] == "oom_kill"
        assert two["first_error"] is None
        assert [(d["action"], d["resume_step"], d["cordon"]) for d in one["decisions"]] == [("resume", 100, ["node-2"])]
        assert (two["reason"], two["resume_step"]) == ("resume after host/oom_kill", 100)
        ranks = {line["rank"]: line["by_attempt"] for line in view["ranks"]}
        assert [(r["node"], r["last_step"], r["failed"]) for r in ranks[1]] == [
            ("node-2", 118, True),
            ("node-3", 103, False),
        ]
        assert view["steps"] == {"low": 100, "high": 120}
        await feed.next_named("caught_up")

        # Live: a later heartbeat moves attempt 2's rank along the step axis.
        await publish(console, heartbeat(job, 2, 1, 130))
        later = (await feed.next_named("attempts")).data
        assert later["ranks"][1]["by_attempt"][1]["last_step"] == 130
        assert later["steps"]["high"] == 130

    async with aiohttp.ClientSession() as session:
        for query, said in (("attempt=x", "attempt must be a whole number"), ("attempt=0", "from 1")):
            async with session.get(f"{console.url}api/jobs/{job}/attempts?{query}") as refused:
                assert refused.status == 400
                assert said in await refused.text()
        async with session.get(f"{console.url}jobs/no-such-{unique}/attempts") as missing:
            assert missing.status == 404


async def test_in_chromium_the_attempts_comparison_shows_both_attempts_at_its_url(
    console: Console, browser: Browser, unique: str
) -> None:
    job = f"side-{unique}"
    seqs = await publish(console, *two_attempts(job))
    job_page = await open_page(browser, f"{console.url}jobs/{job}")
    assert await job_page.get_attribute("#attempts-link", "href") == f"/jobs/{job}/attempts"

    page = await open_page(browser, f"{console.url}jobs/{job}/attempts?attempt=1&attempt=2")
    await page.wait_for_selector("body[data-shown='1,2']", timeout=READ_BOUND_S * 1000)
    headers = await page.locator("#attempts thead th").all_text_contents()
    assert headers == ["", "attempt 1", "attempt 2"]
    placement = await page.locator("#attempts tr[data-field='placement'] td").all_text_contents()
    assert placement == ["r0@node-1 r1@node-2 (leaf-1)", "r0@node-1 r1@node-3 (leaf-2)"]
    first_error = await page.locator("#attempts tr[data-field='first error'] td").all_text_contents()
    assert first_error[0].startswith("rank 1 OOM-killed (host lane, node node-2, rank 1)")
    assert first_error[1] == "-"
    assert await page.get_attribute("#attempts td[data-attempt='1'] a", "href") == f"/jobs/{job}#seq={seqs[7]}"
    decision = await page.locator("#attempts tr[data-field='recovery decision'] td").all_text_contents()
    assert decision[0].startswith("resume: host-lane first error: cordon node-2 and resume (owner host on-call)")
    rank_one = await page.locator("#ranks tr[data-rank='1'] td[data-attempt]").all_text_contents()
    assert [cell.split(" \u00b7 ")[:2] for cell in rank_one] == [["node-2", "step 118"], ["node-3", "step 103"]]
    assert await page.locator("#ranks tr[data-rank='1'] td[data-attempt='1'] rect.steps.failed").count() == 1

    await publish(console, heartbeat(job, 2, 1, 140))
    await page.wait_for_selector("#ranks tr[data-rank='1'] td[data-attempt='2']:has-text('step 140')")

    # The chooser is the URL: only attempt 2 checked opens the view of attempt 2 alone.
    await page.uncheck("input[name=attempt][value='1']")
    await page.click("#choose button[type=submit]")
    await page.wait_for_selector("body[data-shown='2']", timeout=READ_BOUND_S * 1000)
    assert page.url.endswith(f"/jobs/{job}/attempts?attempt=2")


async def test_the_job_page_downloads_the_incident_bundle_lanes_incident_writes(
    console: Console, unique: str, tmp_path: Path
) -> None:
    job = f"bundle-{unique}"
    seqs = await publish(console, *two_attempts(job))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{console.url}api/jobs/{job}/incident") as got:
            assert got.status == 200, await got.text()
            assert got.headers["Content-Disposition"] == f'attachment; filename="incident-{job}.tar.gz"'
            archive = tmp_path / "bundle.tar.gz"
            archive.write_bytes(await got.read())
        async with session.get(f"{console.url}api/jobs/none-{unique}/incident") as missing:
            assert missing.status == 404
        async with session.get(f"{console.url}api/jobs/a*b/incident") as wildcard:
            assert wildcard.status == 400
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == [f"incident-{job}/{name}" for name in sorted(BUNDLE_FILES)]
        tar.extractall(tmp_path, filter="data")
    folder = tmp_path / f"incident-{job}"
    downloaded = json.loads((folder / "incident.json").read_text())
    assert downloaded["summary"]["first_error"]["category"] == "oom_kill"
    assert [step["kind"] for step in downloaded["decision_chain"]] == ["recovery_decided", "attempt_requested"]
    assert downloaded["attempts"] == [1, 2]
    events = (folder / "events.ndjson").read_bytes().splitlines()
    assert [json.loads(line)["sequence"] for line in events] == [str(seq) for seq in seqs]
    assert job in (folder / "timeline.html").read_text()

    # The same bundle `lanes incident` builds from the same log (it reads it as the console does).
    printed = run_lanes(
        None,
        "incident",
        job,
        "--json",
        env={"NATS_URL": console.nats.url_for("console"), "DATABASE_URL": None, "REDIS_URL": None},
    )
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout) == downloaded


async def publish_all(console: Console, events: list[Any]) -> list[int]:
    """Publish many events at once, as a storm lands (each acknowledged; sequences in the order given back)."""
    return sorted(await asyncio.gather(*(console.publisher.publish(event) for event in events)))


async def test_a_storm_is_grouped_and_a_long_history_is_sent_from_its_tail_a_page_at_a_time(
    console: Console, unique: str
) -> None:
    job = f"storm-{unique}"
    ranks = 40
    head = await publish(console, submitted(job), finding(job, 1))
    storm = await publish_all(console, [exited(job, rank, 1) for rank in range(2, 2 + ranks)])
    chatter = await publish_all(console, [started(job, rank) for rank in range(PAGE_ROWS)])
    async with aiohttp.ClientSession() as session:
        feed = await open_feed(session, f"{console.url}api/jobs/{job}/events")
        opened = await feed.until("caught_up")
        page = next(e for e in opened if e.event == "page").data
        sent = [row["seq"] for row in rows_of(opened)]
        assert sent == chatter  # the newest PAGE_ROWS the view keeps
        assert page == {"earlier": len(head) + ranks, "before": chatter[0]}
        (groups,) = [e.data for e in opened if e.event == "groups"]
        assert [(g["count"], g["kind"], g["says"], g["consequence"]) for g in groups] == [
            (ranks, "rank_exited", "exit 1", True)
        ]
        assert groups[0]["ranks"] == list(range(2, 2 + ranks))

        # Live: one more timeout joins its group; the row carries the group's key.
        (late,) = await publish(console, exited(job, 99, 1))
        row = await feed.next_named("row")
        assert (row.data["seq"], row.data["group"]) == (late, groups[0]["key"])
        regrouped = await feed.next_named("groups")
        assert regrouped.data[0]["count"] == ranks + 1

        async with session.get(f"{console.url}api/jobs/{job}/rows?before={chatter[0]}&limit=30") as got:
            earlier = await got.json()
        assert [row["seq"] for row in earlier["rows"]] == storm[-30:]
        assert earlier["more"] is True
        async with session.get(f"{console.url}api/jobs/{job}/rows?before={storm[0]}&failures=1") as got:
            first = await got.json()
        assert [row["seq"] for row in first["rows"]] == head[1:]  # the filters apply: the finding alone
        for query in ("before=x", "before=5&limit=100000", "limit=5"):
            async with session.get(f"{console.url}api/jobs/{job}/rows?{query}") as refused:
                assert refused.status == 400, query


async def test_in_chromium_a_storm_shows_as_its_group_and_earlier_events_load_on_demand(
    console: Console, browser: Browser, unique: str
) -> None:
    job = f"group-{unique}"
    ranks = 24
    head = await publish(console, submitted(job), finding(job, 1))
    storm = await publish_all(console, [exited(job, rank, 1) for rank in range(2, 2 + ranks)])
    chatter = await publish_all(console, [started(job, rank) for rank in range(PAGE_ROWS)])
    page = await open_page(browser, f"{console.url}jobs/{job}")
    group = page.locator("#groups details.group.consequence")
    assert await group.count() == 1
    said = await group.locator("summary").text_content() or ""
    assert said.startswith(f"{ranks} ranks: rank_exited exit 1 (host lane, 1 nodes), consequence of rank 1 OOM-killed")
    assert await page.locator("#events tbody tr").count() == PAGE_ROWS

    await page.click("#load-earlier")
    await page.wait_for_selector(f"tr[data-seq='{head[0]}']", timeout=READ_BOUND_S * 1000)
    shown = await page.locator("#events tbody tr").evaluate_all("rs => rs.map(r => Number(r.dataset.seq))")
    # The storm's first three rows are drawn, the rest counted in the group; a group's link draws its row.
    assert shown == [*head, *storm[:3], *chatter]
    assert f"({ranks - 3} more in the groups above)" in (await page.text_content("#summary") or "")
    await page.click("#groups details.group summary")
    await page.click(f"#groups a[href='#seq={storm[0]}']")
    await page.wait_for_selector(f"tr.selected[data-seq='{storm[0]}']")


def submitted_for(job_id: str, tenant: str) -> JobSubmitted:
    spec = JobSpec(name="train", workers=1, tenant=tenant)
    return JobSubmitted(source="lanes/tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))


@dataclass
class Tenants:
    url: str
    keys: dict[str, str]
    """tenant -> its API key"""


@pytest.fixture
async def tenants(console: Console, unique: str) -> AsyncIterator[Tenants]:
    """A console that lets in its viewer token and two tenants' API keys (by their hashes, as the router's file)."""
    keys = {f"red-{unique}": f"red-key-{unique}", f"blue-{unique}": f"blue-key-{unique}"}
    table = {"tenants": {name: {"key_sha256": hashlib.sha256(key.encode()).hexdigest()} for name, key in keys.items()}}
    runner, url = await serve(console.reader, "127.0.0.1", 0, f"viewer-{unique}", tenant_keys(table))
    try:
        yield Tenants(url, keys)
    finally:
        await runner.cleanup()


async def test_a_tenants_key_sees_its_own_jobs_only(console: Console, tenants: Tenants, unique: str) -> None:
    red, blue = f"red-{unique}", f"blue-{unique}"
    ours, theirs = f"ours-{unique}", f"theirs-{unique}"
    await publish(console, submitted_for(ours, red), submitted_for(theirs, blue), exited(theirs, 0, 1))
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {tenants.keys[red]}"}) as client:
        for path in (f"jobs/{ours}", f"jobs/{ours}/attempts", f"api/jobs/{ours}/incident"):
            async with client.get(f"{tenants.url}{path}") as allowed:
                assert allowed.status == 200, path
        for path in (
            f"jobs/{theirs}",
            f"api/jobs/{theirs}/events",
            f"api/jobs/{theirs}/attempts",
            f"api/jobs/{theirs}/incident",
            f"api/jobs/{theirs}/rows?before=99",
            f"replicas/{theirs}/requests",
        ):
            async with client.get(f"{tenants.url}{path}") as refused:
                assert refused.status == 403, path
                assert f"is not tenant {red}'s" in await refused.text()
        async with client.get(f"{tenants.url}nodes/node-1") as node:
            assert node.status == 403
            assert "spans tenants" in await node.text()

        # The jobs list streams the tenant's jobs alone, live too.
        listed = await open_feed(client, f"{tenants.url}api/jobs")
        later = f"later-{unique}"
        other = f"other-{unique}"
        await publish(console, submitted_for(other, blue), submitted_for(later, red))
        seen: list[str] = []
        while later not in seen:
            event = await listed.next_named("job")
            seen.append(event.data["job_id"])
        assert theirs not in seen
        assert other not in seen
        assert ours in seen

    async with aiohttp.ClientSession() as session:
        viewer = {"Authorization": f"Bearer viewer-{unique}"}
        async with session.get(f"{tenants.url}jobs/{theirs}", headers=viewer) as allowed:
            assert allowed.status == 200  # the viewer token sees every tenant
        async with session.get(f"{tenants.url}jobs/{ours}", headers={"Authorization": f"Bearer x-{unique}"}) as refused:
            assert refused.status == 401


async def test_in_chromium_a_tenants_viewer_cannot_open_another_tenants_job(
    console: Console, browser: Browser, tenants: Tenants, unique: str
) -> None:
    red, blue = f"red-{unique}", f"blue-{unique}"
    ours, theirs = f"mine-{unique}", f"yours-{unique}"
    await publish(console, submitted_for(ours, red), submitted_for(theirs, blue))
    page = await open_page(browser, f"{tenants.url}jobs/{ours}?token={tenants.keys[red]}")
    assert page.url == f"{tenants.url}jobs/{ours}"  # the key left the address bar for a cookie
    refused = await page.goto(f"{tenants.url}jobs/{theirs}")
    assert refused is not None
    assert refused.status == 403
    assert f"job '{theirs}' is not tenant {red}'s" in (await page.text_content("body") or "")
    listing = await page.goto(tenants.url)
    assert listing is not None
    await page.wait_for_selector(f"tr[data-job='{ours}']", timeout=READ_BOUND_S * 1000)
    assert await page.locator(f"tr[data-job='{theirs}']").count() == 0


async def test_a_tenants_jobs_list_resumes_after_its_last_event_id_with_its_own_jobs(
    console: Console, tenants: Tenants, unique: str
) -> None:
    red, blue = f"red-{unique}", f"blue-{unique}"
    ours, theirs = f"first-{unique}", f"second-{unique}"
    seqs = await publish(console, submitted_for(ours, red), submitted_for(theirs, blue))
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {tenants.keys[red]}"}) as client:
        resumed = await open_feed(client, f"{tenants.url}api/jobs", **{"Last-Event-ID": str(seqs[-1])})
        await publish(console, finding(theirs, 1))
        (found,) = await publish(console, finding(ours, 1))
        event = await resumed.next_named("job")
        # Nothing up to its Last-Event-ID, nothing of the other tenant's, and its own job, though it was
        # submitted before the reconnect.
        assert (event.id, event.data["job_id"], event.data["error_lane"]) == (str(found), ours, "host")


async def test_an_operators_action_is_a_command_on_the_timeline_and_a_viewer_is_refused(
    console: Console, tenants: Tenants, unique: str
) -> None:
    job = f"act-{unique}"
    await publish(console, submitted_for(job, f"red-{unique}"))
    acting = await LanesClient.connect(
        console.nats.url_for("cli"), source="lanes/console", signer=console.nats.signer_for("cli")
    )
    operator_token = f"operator-{unique}"
    runner, url = await serve(
        console.reader, "127.0.0.1", 0, f"viewer-{unique}", None, Operator(operator_token, acting)
    )
    try:
        async with aiohttp.ClientSession() as session:
            action = f"{url}api/jobs/{job}/actions"
            body = {"by": "ann", "reason": "wrong data set"}
            async with session.post(
                f"{action}/cancel", json=body, headers={"Authorization": f"Bearer viewer-{unique}"}
            ) as refused:
                assert refused.status == 403
                assert "actions need the operator token (LANES_CONSOLE_OPERATOR_TOKEN)" in await refused.text()
            operator = {"Authorization": f"Bearer {operator_token}"}
            for name, sent, said in (
                ("approve", {"by": "ann"}, "reason is required"),
                ("cancel", {"reason": "x"}, "by is required"),
                ("explode", body, "unknown action"),
                ("cancel", ["ann"], "must be a JSON object"),
            ):
                async with session.post(f"{action}/{name}", json=sent, headers=operator) as bad:
                    assert bad.status == 400, name
                    assert said in await bad.text()
            async with session.post(f"{url}api/jobs/none-{unique}/actions/cancel", json=body, headers=operator) as gone:
                assert gone.status == 404

            async with session.post(f"{action}/cancel", json=body, headers=operator) as done:
                assert done.status == 200, await done.text()
                answer = await done.json()
            assert answer["type"] == "io.lanes.job.cancel_requested.v1"
            feed = await open_feed(session, f"{url}api/jobs/{job}/events", **operator)
            rows = rows_of(await feed.until("caught_up"))
            (cancel,) = [row for row in rows if row["kind"] == "cancel_requested"]
            assert cancel["seq"] == answer["seq"]
            assert cancel["data"] == {"reason": "wrong data set", "requested_by": "ann (console)"}
            assert cancel["source"] == "lanes/console"
            # A tenant's key may only look; a console without an operator takes no actions at all.
            red = {"Authorization": f"Bearer {tenants.keys[f'red-{unique}']}"}
            async with session.post(f"{tenants.url}api/jobs/{job}/actions/cancel", json=body, headers=red) as none:
                assert none.status == 403
                assert "this console takes no actions" in await none.text()
    finally:
        await runner.cleanup()
        await acting.close()


def poc_report(job: str) -> dict[str, Any]:
    """The parts of a `lanes poc run` report (poc.json) the POC page reads: rungs and verdicts."""
    return {
        "plan": {},
        "rungs": [{"label": "1x4", "nodes": 1, "gpus": 4, "job_id": job}],
        "inference": {"steps": []},
        "verdicts": [
            {"capability": "topology", "rung": "1x4", "verdict": "passed", "missing": ""},
            {"capability": "recovery", "rung": "1x4", "verdict": "pending evidence", "missing": "<b>no resume</b>"},
            {"capability": "inference protection", "rung": "inference", "verdict": "not applicable", "missing": ""},
        ],
        "diff": None,
        "report": "out/report.html",
    }


async def test_in_chromium_the_poc_page_shows_the_last_runs_verdicts_each_linked_to_its_evidence(
    console: Console, browser: Browser, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = f"poc-{unique}"
    await publish(console, submitted(job))
    monkeypatch.delenv("LANES_CONSOLE_POC_REPORT", raising=False)
    async with aiohttp.ClientSession() as session, session.get(f"{console.url}api/poc") as none:
        assert none.status == 404
        assert "lanes poc run --out DIR" in await none.text()

    report = tmp_path / "poc.json"
    report.write_text(json.dumps(poc_report(job)))
    monkeypatch.setenv("LANES_CONSOLE_POC_REPORT", str(report))
    page = await browser.new_page()
    await page.goto(f"{console.url}poc")
    await page.wait_for_selector("body[data-ready='true']", timeout=READ_BOUND_S * 1000)
    assert await page.locator("#verdicts thead th").all_text_contents() == ["capability", "1x4", "inference"]
    topology = page.locator("tr[data-capability='topology'] td[data-rung='1x4'] a")
    assert (await topology.text_content(), await topology.get_attribute("href")) == ("passed", f"/jobs/{job}")
    recovery = page.locator("tr[data-capability='recovery'] td[data-rung='1x4']")
    assert await recovery.locator("a").get_attribute("href") == f"/jobs/{job}/attempts"
    assert "<b>no resume</b>" in (await recovery.text_content() or "")  # the report's text stays text
    assert await page.locator("#verdicts b").count() == 0
    inference = page.locator("tr[data-capability='inference protection'] td[data-rung='inference']")
    assert await inference.text_content() == "not applicable"
    await topology.click()
    await page.wait_for_selector("body[data-caught-up='true']", timeout=READ_BOUND_S * 1000)
    assert page.url == f"{console.url}jobs/{job}"

    report.write_text("not json")
    async with aiohttp.ClientSession() as session, session.get(f"{console.url}api/poc") as broken:
        assert broken.status == 404
        assert "cannot read the POC report" in await broken.text()
    await page.close()


async def test_in_chromium_an_operator_cancels_from_the_job_page_and_a_viewer_token_is_refused(
    console: Console, browser: Browser, unique: str
) -> None:
    job = f"cancel-{unique}"
    await publish(console, submitted(job))
    acting = await LanesClient.connect(
        console.nats.url_for("cli"), source="lanes/console", signer=console.nats.signer_for("cli")
    )
    runner, url = await serve(
        console.reader, "127.0.0.1", 0, f"viewer-{unique}", None, Operator(f"operator-{unique}", acting)
    )
    try:
        page = await open_page(browser, f"{url}jobs/{job}?token=viewer-{unique}")
        await page.click("#actions summary")
        await page.fill("#act input[name=by]", "ann")
        await page.fill("#act input[name=reason]", "wrong data set")
        await page.fill("#act input[name=token]", f"viewer-{unique}")  # a viewer's token may only look
        await page.click("#act button[type=submit]")
        await page.wait_for_selector("#act-result[data-status='403']", timeout=READ_BOUND_S * 1000)
        assert "actions need the operator token" in (await page.text_content("#act-result") or "")

        await page.fill("#act input[name=token]", f"operator-{unique}")
        await page.click("#act button[type=submit]")
        await page.wait_for_selector("#act-result[data-status='200']", timeout=READ_BOUND_S * 1000)
        assert await page.input_value("#act input[name=token]") == ""  # not kept in the page
        seq = (await page.text_content("#act-result") or "").rsplit("#", 1)[-1]
        row = page.locator(f"tr[data-seq='{seq}']")
        await row.wait_for(timeout=READ_BOUND_S * 1000)  # the command is on the live timeline
        assert "cancel_requested" in (await row.text_content() or "")
        assert "requested_by=ann (console)" in (await row.locator("td.summary").text_content() or "")
    finally:
        await runner.cleanup()
        await acting.close()
