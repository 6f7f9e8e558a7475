"""Redis: the hot shared state (router counters, health, leases). Checked for version at connect."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from lanes_contract.errors import ServerUnavailableError, UnsupportedServerError

MIN_REDIS_VERSION = (6, 2)


async def connect_redis(url: str) -> aioredis.Redis:
    """Connect and check the server is Redis >= 6.2, or raise a clear error."""
    client = aioredis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        info = await client.info("server")
    except (RedisError, OSError) as exc:
        await client.aclose()
        msg = f"cannot reach Redis at {url}: {exc}"
        raise ServerUnavailableError(msg) from exc
    version = str(info.get("redis_version", "0"))
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_REDIS_VERSION:
        await client.aclose()
        msg = f"Redis {version} at {url} is too old; Lanes needs Redis >= 6.2"
        raise UnsupportedServerError(msg)
    return client
