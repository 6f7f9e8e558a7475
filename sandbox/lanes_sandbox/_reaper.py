"""Last-resort cleanup for the embedded servers of :mod:`lanes_sandbox.embedded`.

The owner starts this module as a detached process (its own session, so a
terminal Ctrl-C or a signal to the owner's process group never reaches it)
whose stdin is a pipe that only the owner holds.  The owner writes one JSON
object per line:

``{"op": "add_group", "pgid": 123, "signal": 2}``
    a server process group to stop, and the signal that stops it cleanly;
``{"op": "forget_group", "pgid": 123}``
    the owner stopped that group itself;
``{"op": "add_dir", "path": "/tmp/lanes-x"}`` / ``{"op": "forget_dir", ...}``
    a directory to remove (or no longer remove).

When stdin reaches EOF -- the owner closed it, exited, or was killed, even
with SIGKILL, because the kernel closes a dead process's descriptors -- the
reaper sends each remaining group its clean-stop signal, waits a little,
SIGKILLs whatever is left, waits for the groups to be gone and removes the
directories.  SIGTERM triggers the same cleanup; SIGINT and SIGHUP are
ignored.

It uses only the standard library and runs as a plain script
(``python -I path/to/_reaper.py``) so it does not depend on how the package
is installed or on the owner's ``sys.path``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable
    from types import FrameType

#: How long process groups get to exit after their clean-stop signal.
GRACE_SECONDS = 5.0
#: How long to wait for groups to disappear after SIGKILL.
KILL_WAIT_SECONDS = 5.0
_POLL_SECONDS = 0.05
#: ``/proc/<pid>/stat`` fields we read after the command name: state, ppid, pgrp.
_STAT_MIN_FIELDS = 3


def _proc_table() -> dict[int, tuple[str, int, int]] | None:
    """Map pid -> (state, ppid, pgrp) from ``/proc``; None without ``/proc``."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    table: dict[int, tuple[str, int, int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we were looking
        # The command name is in parentheses and may itself hold spaces or ")".
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= _STAT_MIN_FIELDS:
            table[int(entry.name)] = (fields[0], int(fields[1]), int(fields[2]))
    return table


def _running(state: str) -> bool:
    # Zombies count as gone: once the owner has died they are reparented to
    # whatever reaps orphans (PID 1 or a subreaper), which is out of our hands,
    # and they hold no ports, files or memory.
    return state not in {"Z", "X"}


def process_tree(pgids: Iterable[int]) -> set[int]:
    """Return the running members of the groups and all their descendants.

    Descendants matter because a server's children may leave its group:
    PostgreSQL's backends call ``setsid()``, so a signal to the postmaster's
    group never reaches them.
    """
    groups = set(pgids)
    table = _proc_table()
    if table is None:
        return set(groups)
    tree = {pid for pid, (st, _, pg) in table.items() if pg in groups and _running(st)}
    frontier = set(tree)
    while frontier:
        children = {
            pid for pid, (st, ppid, _) in table.items() if ppid in frontier and pid not in tree and _running(st)
        }
        tree |= children
        frontier = children
    return tree


def still_running(pids: Iterable[int]) -> set[int]:
    """Return those of ``pids`` that are still running (not gone, not zombies)."""
    wanted = set(pids)
    table = _proc_table()
    if table is None:
        alive: set[int] = set()
        for pid in wanted:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            alive.add(pid)
        return alive
    return {pid for pid in wanted if pid in table and _running(table[pid][0])}


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``, ignoring a group that is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_pids(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each pid, ignoring those that are gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def wait_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to exit; return the survivors."""
    deadline = time.monotonic() + timeout
    remaining = still_running(pids)
    while remaining and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
        remaining = still_running(remaining)
    return remaining


def stop_groups(groups: dict[int, int]) -> None:
    """Stop each group with its clean signal, then SIGKILL what is left of the tree."""
    # Snapshot first: once a leader is gone its children are no longer
    # recognisable as its descendants.
    tree = process_tree(groups)
    for pgid, sig in groups.items():
        signal_group(pgid, sig)
    survivors = wait_gone(tree, GRACE_SECONDS)
    if survivors:
        for pgid in groups:
            signal_group(pgid, signal.SIGKILL)
        kill_pids(survivors, signal.SIGKILL)
        wait_gone(survivors, KILL_WAIT_SECONDS)


def remove_dirs(paths: list[str]) -> None:
    """Remove the directories, newest registration first; missing ones are fine."""
    for path in reversed(paths):
        shutil.rmtree(path, ignore_errors=True)


class _ShutdownRequestedError(Exception):
    """Raised from the SIGTERM handler to leave the read loop and clean up."""


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise _ShutdownRequestedError


def main() -> int:
    """Read registrations until EOF (or SIGTERM), then clean up what is left."""
    # Nobody but the owner's pipe should decide when we act.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    groups: dict[int, int] = {}
    dirs: list[str] = []
    try:
        for raw in sys.stdin.buffer:
            try:
                msg = json.loads(raw)
                op = msg["op"]
                if op == "add_group":
                    groups[int(msg["pgid"])] = int(msg["signal"])
                elif op == "forget_group":
                    groups.pop(int(msg["pgid"]), None)
                elif op == "add_dir":
                    dirs.append(str(msg["path"]))
                elif op == "forget_dir":
                    path = str(msg["path"])
                    dirs = [d for d in dirs if d != path]
            except (ValueError, KeyError, TypeError):
                continue  # a torn line from a dying owner must not stop the cleanup
    except _ShutdownRequestedError:
        pass
    # From here on nothing may interrupt the cleanup.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop_groups(groups)
    remove_dirs(dirs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
