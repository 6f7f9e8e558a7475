"""Running the `lanes` command against a given set of servers, for the CLI tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from lanes_common.settings import ServerUrls

LANES = str(Path(sys.executable).parent / "lanes")


def run_lanes(urls: ServerUrls, *args: str) -> subprocess.CompletedProcess[str]:
    """`lanes ARGS` with the three server URLs, JSON logs and a wide terminal (no wrapped lines)."""
    env = os.environ | {
        "NATS_URL": urls.nats_url,
        "DATABASE_URL": urls.database_url,
        "REDIS_URL": urls.redis_url,
        "LANES_LOG_FORMAT": "json",
        "COLUMNS": "400",
    }
    return subprocess.run([LANES, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


async def run_lanes_async(urls: ServerUrls, *args: str) -> subprocess.CompletedProcess[str]:
    """`run_lanes` without blocking the event loop (services may be running in it)."""
    return await asyncio.to_thread(run_lanes, urls, *args)
