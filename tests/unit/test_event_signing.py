"""Signed events: Ed25519 over the canonical CloudEvent, checked against a keyring; rotation keeps old
events verifiable; the audit's signer check flags an event whose signer may not write its subject."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.msg import Msg

from lanes_audit.views import ProblemKind, SignedMessage, check_signers
from lanes_contract.codec import EncodedEvent, encode
from lanes_contract.events import JobPlaced, JobPlacedData, RankAssignment, RankExited, RankExitedData
from lanes_contract.signing import (
    KEYRING_ENV,
    SIGNATURE_HEADER,
    SIGNER_HEADER,
    EventSigner,
    ForgeryError,
    Keyring,
    SignatureError,
    verified_signer,
)
from lanes_runtime.consumer import _decoded_batch
from lanes_runtime.settings import configured_keyring


def placement(job: str = "j1") -> EncodedEvent:
    data = JobPlacedData(assignments=(RankAssignment(rank=0, node="node-1", gpus=(0,)),))
    return encode(JobPlaced(source="lanes/scheduler", jobid=job, attempt=1, data=data))


def stored(seq: int, encoded: EncodedEvent) -> SignedMessage:
    return SignedMessage(seq, encoded.subject, encoded.headers, encoded.payload)


SCHEDULER = EventSigner.generate("scheduler")
CLI = EventSigner.generate("cli")
KEYRING = Keyring({}).with_key(SCHEDULER).with_key(CLI)


def test_a_signed_event_names_its_signer_and_a_resend_is_identical() -> None:
    event = placement()
    signed = SCHEDULER.sign(event)
    assert KEYRING.verify(signed.subject, signed.headers, signed.payload) == "scheduler"
    assert SCHEDULER.sign(event).headers == signed.headers  # deterministic: a re-send is the same message


def test_an_altered_unsigned_or_unknown_signature_is_refused() -> None:
    signed = SCHEDULER.sign(placement())
    with pytest.raises(SignatureError, match="does not match"):
        KEYRING.verify(signed.subject, signed.headers, signed.payload.replace(b"node-1", b"node-9"))
    with pytest.raises(SignatureError, match="does not match"):
        KEYRING.verify("lanes.job.other.placed", signed.headers, signed.payload)
    with pytest.raises(SignatureError, match="unsigned"):
        KEYRING.verify(signed.subject, {k: v for k, v in signed.headers.items() if k != SIGNATURE_HEADER}, b"{}")
    stranger = EventSigner.generate("scheduler", "k9").sign(placement())
    with pytest.raises(SignatureError, match="not in the keyring"):
        KEYRING.verify(stranger.subject, stranger.headers, stranger.payload)


def test_rotation_keeps_the_old_keys_events_verifiable(tmp_path: Path) -> None:
    old = SCHEDULER.sign(placement("before"))
    rotated = EventSigner.generate("scheduler", "k2")
    keyring = KEYRING.with_key(rotated)
    after = placement("after")
    new = rotated.sign(after)
    path = tmp_path / "keyring.json"
    path.write_text(keyring.dump())
    reloaded = Keyring.load(path)
    assert reloaded.verify(old.subject, old.headers, old.payload) == "scheduler"
    assert reloaded.verify(new.subject, new.headers, new.payload) == "scheduler"
    key_file = tmp_path / "scheduler.key"
    key_file.write_text(rotated.dump())
    assert EventSigner.load(key_file).sign(after).headers == new.headers


def test_the_audit_check_flags_an_event_signed_by_a_role_that_may_not_write_it() -> None:
    genuine = SCHEDULER.sign(placement())
    exit_event = RankExited(
        source="agent/node-1", jobid="j1", attempt=1, node="node-1", rank=0, data=RankExitedData(exit_code=0)
    )
    assert check_signers([stored(1, genuine)], KEYRING) == []
    forged = CLI.sign(placement())  # the cli's own, valid key: but the cli may not place
    (problem,) = check_signers([stored(1, genuine), stored(2, forged)], KEYRING)
    assert (problem.kind, problem.seq) == (ProblemKind.FORGED, 2)
    assert "signed by cli" in problem.detail
    (unsigned,) = check_signers([stored(3, encode(exit_event))], KEYRING)
    assert "unsigned" in unsigned.detail


# --- what a consumer checks before it acts (`verified_signer`) ------------------------------------------------

AGENT_1 = EventSigner.generate("agent-node-1")
CONSUMER_KEYRING = KEYRING.with_key(AGENT_1)


def rank_exit(node: str, source: str | None = None) -> EncodedEvent:
    return encode(
        RankExited(
            source=source or f"agent/{node}",
            jobid="j1",
            attempt=1,
            node=node,
            rank=1,
            data=RankExitedData(exit_code=1),
        )
    )


def test_an_honest_event_names_its_signer() -> None:
    for signer, event in ((SCHEDULER, placement()), (AGENT_1, rank_exit("node-1"))):
        signed = signer.sign(event)
        assert verified_signer(signed.subject, signed.headers, signed.payload, CONSUMER_KEYRING) == signer.identity


def test_the_issue_34_forgery_a_garbage_signer_claiming_the_scheduler_is_refused() -> None:
    event = rank_exit("node-2", source="lanes/scheduler")
    garbage = dict(event.headers) | {SIGNER_HEADER: "scheduler:\x1b[31mk1", SIGNATURE_HEADER: "not base64!"}
    with pytest.raises(SignatureError, match="not in the keyring") as refused:
        verified_signer(event.subject, garbage, event.payload, CONSUMER_KEYRING)
    assert not isinstance(refused.value, ForgeryError)
    assert "\x1b" not in str(refused.value)  # a reason is printable whatever the header held
    real_key_bad_signature = garbage | {SIGNER_HEADER: SCHEDULER.reference}
    with pytest.raises(SignatureError, match="does not match"):
        verified_signer(event.subject, real_key_bad_signature, event.payload, CONSUMER_KEYRING)
    with pytest.raises(SignatureError, match="unsigned"):
        verified_signer(event.subject, event.headers, event.payload, CONSUMER_KEYRING)


def test_a_valid_signature_by_an_identity_whose_role_does_not_cover_the_subject_is_a_forgery() -> None:
    forged = CLI.sign(rank_exit("node-2"))  # the cli's own key, but only node agents report rank exits
    with pytest.raises(ForgeryError, match=r"signed by cli, whose role may not write lanes\.job\.j1\.rank_exited"):
        verified_signer(forged.subject, forged.headers, forged.payload, CONSUMER_KEYRING)
    stranger = EventSigner.generate("mallory")
    unknown = stranger.sign(placement())
    with pytest.raises(ForgeryError, match="mallory, which is no identity"):
        verified_signer(unknown.subject, unknown.headers, unknown.payload, CONSUMER_KEYRING.with_key(stranger))


def test_a_node_agent_speaks_only_for_its_own_node_and_as_itself() -> None:
    for event, reason in (
        (rank_exit("node-2"), "about node node-2: an agent speaks only for its own node"),
        (rank_exit("node-1", source="lanes/scheduler"), "claims the source lanes/scheduler, not agent/node-1"),
    ):
        forged = AGENT_1.sign(event)
        with pytest.raises(ForgeryError, match=reason):
            verified_signer(forged.subject, forged.headers, forged.payload, CONSUMER_KEYRING)


def test_a_process_reads_its_keyring_from_lanes_keyring_and_without_one_verifies_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEYRING_ENV, raising=False)
    assert configured_keyring() is None
    path = tmp_path / "keyring.json"
    path.write_text(CONSUMER_KEYRING.dump())
    monkeypatch.setenv(KEYRING_ENV, str(path))
    loaded = configured_keyring()
    assert loaded is not None
    assert loaded.keys == CONSUMER_KEYRING.keys
    path.write_text("not json")
    with pytest.raises(SignatureError, match="is not a Lanes keyring"):
        configured_keyring()  # a service whose keyring is unreadable does not start unverified


def test_a_signature_verified_before_passes_only_the_same_signed_bytes() -> None:
    signed = AGENT_1.sign(rank_exit("node-1"))
    for _ in range(2):  # the second is served from what this process already verified
        assert verified_signer(signed.subject, signed.headers, signed.payload, CONSUMER_KEYRING) == "agent-node-1"
    altered = signed.payload.replace(b'"exit_code":1', b'"exit_code":0')
    assert altered != signed.payload
    with pytest.raises(SignatureError, match="does not match"):
        verified_signer(signed.subject, signed.headers, altered, CONSUMER_KEYRING)
    other_key = Keyring({AGENT_1.reference: EventSigner.generate("agent-node-1").public_key})
    with pytest.raises(SignatureError, match="does not match"):  # a keyring holding another key for that name
        verified_signer(signed.subject, signed.headers, signed.payload, other_key)


def test_the_audit_names_a_node_agent_speaking_for_another_node_as_a_consumer_would() -> None:
    honest, about_another = AGENT_1.sign(rank_exit("node-1")), AGENT_1.sign(rank_exit("node-2"))
    (problem,) = check_signers([stored(1, honest), stored(2, about_another)], CONSUMER_KEYRING)
    assert (problem.kind, problem.seq) == (ProblemKind.FORGED, 2)
    assert "an agent speaks only for its own node" in problem.detail


def test_a_keyring_is_read_within_a_bound() -> None:
    with pytest.raises(SignatureError, match="larger than"):
        Keyring.load(Path("/dev/zero"))


async def test_a_large_batch_verifies_on_two_threads_and_keeps_its_order() -> None:
    """The consumer verifies half of a large batch on a worker thread; each message keeps its own verdict."""
    signed = [SCHEDULER.sign(placement(f"batch-{i}")) for i in range(40)]
    short = {**signed[31].headers, SIGNATURE_HEADER: "c2hvcnQ="}  # base64 of 5 bytes: no Ed25519 signature
    msgs = [
        Msg(None, e.subject, f"$JS.ACK.LANES_JOBS.c.1.{seq}.{seq}.0.0", e.payload, dict(e.headers))  # type: ignore[arg-type]
        for seq, e in enumerate(signed, start=1)
    ]
    msgs[5].data = msgs[5].data.replace(b"node-1", b"node-9")  # first half: altered after signing
    msgs[31].headers = short  # second half, on the worker thread
    items = await _decoded_batch(msgs, KEYRING)
    refused = {i: item.invalid for i, item in enumerate(items) if item.event is None}
    assert set(refused) == {5, 31}
    assert all(
        str(reason).startswith("forged: the signature of scheduler:k1 does not match") for reason in refused.values()
    )
    assert [item.seq for item in items] == list(range(1, 41))
    assert [item.event.jobid for item in items if item.event is not None] == [
        f"batch-{i}" for i in range(40) if i not in refused
    ]
