"""The audit hash chain as pure functions: every kind of tampering is found, a clean chain never alarms."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from lanes_audit.domain.chain import (
    GENESIS,
    Link,
    Problem,
    ProblemKind,
    RecorderState,
    StoredMessage,
    as_ranges,
    canonical_bytes,
    compare_with_stream,
    link_hash,
    must_reach,
    recorder_problems,
    summarize,
    verify_chain,
)


def _chain(payloads: list[bytes]) -> tuple[list[Link], list[StoredMessage]]:
    links, stream, previous = [], [], GENESIS
    for seq, payload in enumerate(payloads, start=1):
        canonical = canonical_bytes("LANES_JOBS", seq, f"lanes.job.j{seq}.submitted", {"ce-id": str(seq)}, payload)
        link = Link(seq, seq, canonical, previous, link_hash(previous, canonical))
        links.append(link)
        stream.append(StoredMessage(seq, canonical))
        previous = link.hash
    return links, stream


PAYLOADS = [f'{{"n":{i}}}'.encode() for i in range(10)]


def test_a_clean_chain_verifies() -> None:
    links, stream = _chain(PAYLOADS)
    assert verify_chain(links) == []
    assert compare_with_stream(links, stream) == []


def test_canonical_bytes_do_not_depend_on_header_order() -> None:
    a = canonical_bytes("S", 1, "s", {"b": "2", "a": "1"}, b"x")
    b = canonical_bytes("S", 1, "s", {"a": "1", "b": "2"}, b"x")
    assert a == b
    assert canonical_bytes("S", 1, "s", {"a": "1"}, b"x") != canonical_bytes("S", 2, "s", {"a": "1"}, b"x")


def test_an_altered_byte_is_found_at_its_sequence() -> None:
    links, _ = _chain(PAYLOADS)
    links[4] = dataclasses.replace(links[4], canonical=links[4].canonical.replace(b'"n":4', b'"n":5'))
    problems = verify_chain(links)
    assert [(p.kind, p.seq) for p in problems] == [(ProblemKind.ALTERED, 5)]


def test_a_rewritten_chain_is_still_caught_against_the_stream() -> None:
    tampered = [*PAYLOADS[:3], b'{"n":"forged"}', *PAYLOADS[4:]]
    links, _ = _chain(tampered)  # hashes recomputed by the attacker: the chain itself is consistent
    _, stream = _chain(PAYLOADS)
    assert verify_chain(links) == []
    problems = compare_with_stream(links, stream)
    assert [(p.kind, p.seq) for p in problems] == [(ProblemKind.ALTERED, 4)]


def test_a_deleted_link_is_missing() -> None:
    links, stream = _chain(PAYLOADS)
    del links[6]
    problems = verify_chain(links)
    # Counted back from the next link, which is no alarm itself.
    assert [(p.kind, p.seq, p.position) for p in problems] == [(ProblemKind.MISSING, 7, 7)]
    problems = compare_with_stream(links, stream)
    assert [(p.kind, p.seq) for p in problems] == [(ProblemKind.MISSING, 7)]


def test_swapped_links_are_reordered() -> None:
    links, _ = _chain(PAYLOADS)
    links[2], links[3] = (
        dataclasses.replace(links[3], position=3),
        dataclasses.replace(links[2], position=4),
    )
    problems = verify_chain(links)
    assert problems
    assert problems[0].kind in {ProblemKind.REORDERED, ProblemKind.BROKEN_LINK}
    assert problems[0].position == 3  # the first out-of-place link
    assert ProblemKind.REORDERED in {p.kind for p in problems}


def test_an_injected_event_is_not_in_the_stream() -> None:
    links, stream = _chain(PAYLOADS)
    last = links[-1]
    canonical = canonical_bytes("LANES_JOBS", 99, "lanes.job.x.submitted", {}, b"{}")
    links.append(Link(last.position + 1, 99, canonical, last.hash, link_hash(last.hash, canonical)))
    assert verify_chain(links) == []
    problems = compare_with_stream(links, stream)
    assert [(p.kind, p.seq) for p in problems] == [(ProblemKind.INJECTED, 99)]


@settings(max_examples=50)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=30), st.data())
def test_any_single_byte_change_is_detected(payloads: list[bytes], data: st.DataObject) -> None:
    links, stream = _chain(payloads)
    index = data.draw(st.integers(0, len(links) - 1))
    canonical = bytearray(links[index].canonical)
    spot = data.draw(st.integers(0, len(canonical) - 1))
    canonical[spot] ^= data.draw(st.integers(1, 255))
    links[index] = dataclasses.replace(links[index], canonical=bytes(canonical))
    assert verify_chain(links)
    assert compare_with_stream(links, stream)


def test_every_problem_is_named_not_only_the_first() -> None:
    links, stream = _chain(PAYLOADS)
    for index in (2, 8):  # two altered links: the second must not hide behind the first
        links[index] = dataclasses.replace(links[index], canonical=links[index].canonical + b" ")
    del links[5]
    problems = verify_chain(links)
    assert [(p.kind, p.seq, p.position) for p in problems] == [
        (ProblemKind.ALTERED, 3, 3),
        (ProblemKind.MISSING, 6, 6),
        (ProblemKind.ALTERED, 9, 9),
    ]
    against_stream = compare_with_stream(links, stream)
    assert [(p.kind, p.seq) for p in against_stream] == [
        (ProblemKind.ALTERED, 3),
        (ProblemKind.MISSING, 6),
        (ProblemKind.ALTERED, 9),
    ]


def test_problems_are_summarized_per_kind_with_every_place() -> None:
    found = [
        Problem(ProblemKind.MISSING, 6, None, "gone"),
        Problem(ProblemKind.FORGED, 2, None, "unsigned"),
        Problem(ProblemKind.MISSING, 7, None, "gone"),
        Problem(ProblemKind.MISSING, 9, None, "gone"),
        Problem(ProblemKind.ALTERED, None, 4, "checkpoint"),
    ]
    summaries = summarize([*found, Problem(ProblemKind.MISSING, 7, 7, "no link")])  # one place, found twice
    assert [(s.kind, s.count, s.first.seq, s.seqs, s.positions) for s in summaries] == [
        (ProblemKind.MISSING, 3, 6, (6, 7, 9), ()),
        (ProblemKind.FORGED, 1, 2, (2,), ()),
        (ProblemKind.ALTERED, 1, None, (), (4,)),
    ]
    assert as_ranges([9, 6, 7, 1]) == [(1, 1), (6, 7), (9, 9)]


def test_what_the_recorder_acknowledged_or_a_checkpoint_covers_must_be_in_the_chain() -> None:
    links, _ = _chain(PAYLOADS)
    kept = links[:5]  # the last five deleted
    assert must_reach(kept, acknowledged=0, checkpointed=0) == 5  # nothing proves more: the rest is lag
    assert must_reach(kept, acknowledged=10, checkpointed=0) == 10
    assert must_reach(kept, acknowledged=3, checkpointed=8) == 8  # position 8 of a chain that starts at seq 1
    assert must_reach([], acknowledged=4, checkpointed=8) == 4  # no link to place the checkpoint by


def test_a_recorder_that_acknowledged_past_the_head_is_stalled() -> None:
    links, _ = _chain(PAYLOADS)
    stalled = recorder_problems(links[:5], RecorderState("audit", 10), not_yet_recorded=3)
    assert [(p.kind, p.seq) for p in stalled] == [(ProblemKind.STALLED, 6)]
    assert "audit" in stalled[0].detail
    assert recorder_problems(links, RecorderState("audit", 10), not_yet_recorded=3) == []  # caught up: lag only
    gone = recorder_problems(links, RecorderState("audit", None), not_yet_recorded=3)
    assert [p.kind for p in gone] == [ProblemKind.STALLED]
    assert recorder_problems([], RecorderState("audit", None), not_yet_recorded=3) == []  # never ran: nothing to lose
