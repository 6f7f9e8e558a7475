"""Who wrote each event: its signature against the keyring, and the signer's role against the subject.

The hash chain proves the copy is complete and unaltered; this proves each event was written by an
identity allowed to write it. An event that is unsigned, signed by a key the keyring does not hold, whose
signature does not match, or whose signer's role does not cover its subject, is reported as forged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lanes_audit.domain.chain import Problem, ProblemKind
from lanes_contract.identities import identity_named, may_publish
from lanes_contract.signing import Keyring, SignatureError


@dataclass(frozen=True)
class SignedMessage:
    """One stored message, as the signer check needs it."""

    seq: int
    subject: str
    headers: Mapping[str, str] | None
    payload: bytes


def check_signers(messages: Iterable[SignedMessage], keyring: Keyring) -> list[Problem]:
    """Every message not signed by an identity allowed to write its subject (all of them, not the first)."""
    problems: list[Problem] = []
    for message in messages:
        try:
            signer = keyring.verify(message.subject, message.headers, message.payload)
        except SignatureError as exc:
            problems.append(Problem(ProblemKind.FORGED, message.seq, None, f"{message.subject}: {exc}"))
            continue
        identity = identity_named(signer)
        if identity is None:
            detail = f"{message.subject}: signer {signer} is no identity"
            problems.append(Problem(ProblemKind.FORGED, message.seq, None, detail))
        elif not may_publish(identity, message.subject):
            detail = f"{message.subject}: signed by {signer}, whose role may not write it"
            problems.append(Problem(ProblemKind.FORGED, message.seq, None, detail))
    return problems
