"""`lanes console [--port P]`: the live console (apps/console) against NATS_URL, until Ctrl-C."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from nats.aio.client import Client as NatsClient

from lanes_cli.console import EXIT_FAILED, fail, load_settings, out, require, run_async
from lanes_console.app import serve_until, viewer_token
from lanes_contract.client import connect_nats
from lanes_runtime.service import stop_on_signals

DEFAULT_PORT = 8090
__all__ = ["DEFAULT_PORT", "announce", "console", "register", "serve_beside", "viewer_token"]  # `lanes up` uses these


def register(app: typer.Typer) -> None:
    """Add `lanes console` to the `lanes` app."""
    app.command("console")(console)


def console(
    port: Annotated[
        int, typer.Option(help="The port it answers on (0: any free one).", min=0, max=65535)
    ] = DEFAULT_PORT,
    host: Annotated[
        str, typer.Option(help="The address it binds (0.0.0.0 to be reached from elsewhere).")
    ] = "127.0.0.1",
) -> None:
    """Serve the live console: the jobs and each job's swimlanes in a browser, updated as events are stored.

    It only reads the log (give it the `console` identity's NATS_URL). Every view's URL opens the same view.
    Viewers show LANES_CONSOLE_TOKEN (unset: a random one; the printed link carries it).
    """
    nats_url = require(load_settings(quiet=True).nats_url, "NATS_URL")

    async def run() -> None:
        nc = await connect_nats(nats_url, name="lanes-console")
        try:
            stop = stop_on_signals()
            await serve_until(nc, host, port, stop=stop, on_ready=announce, token=viewer_token())
        finally:
            await nc.close()

    try:
        run_async(run)
    except OSError as exc:  # the port is taken, or the address is not this machine's
        fail(f"cannot serve the console on {host}:{port}: {exc.strerror or exc}", EXIT_FAILED)
    except KeyboardInterrupt:
        pass


async def serve_beside(nc: NatsClient, stop: asyncio.Event, token: str) -> None:
    """The console of `lanes up`: on DEFAULT_PORT, or on any free port when that one is taken, until `stop`."""
    try:
        await serve_until(nc, "127.0.0.1", DEFAULT_PORT, stop=stop, on_ready=announce, token=token)
    except OSError:  # another console (or anything) has the port: the printed URL names the one picked
        await serve_until(nc, "127.0.0.1", 0, stop=stop, on_ready=announce, token=token)


def announce(url: str) -> None:
    """Print the link that opens the console, its viewer token in it (`lanes up` prints the same line)."""
    out.print(f"console: {url}", highlight=False, soft_wrap=True)
