"""structlog set-up: JSON lines when not on a terminal (for machines), readable console output otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Whatever `sys.stderr` is at the moment of writing, so logs follow a redirection made after set-up."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", fmt: str | None = None) -> None:
    """Configure structlog and the stdlib root logger once per process; logs go to stderr."""
    as_json = (fmt or ("console" if sys.stderr.isatty() else "json")) == "json"
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, format="%(name)s: %(message)s")
