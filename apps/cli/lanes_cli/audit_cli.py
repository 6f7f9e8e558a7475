"""`lanes audit verify | export`: check the audit copy against itself and the stream, or hand it on."""

from __future__ import annotations

import base64
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from lanes_audit import views as audit
from lanes_audit.views import (
    RECORDER_DURABLE,
    Link,
    Problem,
    ProblemKind,
    ProblemSummary,
    RecorderState,
    SignedMessage,
    StoredMessage,
    as_ranges,
    canonical_bytes,
    check_signers,
    compare_with_stream,
    must_reach,
    recorder_problems,
    signature_is_valid,
    summarize,
    verify_chain,
)
from lanes_cli.console import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    err,
    fail,
    load_settings,
    one_line,
    out,
    print_big_json,
    require,
    run_async,
)
from lanes_cli.input_files import check_document
from lanes_cli.limits import excerpt
from lanes_cli.terminal import markup
from lanes_contract.client import connect_nats
from lanes_contract.ids import is_valid_token
from lanes_contract.signing import KEYRING_ENV, Keyring, SignatureError
from lanes_contract.streams import JOBS
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.store import create_pool

app = typer.Typer(help="The tamper-evident audit copy of the jobs stream.", no_args_is_help=True)


@dataclass(frozen=True)
class Verdict:
    """What verification found: every problem, in the order found (none when clean), and what was checked."""

    problems: list[Problem]
    links: int
    checkpoints: int
    not_yet_recorded: int

    @property
    def problem(self) -> Problem | None:
        """The first problem found, or None for a clean copy."""
        return self.problems[0] if self.problems else None

    def summaries(self) -> list[ProblemSummary]:
        """The problems grouped by kind: count, first, and every sequence (or position) each names."""
        return summarize(self.problems)

    def as_json(self) -> dict[str, Any]:
        """The verdict as `lanes audit verify --json` prints it."""
        return {
            "ok": not self.problems,
            "problem": None if self.problem is None else _problem_json(self.problem),
            "problems": [
                {
                    "kind": summary.kind.value,
                    "count": summary.count,
                    "first": _problem_json(summary.first),
                    "seqs": [list(run) for run in as_ranges(summary.seqs)],
                    "positions": [list(run) for run in as_ranges(summary.positions)],
                }
                for summary in self.summaries()
            ],
            "links": self.links,
            "checkpoints": self.checkpoints,
            "not_yet_recorded": self.not_yet_recorded,
        }


def _problem_json(problem: Problem) -> dict[str, Any]:
    return {"kind": problem.kind.value, "seq": problem.seq, "position": problem.position, "detail": problem.detail}


MAX_RUNS_SHOWN = 10
"""Runs of sequences one line names; a longer list is counted, and `--json` has it whole."""


def _runs_text(numbers: tuple[int, ...]) -> str:
    runs = as_ranges(numbers)
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:MAX_RUNS_SHOWN])
    return shown + (f" and {len(runs) - MAX_RUNS_SHOWN} more runs" if len(runs) > MAX_RUNS_SHOWN else "")


def summary_line(summary: ProblemSummary) -> str:
    """One line for one kind of problem: how many, the first, and which sequences (or positions)."""
    first = summary.first
    where = f"sequence {first.seq}" if first.seq is not None else f"position {first.position}"
    line = f"{summary.kind.value}: {summary.count} (first at {where}: {first.detail})"
    if summary.seqs:
        line += f"; sequences {_runs_text(summary.seqs)}"
    if summary.positions:
        line += f"; positions {_runs_text(summary.positions)}"
    return line


def check_checkpoints(
    links: list[Link], checkpoints: list[tuple[int, bytes, bytes, bytes]], trusted_key: bytes | None
) -> list[Problem]:
    """Each checkpoint is signed by the (trusted) key and matches the chain at its position."""
    by_position = {link.position: link for link in links}
    problems: list[Problem] = []
    for position, chain_hash, public_key, signature in checkpoints:
        link = by_position.get(position)
        if trusted_key is not None and public_key != trusted_key:
            problems.append(Problem(ProblemKind.ALTERED, None, position, "checkpoint signed by an untrusted key"))
        elif not signature_is_valid(public_key, signature, position, chain_hash):
            problems.append(Problem(ProblemKind.ALTERED, None, position, "checkpoint signature does not verify"))
        elif link is None or link.hash != chain_hash:
            seq = None if link is None else link.seq
            detail = "chain no longer matches its signed checkpoint"
            problems.append(Problem(ProblemKind.ALTERED, seq, position, detail))
    return problems


def last_checkpointed(checkpoints: list[tuple[int, bytes, bytes, bytes]], trusted_key: bytes | None) -> int:
    """The highest position a valid (and, given a key, trusted) checkpoint proves the chain once reached."""
    return max(
        (
            position
            for position, chain_hash, public_key, signature in checkpoints
            if (trusted_key is None or public_key == trusted_key)
            and signature_is_valid(public_key, signature, position, chain_hash)
        ),
        default=0,
    )


async def _recorder_state(js: JetStreamContext, durable: str) -> RecorderState:
    try:
        info = await js.consumer_info(JOBS.name, durable)
    except NotFoundError:
        return RecorderState(durable, None)
    return RecorderState(durable, int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0)


async def verify(
    nats_url: str,
    database_url: str,
    trusted_key: bytes | None,
    keyring: Keyring | None = None,
    *,
    recorder: str = RECORDER_DURABLE,
) -> Verdict:
    """Re-read the table and the stream and report every missing, altered, reordered or injected event.

    With a keyring, also every event not signed by an identity allowed to write it (forged). What lies past
    the chain's head is lag only while nothing proves it was recorded: what the recorder acknowledged, or a
    signed checkpoint covers, is loss when it is not in the chain, and a recorder that acknowledged past
    the head is stalled.
    """
    nc = await connect_nats(nats_url, name="lanes-audit-verify")
    try:
        js = nc.jetstream()
        # Before the table: the recorder acknowledges only after its links commit, so an ack floor read
        # first is covered by the rows read next, however fast the recorder moves in between.
        state = await _recorder_state(js, recorder)
        pool = await create_pool(database_url, max_size=2)
        try:
            async with pool.acquire() as conn:
                links = await audit.links(conn)
                checkpoints = await audit.checkpoints(conn)
        finally:
            await pool.close()
        floor = must_reach(links, state.acknowledged or 0, last_checkpointed(checkpoints, trusted_key))
        stream: list[StoredMessage] = []
        signed: list[SignedMessage] = []
        later = 0
        async for msg in iter_stream(js, Selection(JOBS.name, JOBS.subjects[0])):
            seq = msg.metadata.sequence.stream
            if seq > floor:
                later += 1  # nothing proves the recorder reached it yet: lag, not tampering
                continue
            stream.append(StoredMessage(seq, canonical_bytes(JOBS.name, seq, msg.subject, msg.headers, msg.data)))
            if keyring is not None:
                signed.append(SignedMessage(seq, msg.subject, msg.headers, msg.data))
    finally:
        await nc.close()
    problems = [
        *verify_chain(links),
        *compare_with_stream(links, stream),
        *check_checkpoints(links, checkpoints, trusted_key),
        *recorder_problems(links, state, later),
        *(check_signers(signed, keyring) if keyring is not None else ()),
    ]
    return Verdict(problems, len(links), len(checkpoints), later)


def _public_key(text: str) -> bytes:
    """An Ed25519 public key written as hex, or exit 2 saying what was expected."""
    try:
        key = bytes.fromhex(text)
        Ed25519PublicKey.from_public_bytes(key)
    except ValueError:
        fail(f"--public-key {excerpt(text)}: expected an Ed25519 public key as 64 hex digits", EXIT_BAD_INPUT)
    return key


@app.command("verify")
def verify_command(
    public_key: Annotated[str | None, typer.Option(help="Trusted Ed25519 public key (hex) of the checkpoints.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    keyring_file: Annotated[
        Path | None,
        typer.Option("--keyring", envvar=KEYRING_ENV, help="Public keys of the producers: report forged events."),
    ] = None,
    recorder: Annotated[
        str, typer.Option(help="The recorder's durable consumer: what it acknowledged must be in the chain.")
    ] = RECORDER_DURABLE,
) -> None:
    """Verify the audit chain and compare it with the stream; exit 1 naming every problem, one line per kind."""
    trusted = _public_key(public_key) if public_key else None
    if not is_valid_token(recorder):  # it becomes a token of the consumer-info subject: never a wildcard
        fail(
            f"--recorder {excerpt(recorder)}: a consumer name is 1-128 characters from A-Z a-z 0-9 _ -", EXIT_BAD_INPUT
        )
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    database_url = require(settings.database_url, "DATABASE_URL")
    if keyring_file is not None:
        check_document(keyring_file, what="a keyring is JSON of identity:key id -> hex public key")
    try:
        keyring = Keyring.load(keyring_file) if keyring_file is not None else None
    except SignatureError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    verdict = run_async(lambda: verify(nats_url, database_url, trusted, keyring, recorder=recorder))
    if as_json:
        print_big_json(verdict.as_json())  # a forged event in every other sequence is a long list of runs
    elif verdict.problem is None:
        out.print(
            f"audit chain verified: {verdict.links} links, {verdict.checkpoints} signed checkpoints, "
            f"{verdict.not_yet_recorded} newer events not yet recorded"
        )
    if verdict.problem is not None:
        if not as_json:
            for summary in verdict.summaries()[:-1]:  # the last kind is the exit line, as every failure's
                err.print(f"[red]error:[/red] {markup(one_line(summary_line(summary)))}", highlight=False)
        fail(summary_line(verdict.summaries()[-1]), EXIT_FAILED)


@app.command("export")
def export_command() -> None:
    """Write the chain as NDJSON on stdout: position, seq, hashes and the canonical bytes (base64)."""
    settings = load_settings(quiet=True)
    database_url = require(settings.database_url, "DATABASE_URL")

    async def read() -> list[Link]:
        pool = await create_pool(database_url, max_size=1)
        try:
            async with pool.acquire() as conn:
                return await audit.links(conn)
        finally:
            await pool.close()

    for link in run_async(read):
        row = {
            "position": link.position,
            "stream": JOBS.name,
            "seq": link.seq,
            "previous": link.previous.hex(),
            "hash": link.hash.hex(),
            "canonical": base64.b64encode(link.canonical).decode(),
        }
        sys.stdout.write(json.dumps(row, separators=(",", ":")) + "\n")
