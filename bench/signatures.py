"""Signature checks: what a consumer pays per event, with libsodium against OpenSSL beside it.

Every service verifies each event it reads (`lanes_contract.signing.Keyring.verify`) when a keyring is set.
Three figures over the same signed events (a placement of realistic size, each a distinct message):

- `openssl_verify_us`: `cryptography`'s Ed25519 (OpenSSL), the raw baseline: what the check cost before;
- `sodium_verify_us`: libsodium's (PyNaCl), the primitive `Keyring.verify` uses now;
- `keyring_two_threads_us`: `Keyring.verify` itself, the batch split over two threads as the consumer does
  (libsodium lets go of the GIL), wall time per event;

each the median of `--runs`, and the ratios against the OpenSSL baseline (above 1: faster).

    uv run python bench/signatures.py [--events 2000] [--runs 5]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import statistics
import time
from collections.abc import Callable, Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nacl.bindings import crypto_sign_open

from lanes_contract.codec import EncodedEvent, encode
from lanes_contract.events import JobPlaced, JobPlacedData, RankAssignment
from lanes_contract.signing import SIGNATURE_HEADER, EventSigner, Keyring, signed_bytes


def _events(count: int, signer: EventSigner) -> list[EncodedEvent]:
    """Distinct signed placements of 8 ranks (no two share signed bytes: the verified cache never hits)."""
    events = []
    for i in range(count):
        ranks = tuple(RankAssignment(rank=r, node=f"node-{i}-{r}", gpus=(r,)) for r in range(8))
        placed = JobPlaced(
            source="lanes/scheduler", jobid=f"bench-{i}", attempt=1, data=JobPlacedData(assignments=ranks)
        )
        events.append(signer.sign(encode(placed)))
    return events


def _per_event_us(check: Callable[[Sequence[EncodedEvent]], None], events: Sequence[EncodedEvent]) -> float:
    started = time.perf_counter()
    check(events)
    return (time.perf_counter() - started) / len(events) * 1e6


def main() -> None:
    """Time the three checks, alternating, and print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    signer = EventSigner.generate("scheduler")
    public = signer.public_key
    openssl_key = Ed25519PublicKey.from_public_bytes(public)

    def openssl(events: Sequence[EncodedEvent]) -> None:
        for e in events:
            openssl_key.verify(
                base64.b64decode(e.headers[SIGNATURE_HEADER]), signed_bytes(e.subject, e.headers, e.payload)
            )

    def sodium(events: Sequence[EncodedEvent]) -> None:
        for e in events:
            signature = base64.b64decode(e.headers[SIGNATURE_HEADER])
            crypto_sign_open(signature + signed_bytes(e.subject, e.headers, e.payload), public)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def keyring_two_threads(events: Sequence[EncodedEvent]) -> None:
        keyring = Keyring({signer.reference: public})

        def verify_all(part: Sequence[EncodedEvent]) -> None:
            for e in part:
                keyring.verify(e.subject, e.headers, e.payload)

        half = len(events) // 2
        second = pool.submit(verify_all, events[half:])
        verify_all(events[:half])
        second.result()

    checks = {"openssl_verify_us": openssl, "sodium_verify_us": sodium, "keyring_two_threads_us": keyring_two_threads}
    timings: dict[str, list[float]] = {name: [] for name in checks}
    for _ in range(args.runs):
        for name, check in checks.items():  # alternating, so a slow moment of the machine hits all three
            timings[name].append(_per_event_us(check, _events(args.events, signer)))
    pool.shutdown()
    medians = {name: round(statistics.median(values), 1) for name, values in timings.items()}
    baseline = medians["openssl_verify_us"]
    print(
        json.dumps(
            {
                "bench": "signatures",
                "events": args.events,
                "runs": args.runs,
                **medians,
                "sodium_speedup": round(baseline / medians["sodium_verify_us"], 2),
                "keyring_two_threads_speedup": round(baseline / medians["keyring_two_threads_us"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
