"""The project's quality gates, run as tests so that `uv run pytest` checks what CI checks."""

from __future__ import annotations

import ast
import re
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


# Upper case only: SQL as this project writes it, not prose that says "select ... from".
_SQL = re.compile(r"\b(SELECT\s.+\sFROM|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM)\b", re.DOTALL)


def test_the_app_reads_services_only_through_their_views() -> None:
    # The import contract sees modules, not SQL: a query on a service's table from apps/ would pass it.
    found = [
        f"{path.relative_to(ROOT)}: {node.value[:60]!r}"
        for path in sorted((ROOT / "apps").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _SQL.search(node.value)
    ]
    assert not found, "SQL in the app (add a function to the service's views instead):\n" + "\n".join(found)
