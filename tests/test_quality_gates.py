"""The project's quality gates, run as tests so that `uv run pytest` checks what CI checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def test_ruff_finds_nothing() -> None:
    result = _run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_ruff_format_is_applied() -> None:
    result = _run(str(BIN / "ruff"), "format", "--check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


@pytest.mark.slow
def test_mypy_strict_finds_nothing() -> None:
    result = _run(str(BIN / "mypy"))
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_import_contracts_are_kept() -> None:
    result = _run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_no_lock_file_is_tracked() -> None:
    # Lock files record download addresses; versions are pinned in pyproject.toml instead.
    tracked = _run("git", "ls-files").stdout.split()
    assert not {"uv.lock", "poetry.lock", "pdm.lock"} & set(tracked)
