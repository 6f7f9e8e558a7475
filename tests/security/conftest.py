"""Fixtures of the attack tests: a real NATS with every identity (`secured_nats`), and services on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg
import pytest

from lanes_contract.client import connect_nats, denied_operations
from lanes_lifecycle.entrypoints.job_api import JobApi
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedNats


@pytest.fixture
async def job_api(secured_nats: EmbeddedNats, urls: ServerUrls) -> AsyncIterator[EmbeddedNats]:
    """The lifecycle's job API, served as the `lifecycle` identity on `secured_nats`; it must never be refused."""
    pool = await asyncpg.create_pool(urls.database_url, min_size=1, max_size=2)
    nc = await connect_nats(secured_nats.url_for("lifecycle"), name="lifecycle-api")
    stop = asyncio.Event()
    serving = asyncio.create_task(JobApi(nc, pool).run(stop))
    try:
        yield secured_nats
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await serving
        await nc.close()
        await pool.close()
    assert not denied_operations(nc), "the serving identity was refused something"
