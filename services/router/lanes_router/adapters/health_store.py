"""Shared health bookkeeping in Redis: consecutive failures per replica attempt, and who publishes a transition."""

from __future__ import annotations

import redis.asyncio as aioredis

_PREFIX = "lanes:router:{health}:"
FAILURES_TTL_S = 300
"""A failure streak older than this is forgotten: the replica has had time to be probed back."""
CLAIM_TTL_S = 30
"""If the router that claimed a transition dies before publishing it, another may claim it after this."""


class RedisFailureCounter:
    """`FailureCounter` on Redis: INCR with expiry, and SET NX on a transition key."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def add_failure(self, replica_id: str, attempt: int) -> int:
        """Count one failure; return the consecutive count across routers."""
        key = f"{_PREFIX}failures:{replica_id}:{attempt}"
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, FAILURES_TTL_S)
            count, _ = await pipe.execute()
        return int(count)

    async def clear(self, replica_id: str, attempt: int) -> None:
        """Reset the streak after a success."""
        await self._redis.delete(f"{_PREFIX}failures:{replica_id}:{attempt}")

    async def claim_transition(self, replica_id: str, attempt: int, generation: int) -> bool:
        """First router to call this for (replica, attempt, generation) publishes the change; others fold it."""
        key = f"{_PREFIX}transition:{replica_id}:{attempt}:{generation}"
        return bool(await self._redis.set(key, "1", nx=True, ex=CLAIM_TTL_S))
