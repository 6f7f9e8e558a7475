"""Ed25519 signing of chain checkpoints; the key comes from LANES_AUDIT_KEY or LANES_AUDIT_KEY_FILE."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import structlog
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

log = structlog.get_logger(__name__)


def checkpoint_message(position: int, chain_hash: bytes) -> bytes:
    """What a checkpoint signs: the chain head at a position."""
    return f"lanes-audit-checkpoint-v1:{position}:{chain_hash.hex()}".encode()


@dataclass(frozen=True)
class Signer:
    """An Ed25519 key that signs checkpoints."""

    key: Ed25519PrivateKey

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte public key verifiers need."""
        return self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, position: int, chain_hash: bytes) -> bytes:
        """Sign the chain head at `position`."""
        return self.key.sign(checkpoint_message(position, chain_hash))

    @classmethod
    def from_env(cls) -> Signer:
        """The key from LANES_AUDIT_KEY (64 hex digits) or LANES_AUDIT_KEY_FILE; a fresh one, with a warning, else."""
        seed = os.environ.get("LANES_AUDIT_KEY")
        path = os.environ.get("LANES_AUDIT_KEY_FILE")
        if not seed and path:
            seed = Path(path).read_text().strip()
        if seed:
            try:
                return cls(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(seed)))
            except ValueError as exc:
                msg = "the audit key must be 64 hex digits (a 32-byte Ed25519 seed)"
                raise ValueError(msg) from exc
        log.info("no LANES_AUDIT_KEY: checkpoints are signed with a key that lives only in this process")
        return cls(Ed25519PrivateKey.generate())


def signature_is_valid(public_key: bytes, signature: bytes, position: int, chain_hash: bytes) -> bool:
    """Whether `signature` is the key's signature of the chain head at `position`."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, checkpoint_message(position, chain_hash))
    except (InvalidSignature, ValueError):
        return False
    return True
