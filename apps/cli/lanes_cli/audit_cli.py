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

from lanes_audit import views as audit
from lanes_audit.views import (
    Link,
    Problem,
    ProblemKind,
    SignedMessage,
    StoredMessage,
    canonical_bytes,
    check_signers,
    compare_with_stream,
    signature_is_valid,
    verify_chain,
)
from lanes_cli.console import EXIT_BAD_INPUT, EXIT_FAILED, fail, load_settings, out, require, run_async
from lanes_cli.input_files import check_document
from lanes_cli.limits import excerpt
from lanes_contract.client import connect_nats
from lanes_contract.signing import KEYRING_ENV, Keyring, SignatureError
from lanes_contract.streams import JOBS
from lanes_runtime.reader import Selection, iter_stream
from lanes_runtime.store import create_pool

app = typer.Typer(help="The tamper-evident audit copy of the jobs stream.", no_args_is_help=True)


@dataclass(frozen=True)
class Verdict:
    """What verification found: the first problem (None when clean) and what was checked."""

    problem: Problem | None
    links: int
    checkpoints: int
    not_yet_recorded: int

    def as_json(self) -> dict[str, Any]:
        """The verdict as `lanes audit verify --json` prints it."""
        problem = None
        if self.problem is not None:
            p = self.problem
            problem = {"kind": p.kind.value, "seq": p.seq, "position": p.position, "detail": p.detail}
        return {
            "ok": self.problem is None,
            "problem": problem,
            "links": self.links,
            "checkpoints": self.checkpoints,
            "not_yet_recorded": self.not_yet_recorded,
        }


def check_checkpoints(
    links: list[Link], checkpoints: list[tuple[int, bytes, bytes, bytes]], trusted_key: bytes | None
) -> Problem | None:
    """Each checkpoint is signed by the (trusted) key and matches the chain at its position."""
    by_position = {link.position: link for link in links}
    for position, chain_hash, public_key, signature in checkpoints:
        link = by_position.get(position)
        if trusted_key is not None and public_key != trusted_key:
            return Problem(ProblemKind.ALTERED, None, position, "checkpoint signed by an untrusted key")
        if not signature_is_valid(public_key, signature, position, chain_hash):
            return Problem(ProblemKind.ALTERED, None, position, "checkpoint signature does not verify")
        if link is None or link.hash != chain_hash:
            seq = None if link is None else link.seq
            return Problem(ProblemKind.ALTERED, seq, position, "chain no longer matches its signed checkpoint")
    return None


async def verify(
    nats_url: str, database_url: str, trusted_key: bytes | None, keyring: Keyring | None = None
) -> Verdict:
    """Re-read the table and the stream and report the first missing, altered, reordered or injected event.

    With a keyring, also the first event not signed by an identity allowed to write it (forged).
    """
    pool = await create_pool(database_url, max_size=2)
    try:
        async with pool.acquire() as conn:
            links = await audit.links(conn)
            checkpoints = await audit.checkpoints(conn)
    finally:
        await pool.close()
    head_seq = max((link.seq for link in links), default=0)
    stream: list[StoredMessage] = []
    signed: list[SignedMessage] = []
    later = 0
    nc = await connect_nats(nats_url, name="lanes-audit-verify")
    try:
        async for msg in iter_stream(nc.jetstream(), Selection(JOBS.name, JOBS.subjects[0])):
            seq = msg.metadata.sequence.stream
            if seq > head_seq:
                later += 1  # the recorder has not reached it yet: lag, not tampering
                continue
            stream.append(StoredMessage(seq, canonical_bytes(JOBS.name, seq, msg.subject, msg.headers, msg.data)))
            if keyring is not None:
                signed.append(SignedMessage(seq, msg.subject, msg.headers, msg.data))
    finally:
        await nc.close()
    problem = (
        verify_chain(links)
        or compare_with_stream(links, stream)
        or check_checkpoints(links, checkpoints, trusted_key)
        or (check_signers(signed, keyring) if keyring is not None else None)
    )
    return Verdict(problem, len(links), len(checkpoints), later)


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
) -> None:
    """Verify the audit chain and compare it with the stream; exit 1 at the first problem."""
    trusted = _public_key(public_key) if public_key else None
    settings = load_settings(quiet=True)
    nats_url = require(settings.nats_url, "NATS_URL")
    database_url = require(settings.database_url, "DATABASE_URL")
    if keyring_file is not None:
        check_document(keyring_file, what="a keyring is JSON of identity:key id -> hex public key")
    try:
        keyring = Keyring.load(keyring_file) if keyring_file is not None else None
    except SignatureError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    verdict = run_async(lambda: verify(nats_url, database_url, trusted, keyring))
    if as_json:
        out.print_json(json.dumps(verdict.as_json()))
    elif verdict.problem is None:
        out.print(
            f"audit chain verified: {verdict.links} links, {verdict.checkpoints} signed checkpoints, "
            f"{verdict.not_yet_recorded} newer events not yet recorded"
        )
    if verdict.problem is not None:
        p = verdict.problem
        fail(f"{p.kind.value} at sequence {p.seq} (position {p.position}): {p.detail}", EXIT_FAILED)


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
