"""`lanes incident <job>`: the fault bundle, built where the console builds it too (its job page downloads it)."""

from __future__ import annotations

from lanes_console.incident import DECISION_KINDS, affected_requests, bundle, decision_chain, serves, write_bundle

__all__ = ["DECISION_KINDS", "affected_requests", "bundle", "decision_chain", "serves", "write_bundle"]
