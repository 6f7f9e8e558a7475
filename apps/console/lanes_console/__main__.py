"""`lanes-console`: the console as its own process against NATS_URL (its `console` identity: it only reads).

LANES_CONSOLE_HOST (default 127.0.0.1; 0.0.0.0 in a container) and LANES_CONSOLE_PORT (default 8090) say where
it answers; every viewer must show LANES_CONSOLE_TOKEN (unset: a random one, logged once in the link to open).
SIGTERM or Ctrl-C stops it; each open page's feed is closed and its consumer deleted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import structlog

from lanes_console.app import TOKEN_ENV, serve_until, viewer_token
from lanes_contract.client import connect_nats
from lanes_contract.errors import LanesError
from lanes_runtime.log import configure_logging

DEFAULT_PORT = 8090
log = structlog.get_logger(__name__)


async def run(nats_url: str, host: str, port: int) -> None:
    """Serve the console until SIGTERM or SIGINT."""
    nc = await connect_nats(nats_url, name="lanes-console")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        token = viewer_token()
        # A token of its own (LANES_CONSOLE_TOKEN unset) is only known from this line; a given one is not logged.
        given = bool(os.environ.get(TOKEN_ENV))
        await serve_until(
            nc,
            host,
            port,
            stop=stop,
            on_ready=lambda url: log.info("console answering", url=url.split("?", 1)[0] if given else url),
            token=token,
        )
    finally:
        await nc.close()


def port_of(raw: str) -> int:
    """A TCP port (0: any free one), or ValueError saying what is wrong."""
    if not raw.isdigit() or int(raw) > 65535:  # noqa: PLR2004 - the largest TCP port
        msg = f"LANES_CONSOLE_PORT must be a port from 0 to 65535, not {raw[:20]!r}"
        raise ValueError(msg)
    return int(raw)


def main() -> None:
    """Entry point of the console image."""
    configure_logging(os.environ.get("LANES_LOG_LEVEL", "info"), os.environ.get("LANES_LOG_FORMAT"))
    nats_url = os.environ.get("NATS_URL")
    if not nats_url:
        sys.exit("NATS_URL is not set: the console reads the log there")
    try:
        port = port_of(os.environ.get("LANES_CONSOLE_PORT", str(DEFAULT_PORT)))
        asyncio.run(run(nats_url, os.environ.get("LANES_CONSOLE_HOST", "127.0.0.1"), port))
    except (LanesError, ValueError, OSError) as exc:
        sys.exit(f"lanes-console: {exc}")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
