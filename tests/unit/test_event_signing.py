"""Signed events: Ed25519 over the canonical CloudEvent, checked against a keyring; rotation keeps old
events verifiable; the audit's signer check flags an event whose signer may not write its subject."""

from __future__ import annotations

from pathlib import Path

import pytest

from lanes_audit.views import ProblemKind, SignedMessage, check_signers
from lanes_contract.codec import EncodedEvent, encode
from lanes_contract.events import JobPlaced, JobPlacedData, RankAssignment, RankExited, RankExitedData
from lanes_contract.signing import SIGNATURE_HEADER, EventSigner, Keyring, SignatureError


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
    assert check_signers([stored(1, genuine)], KEYRING) is None
    forged = CLI.sign(placement())  # the cli's own, valid key: but the cli may not place
    problem = check_signers([stored(1, genuine), stored(2, forged)], KEYRING)
    assert problem is not None
    assert (problem.kind, problem.seq) == (ProblemKind.FORGED, 2)
    assert "signed by cli" in problem.detail
    unsigned = check_signers([stored(3, encode(exit_event))], KEYRING)
    assert unsigned is not None
    assert "unsigned" in unsigned.detail
