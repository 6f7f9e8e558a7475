"""The one way a test waits: until a condition holds, re-checked soon after anything changes.

Tests never sleep a fixed time and then assert. `eventually` re-checks the condition at once, then with a
short back-off (10 ms growing to 250 ms), and as soon as a message arrives on any of `subjects` when a NATS
connection is given: on a busy 2-core machine a slow step only makes the wait longer, never the test red.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

_FIRST_PAUSE_S = 0.01
_LONGEST_PAUSE_S = 0.25


async def eventually(
    check: Callable[[], Awaitable[bool]],
    *,
    timeout_s: float = 20.0,
    what: str = "condition",
    nc: NatsClient | None = None,
    subjects: Iterable[str] = (),
) -> None:
    """Wait until `check` holds; fail with `what` after `timeout_s`. Messages on `subjects` wake it early."""
    changed = asyncio.Event()
    subscriptions = []

    async def on_message(_msg: Msg) -> None:
        changed.set()

    if nc is not None:
        subscriptions = [await nc.subscribe(subject, cb=on_message) for subject in subjects]
    deadline = time.monotonic() + timeout_s
    pause = _FIRST_PAUSE_S
    try:
        while not await check():
            left = deadline - time.monotonic()
            if left <= 0:
                msg = f"timed out after {timeout_s:.0f} s waiting for {what}"
                raise AssertionError(msg)
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=min(pause, left))
            pause = min(pause * 2, _LONGEST_PAUSE_S)
    finally:
        for subscription in subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()


def eventually_in_sync_code(check: Callable[[], object], *, timeout_s: float, what: str) -> None:
    """`eventually` for synchronous checks (process and port cleanup), usable inside or outside a loop."""
    deadline = time.monotonic() + timeout_s
    pause = _FIRST_PAUSE_S
    while not check():
        if time.monotonic() >= deadline:
            msg = f"timed out after {timeout_s:.0f} s waiting for {what}"
            raise AssertionError(msg)
        time.sleep(pause)
        pause = min(pause * 2, _LONGEST_PAUSE_S)
