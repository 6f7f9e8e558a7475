"""`lanes dead list | replay`: the dead letters, and re-driving them after a fix under their original ids."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from lanes_cli.console import fail, load_settings, out, require, run_async
from lanes_cli.terminal import print_line
from lanes_contract.client import connect_nats
from lanes_contract.codec import MSG_ID_HEADER
from lanes_contract.streams import DEAD
from lanes_runtime.delivery import (
    DEAD_CONSUMER,
    DEAD_DELIVERIES,
    DEAD_REASON,
    DEAD_SEQUENCE,
    DEAD_STREAM,
    DEAD_SUBJECT,
    ORIGINAL_MSG_ID,
)
from lanes_runtime.reader import Selection, iter_stream

app = typer.Typer(help="Dead letters: list them, and replay them once the cause is fixed.", no_args_is_help=True)
_DEAD_HEADERS = (DEAD_REASON, DEAD_STREAM, DEAD_SEQUENCE, DEAD_SUBJECT, DEAD_CONSUMER, DEAD_DELIVERIES, ORIGINAL_MSG_ID)
EXIT_NOT_FOUND = 3


async def _letters(js: JetStreamContext) -> list[Msg]:
    return [msg async for msg in iter_stream(js, Selection(DEAD.name, "lanes.dead.>"))]


def _summary(msg: Msg) -> dict[str, str | int]:
    headers = msg.headers or {}
    return {
        "dead_seq": int(msg.metadata.sequence.stream) if msg.metadata else 0,
        "consumer": headers.get(DEAD_CONSUMER, ""),
        "subject": headers.get(DEAD_SUBJECT, ""),
        "stream_seq": int(headers.get(DEAD_SEQUENCE, "0")),
        "event_id": headers.get("ce-id", ""),
        "deliveries": int(headers.get(DEAD_DELIVERIES, "0")),
        "reason": headers.get(DEAD_REASON, ""),
    }


@app.command("list")
def list_command(as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines.")] = False) -> None:
    """Every dead letter: which consumer gave up on which event, and why."""
    nats_url = require(load_settings(quiet=True).nats_url, "NATS_URL")

    async def work() -> list[dict[str, str | int]]:
        nc = await connect_nats(nats_url, name="lanes-dead")
        try:
            return [_summary(msg) for msg in await _letters(nc.jetstream())]
        finally:
            await nc.close()

    # A reason quotes the event it refused: never markup (`[red]` stays text), never a raw control character.
    for letter in run_async(work):
        if as_json:
            print_line(out, json.dumps(letter, ensure_ascii=True))
        else:
            print_line(
                out,
                f"{letter['dead_seq']}  {letter['consumer']}  {letter['subject']} (seq {letter['stream_seq']})"
                f"  {letter['reason']}",
            )


@app.command("replay")
def replay_command(
    dead_seq: Annotated[list[int], typer.Argument(help="Sequences in LANES_DEAD (from `lanes dead list`).")],
) -> None:
    """Publish each dead letter's event again on its original subject, with its original event id.

    Consumers recognise an event id they already processed, so only the consumer that gave up on it applies
    it; replaying the same letter twice publishes it once (its message id derives from the letter).
    """
    nats_url = require(load_settings(quiet=True).nats_url, "NATS_URL")

    async def work() -> list[str]:
        nc = await connect_nats(nats_url, name="lanes-dead")
        js = nc.jetstream()
        try:
            letters = {int(m.metadata.sequence.stream): m for m in await _letters(js) if m.metadata}
            missing = [seq for seq in dead_seq if seq not in letters]
            if missing:
                fail(f"no dead letter at {missing}", EXIT_NOT_FOUND)
            done = []
            for seq in dead_seq:
                letter = letters[seq]
                headers = {
                    k: v
                    for k, v in (letter.headers or {}).items()
                    if k not in _DEAD_HEADERS and not k.startswith("Nats-")  # the dead letter's own publish options
                }
                headers[MSG_ID_HEADER] = f"replay-{(letter.headers or {}).get(MSG_ID_HEADER, seq)}"  # once per letter
                subject = (letter.headers or {})[DEAD_SUBJECT]
                ack = await js.publish(subject, letter.data, headers=headers)
                done.append(f"{seq} -> {subject} (seq {ack.seq}{', already replayed' if ack.duplicate else ''})")
            return done
        finally:
            await nc.close()

    for line in run_async(work):
        print_line(out, line)
