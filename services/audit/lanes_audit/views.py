"""The audit copy's read side for the app: the chain, its signed checkpoints and how to verify them."""

from lanes_audit.adapters.repository import checkpoints, links
from lanes_audit.adapters.signing import signature_is_valid
from lanes_audit.domain.chain import (
    RECORDER_DURABLE,
    Link,
    Problem,
    ProblemKind,
    ProblemSummary,
    RecorderState,
    StoredMessage,
    as_ranges,
    canonical_bytes,
    compare_with_stream,
    must_reach,
    recorder_problems,
    summarize,
    verify_chain,
)
from lanes_audit.domain.signers import SignedMessage, check_signers

__all__ = [
    "RECORDER_DURABLE",
    "Link",
    "Problem",
    "ProblemKind",
    "ProblemSummary",
    "RecorderState",
    "SignedMessage",
    "StoredMessage",
    "as_ranges",
    "canonical_bytes",
    "check_signers",
    "checkpoints",
    "compare_with_stream",
    "links",
    "must_reach",
    "recorder_problems",
    "signature_is_valid",
    "summarize",
    "verify_chain",
]
