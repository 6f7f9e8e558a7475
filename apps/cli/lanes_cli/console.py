"""What every `lanes` command shares: consoles, one-line errors with exit codes, settings, async runner.

Exit codes: 0 success, 1 the work itself failed, 2 bad input (usage, a file, a bound of lanes_cli.limits),
3 unknown job or node, 4 a server is unreachable or unsupported; `lanes run` exits with its command's status
(126 / 127 when the command cannot start), and Ctrl-C with 130.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import NoReturn, TypeVar

import typer
from rich.console import Console

from lanes_cli.limits import excerpt
from lanes_cli.terminal import markup
from lanes_contract.errors import InvalidEventError, LanesError, ServerUnavailableError, UnsupportedServerError
from lanes_contract.ids import is_valid_token
from lanes_contract.signing import Keyring
from lanes_runtime.log import configure_logging
from lanes_runtime.settings import Settings, configured_keyring

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NOT_FOUND, EXIT_SERVER = 1, 2, 3, 4
out = Console()
# Never wrapped: an error is one line whatever the width of the terminal, or of none (rich assumes 80).
err = Console(stderr=True, soft_wrap=True)
_T = TypeVar("_T")


def one_line(message: str) -> str:
    """The message on one line: every run of whitespace (a newline in an exception's text too) one space."""
    return " ".join(message.split())


def fail(message: str, code: int) -> NoReturn:
    """Print a one-line error on stderr and exit with `code` (the message is text, never rich markup).

    A message may quote an event or an exception: its control characters are shown escaped.
    """
    err.print(f"[red]error:[/red] {markup(one_line(message))}", highlight=False, emoji=False)
    raise typer.Exit(code)


def print_big_json(value: object) -> None:
    """JSON on stdout, indented like `out.print_json`, for a document that may be large.

    Rich colours JSON by running its highlighter over the text, which takes minutes and gigabytes for a
    100,000-line document (a 65,536-node topology); this writes the same text without colours.
    """
    typer.echo(json.dumps(value, indent=2, ensure_ascii=False))


def load_settings(*, quiet: bool = False) -> Settings:
    """Settings from the environment, with logging configured (errors only when `quiet`)."""
    try:
        settings = Settings.from_env()
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    # Commands whose output is the point (demo, submit, job, timeline) log only errors unless asked to: a
    # failure is then the one line `fail` prints, not the client's warnings on the way to it.
    level = settings.log_level if (os.environ.get("LANES_LOG_LEVEL") or not quiet) else "error"
    configure_logging(level, settings.log_format)
    return settings


def signers_keyring(settings: Settings) -> Keyring | None:
    """The keyring LANES_KEYRING names, to check who signed each event a command shows; exit 2 if unreadable."""
    try:
        return configured_keyring(settings)
    except LanesError as exc:
        fail(str(exc), EXIT_BAD_INPUT)


def run_async(
    work: Callable[[], Awaitable[_T]], *, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
) -> _T:
    """Run async work; turn server problems into one-line errors and SIGTERM into a clean shutdown."""

    def on_sigterm(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    # Only the main thread may install signal handlers; embedded elsewhere (a test's worker thread), the
    # caller owns shutdown.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(work())  # type: ignore[arg-type]
    except (ServerUnavailableError, UnsupportedServerError) as exc:
        fail(str(exc), EXIT_SERVER)
    except InvalidEventError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    except LanesError as exc:
        fail(str(exc), EXIT_FAILED)


def checked_job_id(job_id: str) -> str:
    """A job id given on the command line, or exit 2: never a wildcard or anything else that is not an id."""
    if not is_valid_token(job_id):
        fail(f"job id {excerpt(job_id)} must be 1-128 characters from A-Z a-z 0-9 _ - (no wildcards)", EXIT_BAD_INPUT)
    return job_id


def checked_window(since: datetime | None, until: datetime | None) -> tuple[datetime | None, datetime | None]:
    """`--since` / `--until` in UTC, or exit 2 when the window is empty (it ends before it starts)."""
    since, until = as_utc(since), as_utc(until)
    if since is not None and until is not None and since > until:
        fail(
            f"--since {since.isoformat()} is after --until {until.isoformat()}: nothing lies between them",
            EXIT_BAD_INPUT,
        )
    return since, until


def output_file(path: Path, option: str) -> Path:
    """A file the command will write, checked before any work: its directory exists and it is not one itself."""
    if path.is_dir():
        fail(f"{option} {path} is a directory; name a file", EXIT_BAD_INPUT)
    if not path.parent.is_dir():
        fail(f"{option} {path}: the directory {path.parent} does not exist", EXIT_BAD_INPUT)
    return path


def output_dir(path: Path, option: str) -> Path:
    """A directory the command will write into (created if missing), checked before any work."""
    if path.exists() and not path.is_dir():
        fail(f"{option} {path} exists and is not a directory", EXIT_BAD_INPUT)
    return path


def cannot_write(path: Path, exc: OSError) -> NoReturn:
    """The one-line error for a file or directory that could not be written (exit 2: the path given is bad)."""
    fail(f"cannot write {exc.filename or path}: {exc.strerror or exc}", EXIT_BAD_INPUT)


def require(value: str | None, name: str) -> str:
    """The value of a required setting, or a one-line error naming it."""
    if not value:
        fail(
            f"{name} is not set: start `lanes up` and export the URLs it prints, or point it at your server",
            EXIT_BAD_INPUT,
        )
    return value


def as_utc(moment: datetime | None) -> datetime | None:
    """A time given without an offset means UTC, as everywhere on the timeline."""
    return moment if moment is None or moment.tzinfo else moment.replace(tzinfo=UTC)
