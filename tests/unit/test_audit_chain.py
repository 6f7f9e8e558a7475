"""The audit hash chain as pure functions: every kind of tampering is found, a clean chain never alarms."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from lanes_audit.domain.chain import (
    GENESIS,
    Link,
    ProblemKind,
    StoredMessage,
    canonical_bytes,
    compare_with_stream,
    link_hash,
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
    assert verify_chain(links) is None
    assert compare_with_stream(links, stream) is None


def test_canonical_bytes_do_not_depend_on_header_order() -> None:
    a = canonical_bytes("S", 1, "s", {"b": "2", "a": "1"}, b"x")
    b = canonical_bytes("S", 1, "s", {"a": "1", "b": "2"}, b"x")
    assert a == b
    assert canonical_bytes("S", 1, "s", {"a": "1"}, b"x") != canonical_bytes("S", 2, "s", {"a": "1"}, b"x")


def test_an_altered_byte_is_found_at_its_sequence() -> None:
    links, _ = _chain(PAYLOADS)
    links[4] = dataclasses.replace(links[4], canonical=links[4].canonical.replace(b'"n":4', b'"n":5'))
    problem = verify_chain(links)
    assert problem is not None
    assert (problem.kind, problem.seq) == (ProblemKind.ALTERED, 5)


def test_a_rewritten_chain_is_still_caught_against_the_stream() -> None:
    tampered = [*PAYLOADS[:3], b'{"n":"forged"}', *PAYLOADS[4:]]
    links, _ = _chain(tampered)  # hashes recomputed by the attacker: the chain itself is consistent
    _, stream = _chain(PAYLOADS)
    assert verify_chain(links) is None
    problem = compare_with_stream(links, stream)
    assert problem is not None
    assert (problem.kind, problem.seq) == (ProblemKind.ALTERED, 4)


def test_a_deleted_link_is_missing() -> None:
    links, stream = _chain(PAYLOADS)
    del links[6]
    problem = verify_chain(links)
    assert problem is not None
    assert (problem.kind, problem.position) == (ProblemKind.MISSING, 7)
    problem = compare_with_stream(links, stream)
    assert problem is not None
    assert (problem.kind, problem.seq) == (ProblemKind.MISSING, 7)


def test_swapped_links_are_reordered() -> None:
    links, _ = _chain(PAYLOADS)
    links[2], links[3] = (
        dataclasses.replace(links[3], position=3),
        dataclasses.replace(links[2], position=4),
    )
    problem = verify_chain(links)
    assert problem is not None
    assert problem.kind in {ProblemKind.REORDERED, ProblemKind.BROKEN_LINK}
    assert problem.position == 3  # the first out-of-place link


def test_an_injected_event_is_not_in_the_stream() -> None:
    links, stream = _chain(PAYLOADS)
    last = links[-1]
    canonical = canonical_bytes("LANES_JOBS", 99, "lanes.job.x.submitted", {}, b"{}")
    links.append(Link(last.position + 1, 99, canonical, last.hash, link_hash(last.hash, canonical)))
    assert verify_chain(links) is None
    problem = compare_with_stream(links, stream)
    assert problem is not None
    assert (problem.kind, problem.seq) == (ProblemKind.INJECTED, 99)


@settings(max_examples=50)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=30), st.data())
def test_any_single_byte_change_is_detected(payloads: list[bytes], data: st.DataObject) -> None:
    links, stream = _chain(payloads)
    index = data.draw(st.integers(0, len(links) - 1))
    canonical = bytearray(links[index].canonical)
    spot = data.draw(st.integers(0, len(canonical) - 1))
    canonical[spot] ^= data.draw(st.integers(1, 255))
    links[index] = dataclasses.replace(links[index], canonical=bytes(canonical))
    assert verify_chain(links) is not None
    assert compare_with_stream(links, stream) is not None
