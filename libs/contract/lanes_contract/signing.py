"""Signed events: each producer signs what it publishes (Ed25519 over the canonical CloudEvent).

The signature covers the subject, every CloudEvents header (`ce-*`, `traceparent`, `Content-Type`,
`Nats-Msg-Id`) and the payload, and travels in two headers: `Lanes-Signer` (`<identity>:<key id>`) and
`Lanes-Signature` (base64). The audit copy keeps every header, so the chain records who signed each event,
and `lanes audit verify --keyring` names any event unsigned, signed by an unknown key, or signed by an
identity that may not write its subject (see `lanes_contract.identities`).

Consumers check every event before they act on it (`verified_signer`): a valid signature by a key in the
keyring, made by an identity whose role covers the subject, and, for a node agent, about its own node only.
The services run it when LANES_KEYRING names a keyring (`lanes up` and `lanes demo` always do).

Rotation: an identity gets a new key id (`scheduler:k2`) and signs with it from then on; the keyring keeps
the old public key, so events signed before the rotation still verify. A key is only removed from the
keyring if it was compromised, and then its events are reported as signed by an unknown key.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from nacl.bindings import crypto_sign_BYTES, crypto_sign_open, crypto_sign_PUBLICKEYBYTES
from nacl.exceptions import CryptoError

from lanes_contract.codec import EncodedEvent
from lanes_contract.errors import LanesError
from lanes_contract.identities import AGENT_PREFIX, Identity, identity_named, may_publish

KEYRING_ENV = "LANES_KEYRING"
"""A keyring file (JSON): `lanes audit verify` checks each stored event's signer against it, and every
service's consumers check each event against it before acting on it."""
KEYRING_MAX_BYTES = 1 << 20
"""The largest keyring file read: thousands of keys, far more than a deployment has."""
SIGNER_HEADER = "Lanes-Signer"
SIGNATURE_HEADER = "Lanes-Signature"
_SIGNED_HEADERS = ("traceparent", "content-type", "nats-msg-id")
_FORMAT = b"lanes-event-signature-v1\n"


_VERIFIED: dict[tuple[bytes, str, bytes], None] = {}
"""Signatures already verified in this process, by (public key, signature, SHA-256 of the signed bytes).

Every service of `lanes up` reads the same job events (lifecycle, scheduler, recovery, telemetry, the local
launcher): one Ed25519 verification serves them all, and a hit costs the signed bytes' hash. Only a SHA-256
collision could pass a forgery through it."""
_VERIFIED_KEPT = 16_384
_VERIFIED_LOCK = threading.Lock()
"""Consumers verify a batch on two threads (`verify_many`): the cache's eviction must not interleave."""


class SignatureError(LanesError):
    """An event's signature is missing, made by an unknown key, or does not match the event."""


class ForgeryError(SignatureError):
    """A valid signature, by an identity that may not say this.

    A subject outside its role, or (a node agent) an event about another node.
    """


def signed_bytes(subject: str, headers: Mapping[str, str] | None, payload: bytes) -> bytes:
    """What a signature covers: the subject, the event's headers (sorted by lower-cased name), the payload.

    Delivery headers a server or a publisher adds around the event (expected-sequence checks, the
    signature itself) are left out, so a stored copy verifies exactly as the publisher signed it.
    """
    kept = {
        name.lower(): value
        for name, value in (headers or {}).items()
        if name.lower().startswith("ce-") or name.lower() in _SIGNED_HEADERS
    }
    meta = json.dumps(
        {"subject": subject, "headers": dict(sorted(kept.items()))}, sort_keys=True, separators=(",", ":")
    )
    return _FORMAT + meta.encode() + b"\n" + payload


@dataclass(frozen=True)
class EventSigner:
    """One identity's signing key (the private half stays with the producer)."""

    identity: str
    key_id: str
    key: Ed25519PrivateKey = field(repr=False)

    @property
    def reference(self) -> str:
        """`<identity>:<key id>`, the `Lanes-Signer` header and the keyring's key."""
        return f"{self.identity}:{self.key_id}"

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte public key, for the keyring."""
        return self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, encoded: EncodedEvent) -> EncodedEvent:
        """The event with its signer and signature headers (Ed25519 is deterministic: a re-send is identical)."""
        signature = self.key.sign(signed_bytes(encoded.subject, encoded.headers, encoded.payload))
        headers = dict(encoded.headers) | {
            SIGNER_HEADER: self.reference,
            SIGNATURE_HEADER: base64.b64encode(signature).decode(),
        }
        return replace(encoded, headers=headers)

    @classmethod
    def generate(cls, identity: str, key_id: str = "k1") -> EventSigner:
        """A fresh key for an identity."""
        return cls(identity, key_id, Ed25519PrivateKey.generate())

    def dump(self) -> str:
        """The key file's text: `<identity>:<key id>:<64 hex digits of the seed>`."""
        seed = self.key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return f"{self.reference}:{seed.hex()}\n"

    @classmethod
    def load(cls, path: Path) -> EventSigner:
        """Read a key file written by `dump` (LANES_SIGNING_KEY_FILE)."""
        try:
            identity, key_id, seed = path.read_text().strip().split(":")
            return cls(identity, key_id, Ed25519PrivateKey.from_private_bytes(bytes.fromhex(seed)))
        except (OSError, ValueError) as exc:
            msg = f"{path} is not a Lanes signing key (<identity>:<key id>:<64 hex digits>): {exc}"
            raise SignatureError(msg) from exc


@dataclass(frozen=True)
class Keyring:
    """Every public key a verifier trusts, by `<identity>:<key id>` (old keys kept after a rotation)."""

    keys: Mapping[str, bytes]

    @functools.cached_property
    def _public_keys(self) -> dict[str, bytes]:
        """The keys of the right length (a malformed one verifies nothing: "not in the keyring")."""
        return {reference: raw for reference, raw in self.keys.items() if len(raw) == crypto_sign_PUBLICKEYBYTES}

    def verify(self, subject: str, headers: Mapping[str, str] | None, payload: bytes) -> str:
        """The identity that signed this stored event; SignatureError when it cannot be shown."""
        found = headers or {}
        reference, signature = found.get(SIGNER_HEADER), found.get(SIGNATURE_HEADER)
        if not reference or not signature:
            msg = "unsigned"
            raise SignatureError(msg)
        public = self._public_keys.get(reference)
        if public is None:
            msg = f"signed by {_shown(reference)}, a key not in the keyring"
            raise SignatureError(msg)
        signed = signed_bytes(subject, found, payload)
        proof = (self.keys[reference], signature, hashlib.sha256(signed).digest())
        if proof not in _VERIFIED:
            try:
                raw = base64.b64decode(signature, validate=True)
                if len(raw) != crypto_sign_BYTES:
                    raise ValueError(f"{len(raw)} bytes")  # noqa: TRY301 - reported as any mismatch below
                # libsodium's Ed25519, not OpenSSL's: 93 us against 149-171 us per check here, canonical bytes
                # included (bench/signatures.py), and it lets go of the GIL, so a batch verifies on two cores.
                crypto_sign_open(raw + signed, public)
            except (CryptoError, ValueError, binascii.Error) as exc:
                msg = f"the signature of {reference} does not match the event"
                raise SignatureError(msg) from exc
            with _VERIFIED_LOCK:
                _VERIFIED[proof] = None
                if len(_VERIFIED) > _VERIFIED_KEPT:
                    del _VERIFIED[next(iter(_VERIFIED))]  # the oldest first
        return reference.split(":", 1)[0]

    def with_key(self, signer: EventSigner) -> Keyring:
        """This keyring plus a signer's public key (what a rotation adds)."""
        return Keyring({**self.keys, signer.reference: signer.public_key})

    def dump(self) -> str:
        """JSON: `{"<identity>:<key id>": "<hex public key>"}`."""
        return json.dumps({ref: key.hex() for ref, key in sorted(self.keys.items())}, indent=2) + "\n"

    @classmethod
    def load(cls, path: Path) -> Keyring:
        """Read a keyring written by `dump` (LANES_KEYRING)."""
        try:
            with path.open("rb") as file:
                text = file.read(KEYRING_MAX_BYTES + 1)  # a keyring names a few keys; /dev/zero must not hang a start
            if len(text) > KEYRING_MAX_BYTES:
                raise ValueError(f"larger than {KEYRING_MAX_BYTES} bytes")  # noqa: TRY301 - reported as below
            raw = json.loads(text)
            return cls({str(ref): bytes.fromhex(str(key)) for ref, key in raw.items()})
        except (OSError, ValueError, AttributeError) as exc:
            msg = f"{path} is not a Lanes keyring (JSON of identity:key id -> hex public key): {exc}"
            raise SignatureError(msg) from exc


def verified_signer(subject: str, headers: Mapping[str, str] | None, payload: bytes, keyring: Keyring) -> str:
    """The identity that signed this event and may say it; what a consumer checks before it acts (pure).

    SignatureError: unsigned, a garbage signature, a key the keyring does not hold, or a signature that does
    not match the event. ForgeryError: a valid signature by an identity whose role does not cover the
    subject, or a node agent speaking about another node (its event's `ce-node`, and `ce-source`, must be
    its own). Which rank runs on which node is the lifecycle's to check: it refuses a rank event whose node
    is not the node that rank was placed on.
    """
    signer = keyring.verify(subject, headers, payload)
    identity = _identity(signer)
    if identity is None:
        msg = f"signed by {_shown(signer)}, which is no identity"
        raise ForgeryError(msg)
    if not may_publish(identity, subject):
        msg = f"signed by {signer}, whose role may not write {subject}"
        raise ForgeryError(msg)
    if signer.startswith(AGENT_PREFIX):
        _check_own_node(signer.removeprefix(AGENT_PREFIX), identity, headers or {})
    return signer


def _check_own_node(node: str, identity: Identity, headers: Mapping[str, str]) -> None:
    """A node agent speaks only for its own node: the event must name that node, and that agent as source."""
    lowered = {name.lower(): value for name, value in headers.items() if name.lower() in {"ce-node", "ce-source"}}
    named = lowered.get("ce-node")
    if named != node:
        said = f"node {_shown(named)}" if named else "no node"
        msg = f"signed by {identity.name}, but the event is about {said}: an agent speaks only for its own node"
        raise ForgeryError(msg)
    claimed = lowered.get("ce-source")
    if claimed != identity.source:
        msg = f"signed by {identity.name}, but it claims the source {_shown(claimed or '')}, not {identity.source}"
        raise ForgeryError(msg)


@functools.lru_cache(maxsize=4096)
def _identity(name: str) -> Identity | None:
    """An identity by name, built once (a node agent's role is built from its node on each call otherwise)."""
    return identity_named(name)


def _shown(value: str | None, limit: int = 80) -> str:
    """A value from the event itself, fit for a dead letter's reason: printable, and cut if long.

    It may be anything: an unprintable one is quoted, so no control character reaches a terminal.
    """
    text = value or ""
    if not text.isprintable():
        text = repr(text)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
