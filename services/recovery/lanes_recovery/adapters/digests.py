"""Recomputing a checkpoint's digest, so a corrupted (or replaced, or vanished) checkpoint is refused.

Only local files are checked: a path that is absolute or a `file://` URL. Anything else (s3://, a
relative path whose base only the rank knew) cannot be read here, and its recorded digest is trusted.
The digest is `<algorithm>:<hex>` with any algorithm hashlib knows (sha256 in practice).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

from lanes_recovery.domain.checkpoints import NOT_CHECKED, DigestVerdict, digest_key
from lanes_recovery.domain.knowledge import SavedCheckpoint

_CHUNK = 1 << 20


def local_path(path: str) -> Path | None:
    """The local file a checkpoint path names, or None when it is not a local path."""
    if path.startswith("file://"):
        return Path(unquote(urlparse(path).path))
    if path.startswith("/"):
        return Path(path)
    return None


def verify_digest(path: str, digest: str) -> DigestVerdict:
    """Recompute the digest of a local checkpoint file and compare it with the recorded one."""
    local = local_path(path)
    if local is None:
        return NOT_CHECKED
    algorithm, _, expected = digest.partition(":")
    try:
        hashlib.new(algorithm)
    except ValueError:
        return DigestVerdict(checked=True, matches=False, found=f"unsupported digest algorithm {algorithm!r}")
    try:
        found = _directory_digest(local, algorithm) if local.is_dir() else _file_digest(local, algorithm)
    except FileNotFoundError:
        return DigestVerdict(checked=True, matches=False, found="missing file")
    except OSError as exc:
        return DigestVerdict(checked=True, matches=False, found=f"unreadable: {exc.strerror or exc}")
    return DigestVerdict(checked=True, matches=found == expected.lower(), found=f"{algorithm}:{found}")


def _file_digest(path: Path, algorithm: str) -> str:
    hasher = hashlib.new(algorithm)
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def _directory_digest(path: Path, algorithm: str) -> str:
    """A directory checkpoint's digest: over its files' relative paths and digests, sorted (docs/recovery.md)."""
    lines = sorted(
        f"{file.relative_to(path).as_posix()}\0{_file_digest(file, algorithm)}\n"
        for file in path.rglob("*")
        if file.is_file()
    )
    return hashlib.new(algorithm, "".join(lines).encode()).hexdigest()


async def verify_all(checkpoints: Iterable[SavedCheckpoint]) -> dict[tuple[str, str], DigestVerdict]:
    """Verdicts for every distinct (path, digest), hashed off the event loop (checkpoints can be large)."""
    keys = sorted({digest_key(c) for c in checkpoints})
    verdicts = await asyncio.gather(*(asyncio.to_thread(verify_digest, path, digest) for path, digest in keys))
    return dict(zip(keys, verdicts, strict=True))
