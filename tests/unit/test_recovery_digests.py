"""Recovery's digest check of local checkpoints: a corrupted, missing or replaced checkpoint is found out."""

from __future__ import annotations

import hashlib
from pathlib import Path

from lanes_recovery.adapters.digests import verify_digest


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_local_file_matches_its_recorded_digest_until_it_changes(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step-100.pt"
    checkpoint.write_bytes(b"weights")
    recorded = f"sha256:{_sha(b'weights')}"
    assert verify_digest(str(checkpoint), recorded).matches
    assert verify_digest(f"file://{checkpoint}", recorded).matches
    checkpoint.write_bytes(b"torn")
    verdict = verify_digest(str(checkpoint), recorded)
    assert (verdict.checked, verdict.matches, verdict.found) == (True, False, f"sha256:{_sha(b'torn')}")


def test_a_missing_file_or_an_unknown_algorithm_is_refused_and_a_remote_path_is_not_checked(tmp_path: Path) -> None:
    missing = verify_digest(str(tmp_path / "gone.pt"), "sha256:" + "ab" * 32)
    assert (missing.checked, missing.matches, missing.found) == (True, False, "missing file")
    unknown = verify_digest(str(tmp_path), "nohash:abcdef12")
    assert not unknown.matches
    assert "unsupported digest algorithm" in str(unknown.found)
    remote = verify_digest("s3://bucket/step-100.pt", "sha256:" + "ab" * 32)
    assert not remote.checked
    assert remote.matches


def test_a_directory_checkpoint_is_digested_over_its_files(tmp_path: Path) -> None:
    shards = tmp_path / "step-200"
    (shards / "sub").mkdir(parents=True)
    (shards / "rank0.pt").write_bytes(b"a")
    (shards / "sub" / "rank1.pt").write_bytes(b"b")
    lines = sorted([f"rank0.pt\0{_sha(b'a')}\n", f"sub/rank1.pt\0{_sha(b'b')}\n"])
    recorded = "sha256:" + _sha("".join(lines).encode())
    assert verify_digest(str(shards), recorded).matches
    (shards / "sub" / "rank1.pt").write_bytes(b"c")
    assert not verify_digest(str(shards), recorded).matches


def test_only_regular_files_under_the_checkpoint_roots_are_read_and_within_budget(tmp_path: Path) -> None:
    import os  # noqa: PLC0415 - only this test makes a FIFO

    from lanes_recovery.adapters.digests import DigestLimits  # noqa: PLC0415

    recorded = "sha256:" + "ab" * 32
    zero = verify_digest("/dev/zero", recorded)
    assert zero.found == "unverified: /dev/zero is not a regular file"
    fifo = tmp_path / "step.fifo"
    os.mkfifo(fifo)
    assert verify_digest(str(fifo), recorded).found == f"unverified: {fifo} is not a regular file"  # never blocks
    roots = DigestLimits(roots=(tmp_path / "ckpt",))
    (tmp_path / "ckpt").mkdir()
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(b"weights")
    escape = tmp_path / "ckpt" / "link.pt"
    escape.symlink_to(outside)
    for path in (outside, escape):
        assert str(verify_digest(str(path), recorded, roots).found).startswith(f"unverified: {outside} is outside")
    inside = tmp_path / "ckpt" / "step-1.pt"
    inside.write_bytes(b"weights")
    assert verify_digest(str(inside), f"sha256:{_sha(b'weights')}", roots).matches
    small = DigestLimits(max_bytes=3)
    assert verify_digest(str(inside), recorded, small).found == "unverified: larger than the digest limit of 3 bytes"
