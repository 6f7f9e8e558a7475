"""Recomputing a checkpoint's digest, so a corrupted (or replaced, or vanished) checkpoint is refused.

Only local paths are checked: an absolute path or a `file://` URL. Anything else (s3://, a relative path
whose base only the rank knew) cannot be read here, and its recorded digest is trusted. The digest is
`<algorithm>:<hex>` with any algorithm hashlib knows (sha256 in practice).

A checkpoint path comes from a job's own output, so reading it is guarded:

- only paths under the policy's `checkpoint_roots` are read (after resolving symlinks; no roots named: any
  local path), and only regular files (a device such as /dev/zero, a FIFO or a socket is never opened for
  reading: it could block or never end);
- each digest is bounded in bytes (`digest_max_bytes`) and in time (`digest_timeout_s`);
- digests run in threads, off the consumer's critical path: `BackgroundDigests.ready` answers at once with
  the verdicts it has, or None while some are still being computed (recovery then decides that job a little
  later, from its timer), so one job's slow digest never delays another job's decision.

A digest that cannot be computed within those bounds is *unverified*: the checkpoint is refused with that
reason, and the decision says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from lanes_recovery.domain.checkpoints import NOT_CHECKED, DigestVerdict, digest_key
from lanes_recovery.domain.knowledge import SavedCheckpoint

_CHUNK = 1 << 20
UNVERIFIED = "unverified"


@dataclass(frozen=True)
class DigestLimits:
    """Where digests may read and how much: the policy's checkpoint roots, a byte and a time budget."""

    roots: tuple[Path, ...] = ()
    """No roots: any local path (regular files only, still bounded)."""
    max_bytes: int = 64 << 30
    timeout_s: float = 60.0


class _Unverified(Exception):  # noqa: N818 - a verdict, not an error: the checkpoint is unverified
    """The digest could not be computed within the limits (the message says why)."""


def local_path(path: str) -> Path | None:
    """The local file a checkpoint path names, or None when it is not a local path."""
    if path.startswith("file://"):
        return Path(unquote(urlparse(path).path))
    if path.startswith("/"):
        return Path(path)
    return None


def verify_digest(path: str, digest: str, limits: DigestLimits | None = None) -> DigestVerdict:
    """Recompute the digest of a local checkpoint and compare it with the recorded one, within `limits`."""
    limits = limits or DigestLimits()
    local = local_path(path)
    if local is None:
        return NOT_CHECKED
    algorithm, _, expected = digest.partition(":")
    try:
        hashlib.new(algorithm)
    except ValueError:
        return DigestVerdict(checked=True, matches=False, found=f"unsupported digest algorithm {algorithm!r}")
    budget = _Budget(limits)
    try:
        resolved = _within_roots(local, limits.roots)
        mode = resolved.stat().st_mode
        if stat.S_ISDIR(mode):
            found = _directory_digest(resolved, algorithm, budget)
        else:
            found = _file_digest(resolved, algorithm, budget)
    except _Unverified as exc:
        return DigestVerdict(checked=True, matches=False, found=f"{UNVERIFIED}: {exc}")
    except FileNotFoundError:
        return DigestVerdict(checked=True, matches=False, found="missing file")
    except OSError as exc:
        return DigestVerdict(checked=True, matches=False, found=f"unreadable: {exc.strerror or exc}")
    return DigestVerdict(checked=True, matches=found == expected.lower(), found=f"{algorithm}:{found}")


def _within_roots(local: Path, roots: tuple[Path, ...]) -> Path:
    """The path with its symlinks resolved, if it lies under one of the roots (any, when none are named)."""
    resolved = local.resolve()
    if roots and not any(resolved.is_relative_to(root.resolve()) for root in roots):
        named = ", ".join(str(root) for root in roots)
        msg = f"{resolved} is outside the checkpoint roots ({named})"
        raise _Unverified(msg)
    return resolved


class _Budget:
    """The bytes and the time one digest may still spend."""

    def __init__(self, limits: DigestLimits) -> None:
        self._limits = limits
        self._bytes = 0
        self._deadline = time.monotonic() + limits.timeout_s

    def spend(self, size: int) -> None:
        self._bytes += size
        if self._bytes > self._limits.max_bytes:
            msg = f"larger than the digest limit of {self._limits.max_bytes} bytes"
            raise _Unverified(msg)
        if time.monotonic() > self._deadline:
            msg = f"not hashed within the digest time limit of {self._limits.timeout_s:g} s"
            raise _Unverified(msg)


def _file_digest(path: Path, algorithm: str, budget: _Budget) -> str:
    # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses anything but a regular file.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            msg = f"{path} is not a regular file"
            raise _Unverified(msg)
        hasher = hashlib.new(algorithm)
        while chunk := handle.read(_CHUNK):
            budget.spend(len(chunk))
            hasher.update(chunk)
    return hasher.hexdigest()


def _directory_digest(path: Path, algorithm: str, budget: _Budget) -> str:
    """A directory checkpoint's digest: over its files' relative paths and digests, sorted (docs/recovery.md)."""
    lines = []
    for folder, _, names in os.walk(path):  # symlinked folders are not followed
        for name in names:
            file = Path(folder) / name
            if stat.S_ISREG(file.lstat().st_mode):  # symlinks, devices and FIFOs inside are skipped
                lines.append(f"{file.relative_to(path).as_posix()}\0{_file_digest(file, algorithm, budget)}\n")
    return hashlib.new(algorithm, "".join(sorted(lines)).encode()).hexdigest()


class BackgroundDigests:
    """Digests computed in the background and remembered: ask again until every verdict is in."""

    def __init__(self, limits: DigestLimits | None = None) -> None:
        self.limits = limits or DigestLimits()
        self._verdicts: dict[tuple[str, str], DigestVerdict] = {}
        self._running: dict[tuple[str, str], asyncio.Task[DigestVerdict]] = {}

    def start(self, checkpoints: Sequence[SavedCheckpoint]) -> None:
        """Start hashing these checkpoints now (a failed attempt's decision will want them soon)."""
        self._collect({digest_key(c) for c in checkpoints})

    def ready(self, checkpoints: Sequence[SavedCheckpoint]) -> Mapping[tuple[str, str], DigestVerdict] | None:
        """The verdicts of these checkpoints, or None while some are still being computed (they are started)."""
        keys = {digest_key(c) for c in checkpoints}
        self._collect(keys)
        if keys - self._verdicts.keys():
            return None
        # Handed out once: the next decision reads the files again (a checkpoint may have changed since).
        return {key: self._verdicts.pop(key) for key in keys}

    def _collect(self, keys: set[tuple[str, str]]) -> None:
        """Start the digests not yet running, and keep the verdicts of those that finished."""
        for key in keys - self._verdicts.keys():
            task = self._running.get(key)
            if task is None:
                self._running[key] = asyncio.create_task(asyncio.to_thread(verify_digest, *key, self.limits))
            elif task.done():
                self._verdicts[key] = task.result()
                del self._running[key]

    async def wait(self, checkpoints: Sequence[SavedCheckpoint]) -> Mapping[tuple[str, str], DigestVerdict]:
        """The verdicts, waiting for those still being computed (each is bounded by the time limit)."""
        while (verdicts := self.ready(checkpoints)) is None:
            await asyncio.gather(*self._running.values(), return_exceptions=True)
        return verdicts
