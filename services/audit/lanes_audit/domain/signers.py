"""Who wrote each event: the same check every consumer runs before it acts (`verified_signer`).

The hash chain proves the copy is complete and unaltered; this proves each event was written by an
identity allowed to write it. An event that is unsigned, signed by a key the keyring does not hold, whose
signature does not match, whose signer's role does not cover its subject, or that a node agent wrote about
another node, is reported as forged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lanes_audit.domain.chain import Problem, ProblemKind
from lanes_contract.signing import Keyring, SignatureError, verified_signer


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
            verified_signer(message.subject, message.headers, message.payload, keyring)
        except SignatureError as exc:  # a ForgeryError too: a valid signature by one who may not say this
            problems.append(Problem(ProblemKind.FORGED, message.seq, None, f"{message.subject}: {exc}"))
    return problems
