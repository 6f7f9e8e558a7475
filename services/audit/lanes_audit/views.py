"""The audit copy's read side for the app: the chain, its signed checkpoints and how to verify them."""

from lanes_audit.adapters.repository import checkpoints, links
from lanes_audit.adapters.signing import signature_is_valid
from lanes_audit.domain.chain import (
    Link,
    Problem,
    ProblemKind,
    StoredMessage,
    canonical_bytes,
    compare_with_stream,
    verify_chain,
)
from lanes_audit.domain.signers import SignedMessage, check_signers

__all__ = [
    "Link",
    "Problem",
    "ProblemKind",
    "SignedMessage",
    "StoredMessage",
    "canonical_bytes",
    "check_signers",
    "checkpoints",
    "compare_with_stream",
    "links",
    "signature_is_valid",
    "verify_chain",
]
