"""Per-rank memory cgroups (cgroup v1 `memory` controller), so a rank over its memory is the kernel's OOM kill.

The agent makes one cgroup per rank under `<memory controller>/lanes/`, writes the spec's limit to
`memory.limit_in_bytes`, and the rank moves itself into it before it executes its command (so nothing it
allocates escapes the limit). When the limit is exceeded the kernel's OOM killer kills the rank and logs its
real line (`Memory cgroup out of memory: Killed process <pid> ...`), which the kernel-log follower reads.
Where cgroups cannot be made (not root, no v1 memory controller) ranks run unlimited and the agent says so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
_GIB = 1 << 30


class MemoryCgroups:
    """The agent's cgroups under one parent (`lanes/` in the memory controller)."""

    def __init__(self, root: Path = MEMORY_ROOT / "lanes") -> None:
        self.root = root

    def unavailable(self) -> str | None:
        """Why ranks cannot get memory cgroups here, or None when they can."""
        if not (self.root.parent / "memory.limit_in_bytes").exists():
            return f"no cgroup v1 memory controller at {self.root.parent}"
        try:
            self.root.mkdir(exist_ok=True)
        except OSError as exc:
            return f"cannot create {self.root}: {exc.strerror or exc}"
        return None

    def create(self, name: str, limit_gib: float) -> Path:
        """A fresh cgroup `name` limited to `limit_gib` (one left by an earlier run is reused)."""
        group = self.root / name
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(max(1, int(limit_gib * _GIB))))
        return group

    @staticmethod
    def join(group: Path) -> Callable[[], None]:
        """What the rank runs between fork and exec: move itself into the cgroup."""
        procs = group / "cgroup.procs"

        def move_self() -> None:
            procs.write_text(str(os.getpid()))

        return move_self

    @staticmethod
    def remove(group: Path) -> None:
        """Remove an emptied cgroup (a busy one stays; the next run of the same rank reuses it)."""
        with contextlib.suppress(OSError):
            group.rmdir()
