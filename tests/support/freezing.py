"""A PostgreSQL frozen in place: every process of an embedded server stopped (SIGSTOP), then resumed.

A frozen server keeps its connections open and answers nothing: each query and each new connection hangs
until the client's own timeout, as on a host that stalls (not one that is down and refuses at once).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from lanes_sandbox.embedded import EmbeddedPostgres


def _tree(root: int) -> list[int]:
    """`root` and every process descending from it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


@contextlib.contextmanager
def frozen(server: EmbeddedPostgres) -> Iterator[None]:
    """Every process of the server stopped (SIGSTOP) inside the block, resumed (SIGCONT) on leaving it."""
    assert server.pid is not None
    pids = _tree(server.pid)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
