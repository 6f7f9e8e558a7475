"""Concurrency leases in Redis, shared by every router process.

Per replica one sorted set holds the lease ids of its in-flight requests, scored by when each lease
expires (Redis server time, so router clocks never matter). Acquiring is one Lua script that drops expired
leases, applies power-of-two-choices between the first two candidates (the less loaded one under its cap),
falls back to the first other candidate with room, and adds the lease: one round trip per request. Leases
are renewed in bulk while their request runs and released in bulk off the request's path; a router that
crashes stops renewing, and its leases expire after the TTL, so no slot leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Sequence

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from lanes_router.domain.routing import Lease
from lanes_router.service_layer.ports import SharedStateUnavailableError

log = structlog.get_logger(__name__)
KEY_PREFIX = "lanes:router:{leases}:"
"""One hash tag for every lease key, so the multi-key script also runs on a Redis Cluster."""

_ACQUIRE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local function load(i)
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  return redis.call('ZCARD', KEYS[i])
end
local chosen, least = 0, nil
local loads = {}
for i = 1, math.min(2, #KEYS) do
  loads[i] = load(i)
  if loads[i] < tonumber(ARGV[2 + i]) and (least == nil or loads[i] < least) then
    chosen, least = i, loads[i]
  end
end
if chosen == 0 then
  for i = 3, #KEYS do
    loads[i] = load(i)
    if loads[i] < tonumber(ARGV[2 + i]) then
      chosen = i
      break
    end
  end
end
if chosen == 0 then
  return 0
end
redis.call('ZADD', KEYS[chosen], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[chosen], ttl * 3)
return chosen
"""

_RENEW = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', now + ttl, ARGV[i + 1])
  redis.call('PEXPIRE', KEYS[i], ttl * 3)
end
return #KEYS
"""


def lease_key(replica_id: str) -> str:
    """The sorted set of one replica's leases."""
    return f"{KEY_PREFIX}{replica_id}"


class RedisLeases:
    """Acquire, renew and release leases; renewal and release run in a background task (`run`)."""

    def __init__(
        self, redis: aioredis.Redis, *, ttl_s: float = 10.0, owner: str | None = None, answer_timeout_s: float = 1.0
    ) -> None:
        self._redis = redis
        self._answer_timeout_s = answer_timeout_s
        self._ttl_ms = max(100, int(ttl_s * 1000))
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._owner = owner or f"{os.uname().nodename}-{os.getpid()}"
        self._serial = itertools.count()
        self._held: set[Lease] = set()
        self._released: list[Lease] = []
        self._release_due = asyncio.Event()
        self._pending: list[tuple[list[str], list[str | int], asyncio.Future[int]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def held(self) -> int:
        """Leases this router holds right now."""
        return len(self._held)

    async def acquire(self, replica_ids: Sequence[str], caps: Sequence[int]) -> Lease | None:
        """A lease on the chosen replica (see the module docstring for the choice), or None when all are full."""
        if not replica_ids:
            return None
        lease_id = f"{self._owner}-{next(self._serial)}"
        keys = [lease_key(r) for r in replica_ids]
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((keys, [lease_id, self._ttl_ms, *caps], answer))
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self._send_acquires)
        try:
            # Redis down answers with an error, Redis stopped (SIGSTOP) or partitioned never answers: both end
            # here within the bound. A lease Redis grants after we gave up expires with its TTL.
            async with asyncio.timeout(self._answer_timeout_s):
                chosen = await answer
        except (TimeoutError, RedisError, OSError) as exc:
            msg = f"Redis did not answer in {self._answer_timeout_s:g}s: {exc or type(exc).__name__}"
            raise SharedStateUnavailableError(msg) from exc
        if chosen == 0:
            return None
        lease = Lease(replica_ids[chosen - 1], lease_id)
        self._held.add(lease)
        return lease

    def _send_acquires(self) -> None:
        # Every acquire asked for in this turn of the event loop goes in one pipeline: one round trip for
        # all of them, which is what keeps a loaded router from queueing on Redis.
        batch, self._pending = self._pending, []
        task = asyncio.create_task(self._acquire_batch(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _acquire_batch(self, batch: list[tuple[list[str], list[str | int], asyncio.Future[int]]]) -> None:
        try:
            if len(batch) == 1:
                keys, args, _ = batch[0]
                results = [await self._acquire(keys=keys, args=args)]
            else:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for keys, args, _ in batch:
                        await self._acquire(keys=keys, args=args, client=pipe)
                    results = await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - handed to each waiting request, which fails cleanly
            for _, _, answer in batch:
                if not answer.done():
                    answer.set_exception(exc)
            return
        for (_, _, answer), result in zip(batch, results, strict=True):
            if not answer.done():
                answer.set_result(int(result))

    def release(self, lease: Lease) -> None:
        """Give the slot back; the removal is batched with others and sent by `run` within milliseconds."""
        if lease in self._held:
            self._held.discard(lease)
            self._released.append(lease)
            self._release_due.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Send releases as they come and renew held leases every third of the TTL, until `stop`; then flush."""
        renew_every = self._ttl_ms / 3000
        loop = asyncio.get_running_loop()
        next_renewal = loop.time() + renew_every
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                due = asyncio.ensure_future(self._release_due.wait())
                await asyncio.wait(
                    {due, stopping}, timeout=max(0.0, next_renewal - loop.time()), return_when=asyncio.FIRST_COMPLETED
                )
                due.cancel()
                await self._send_releases()
                if loop.time() >= next_renewal:
                    await self._renew_held()
                    next_renewal = loop.time() + renew_every
        finally:
            stopping.cancel()
            with contextlib.suppress(RedisError, OSError):
                await self._send_releases()

    async def _send_releases(self) -> None:
        self._release_due.clear()
        if not self._released:
            return
        batch, self._released = self._released, []
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for lease in batch:
                    pipe.zrem(lease_key(lease.replica_id), lease.lease_id)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            # Not retried: an unreleased lease expires on its own after the TTL.
            log.warning("lease release failed; the leases will expire", error=str(exc), leases=len(batch))

    async def _renew_held(self) -> None:
        held = list(self._held)
        if not held:
            return
        try:
            await self._renew(
                keys=[lease_key(lease.replica_id) for lease in held],
                args=[self._ttl_ms] + [lease.lease_id for lease in held],
            )
        except (RedisError, OSError) as exc:
            log.warning("lease renewal failed; retrying at the next tick", error=str(exc), leases=len(held))

    async def check(self) -> bool:
        """Whether Redis answers a PING within the answer timeout."""
        try:
            async with asyncio.timeout(self._answer_timeout_s):
                return bool(await self._redis.ping())
        except (TimeoutError, RedisError, OSError):
            return False

    async def in_flight(self, replica_id: str) -> int:
        """Leases (of all routers) currently held on a replica, expired ones not counted."""
        now_s, now_us = await self._redis.time()
        now_ms = now_s * 1000 + now_us // 1000
        return int(await self._redis.zcount(lease_key(replica_id), f"({now_ms}", "+inf"))
