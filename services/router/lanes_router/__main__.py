"""`python -m lanes_router`: one router process against NATS_URL and REDIS_URL (no PostgreSQL needed).

Settings come from the `LANES_ROUTER_*` variables; SIGTERM or Ctrl-C stops it gracefully (in-flight
requests finish, leases are released, provenance is flushed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable

from lanes_contract.client import connect_nats
from lanes_contract.errors import LanesError
from lanes_router.entrypoints.config import RouterConfig
from lanes_router.entrypoints.runner import RouterRunner
from lanes_runtime.cache import connect_redis
from lanes_runtime.log import configure_logging


async def serve(nats_url: str, redis_url: str, config: RouterConfig) -> None:
    """Run one router until SIGTERM or SIGINT."""
    nc = await connect_nats(nats_url, name="lanes-router")
    redis = await connect_redis(redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runner = RouterRunner(nc, redis, config)
        await runner.provision()
        await runner.run(stop)
    finally:
        await redis.aclose()
        await nc.close()


def _fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """Uvloop's event loop where it is installed (it roughly halves the router's cost per request), else asyncio's."""
    try:
        import uvloop  # noqa: PLC0415 - optional at import time, so the router also runs where it has no wheel
    except ImportError:
        return None
    return uvloop.new_event_loop


def main() -> None:
    """Entry point."""
    configure_logging(os.environ.get("LANES_LOG_LEVEL", "info"), os.environ.get("LANES_LOG_FORMAT") or None)
    nats_url, redis_url = os.environ.get("NATS_URL"), os.environ.get("REDIS_URL")
    if not nats_url or not redis_url:
        sys.stderr.write("error: set NATS_URL and REDIS_URL (`lanes up` prints them)\n")
        sys.exit(2)
    try:
        config = RouterConfig.from_env()
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)
    try:
        with asyncio.Runner(loop_factory=_fast_loop_factory()) as runner:
            runner.run(serve(nats_url, redis_url, config))
    except LanesError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(4)


if __name__ == "__main__":
    main()
