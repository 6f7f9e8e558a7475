"""Child processes that a test interrupts as a terminal would.

A shell that starts a command in the background (`pytest &`, a CI script's job) sets SIGINT to "ignored"
for it, and every child inherits that disposition; Python then installs no KeyboardInterrupt handler at
all. A test that sends a child Ctrl-C must therefore give it the default disposition itself, or the
outcome depends on how the suite was launched.
"""

from __future__ import annotations

import signal


def interruptible() -> None:
    """`preexec_fn` for a child that must see SIGINT as a terminal's Ctrl-C (default disposition)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
