"""The runtime's shared outage hold: only an unavailable server is waited out, and a stop ends the wait."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from lanes_contract.errors import PoisonEventError
from lanes_contract.streams import JOBS
from lanes_runtime.consumer import ConsumerSpec
from lanes_runtime.delivery import InHand, StoppedError, hold_through_outages, pull_batches, sequence_and_deliveries

SPEC = ConsumerSpec(durable="unit", stream=JOBS, subjects=JOBS.subjects, ack_wait_s=0.3)


@dataclass
class HeldMessage:
    """Stands in for a fetched message: counts the in-progress signals it is given."""

    in_progress_calls: int = 0

    async def in_progress(self) -> None:
        self.in_progress_calls += 1


async def test_an_outage_is_waited_out_with_the_messages_kept_in_progress() -> None:
    failures = [ConnectionRefusedError("database down"), OSError("bus away")]
    held = HeldMessage()
    holds: list[float] = []

    async def attempt() -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    result = await hold_through_outages(
        attempt,
        SPEC,
        held=[held],
        on_hold=lambda _, delay: holds.append(delay),
    )
    assert result == "done"
    assert holds == [0.2, 0.5]  # decide's backoff: the first two pauses of the outage schedule
    assert held.in_progress_calls >= 2  # told JetStream at least once per pause


async def test_a_failure_that_is_about_the_event_is_not_held() -> None:
    tries = 0

    async def attempt() -> None:
        nonlocal tries
        tries += 1
        raise PoisonEventError("the placement names a binary that does not exist")

    with pytest.raises(PoisonEventError):
        await hold_through_outages(attempt, SPEC)
    assert tries == 1


async def test_stopping_during_an_outage_ends_the_hold() -> None:
    stop = asyncio.Event()
    stop.set()

    async def attempt() -> None:
        raise ConnectionResetError("still down")

    with pytest.raises(StoppedError):
        await hold_through_outages(attempt, SPEC, held=[HeldMessage()], stop=stop)


@dataclass(frozen=True)
class FetchedMessage:
    """Stands in for a fetched message: one delivery, named by its reply subject."""

    reply: str


@dataclass
class Subscription:
    """Stands in for a pull subscription: hands out prepared batches, then waits in vain."""

    batches: list[list[FetchedMessage]]
    fetches: int = 0

    async def fetch(self, size: int, wait_s: float) -> list[FetchedMessage]:
        del size, wait_s
        self.fetches += 1
        if self.batches:
            return self.batches.pop(0)
        raise TimeoutError


async def test_the_next_batch_is_fetched_ahead_into_hand_and_still_yielded_after_a_stop() -> None:
    first, second = [FetchedMessage("a1"), FetchedMessage("a2")], [FetchedMessage("b1")]
    sub = Subscription([first, second])
    in_hand = InHand()
    stop = asyncio.Event()
    batches = pull_batches(sub, 2, stop, consumer="unit", in_hand=in_hand)  # type: ignore[arg-type]
    assert [msg.reply for msg in await anext(batches)] == ["a1", "a2"]
    await asyncio.sleep(0)  # the caller works on the first batch; the fetch ahead runs meanwhile
    assert sub.fetches == 2
    assert [msg.reply for msg in in_hand] == ["a1", "a2", "b1"]  # an outage hold keeps all three in progress
    for msg in first:
        in_hand.discard(msg)  # type: ignore[arg-type]
    stop.set()
    assert [msg.reply for msg in await anext(batches)] == ["b1"]  # fetched before the stop: handled, not left
    with pytest.raises(StopAsyncIteration):
        await anext(batches)
    assert sub.fetches == 2
    assert [msg.reply for msg in in_hand] == ["b1"]


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("$JS.ACK.LANES_JOBS.lifecycle.3.1042.977.1796380800000000000.12", (1042, 3)),
        # The longer form: a domain ("_" for none), an account hash, and a trailing token.
        ("$JS.ACK._.ACCHASH.LANES_JOBS.lifecycle.2.77.70.1796380800000000000.0.tok", (77, 2)),
    ],
)
def test_a_message_s_sequence_and_deliveries_come_from_its_ack_subject(reply: str, expected: tuple[int, int]) -> None:
    msg = Msg(_client=None, subject="lanes.job.j1.submitted", reply=reply)  # type: ignore[arg-type]
    assert sequence_and_deliveries(msg) == expected
    assert sequence_and_deliveries(msg) == (msg.metadata.sequence.stream, msg.metadata.num_delivered)


def test_a_message_that_jetstream_did_not_deliver_has_no_sequence() -> None:
    msg = Msg(_client=None, subject="lanes.job.j1.submitted", reply="_INBOX.abc")  # type: ignore[arg-type]
    with pytest.raises(NotJSMessageError):
        sequence_and_deliveries(msg)
