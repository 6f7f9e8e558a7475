"""`lanes slurm watch`: Slurm's jobs and nodes on the Lanes timeline (see lanes_observe.slurm)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Annotated

import typer

from lanes_cli.console import EXIT_BAD_INPUT, err, fail, load_settings, require, run_async
from lanes_cli.limits import MAX_OPTION_SECONDS
from lanes_observe.outbox import Outbox, Sender
from lanes_observe.slurm import SOURCE, SlurmWatch
from lanes_runtime.service import stop_on_signals

app = typer.Typer(help="Observe a Slurm cluster: its jobs and nodes on the Lanes timeline.", no_args_is_help=True)


@app.command()
def watch(
    interval: Annotated[
        float, typer.Option(min=0.2, max=MAX_OPTION_SECONDS, help="Seconds between two polls of squeue and sinfo.")
    ] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Poll once, publish, and exit.")] = False,
    outbox: Annotated[Path, typer.Option(help="Where events wait while Lanes is unreachable.")] = Path(
        "~/.cache/lanes/outbox/slurm.ndjson"
    ),
) -> None:
    """Poll `squeue --json` and `sinfo --json`; publish job and node changes until Ctrl-C or SIGTERM."""
    settings = load_settings()
    nats_url = require(settings.nats_url, "NATS_URL")

    async def observe() -> None:
        box = Outbox(outbox.expanduser())
        sender = Sender(box, nats_url, name=SOURCE)
        slurm = SlurmWatch(box, sender)
        try:
            if once:
                try:
                    events = await slurm.poll_once()
                except (RuntimeError, OSError, ValueError) as exc:  # as a polling watch logs and retries them
                    fail(f"slurm poll failed: {exc}", EXIT_BAD_INPUT)
                err.print(f"{len(events)} events; {len(box.lines())} waiting in {box.path}", highlight=False)
                return
            stop = stop_on_signals()
            await slurm.run(stop, interval)
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await sender.close()

    try:
        run_async(observe)
    except KeyboardInterrupt:
        err.print("stopped")
