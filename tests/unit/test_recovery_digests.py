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
