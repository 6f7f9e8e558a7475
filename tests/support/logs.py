"""The log lines a test's own process writes, read back as the services write them: JSON, one per line."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from lanes_runtime.log import configure_logging

OUTAGE_BEGAN = "server unavailable; holding until it answers"
OUTAGE_ENDED = "servers answer again; resuming"


class JsonLogs:
    """Every JSON log line written to stderr since the capture began (read through pytest's capsys)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self._capsys = capsys
        self._lines: list[dict[str, Any]] = []

    def lines(self) -> list[dict[str, Any]]:
        """Every line so far, in the order written."""
        self._lines.extend(
            json.loads(line) for line in self._capsys.readouterr().err.splitlines() if line.startswith("{")
        )
        return self._lines

    def about(self, name: str) -> list[dict[str, Any]]:
        """The lines about one consumer or runner, in the order written."""
        return [line for line in self.lines() if name in (line.get("consumer"), line.get("runner"))]

    def assert_one_outage(self, name: str) -> None:
        """One warning when the outage began, one line when it ended, and no traceback or error in between."""
        about = self.about(name)
        began = [line for line in about if line["event"] == OUTAGE_BEGAN]
        ended = [line for line in about if line["event"] == OUTAGE_ENDED]
        assert [line["level"] for line in began] == ["warning"], about
        assert len(ended) == 1, about
        assert not [line for line in about if "exception" in line or line["level"] == "error"], about


@contextlib.contextmanager
def json_logs(capsys: pytest.CaptureFixture[str]) -> Iterator[JsonLogs]:
    """Logging set up as a service does (`configure_logging`, JSON) inside the block; the previous set-up after."""
    previous = structlog.get_config()
    configure_logging("info", "json")
    try:
        yield JsonLogs(capsys)
    finally:
        structlog.configure(**previous)
