"""Step timings from any torch job, with one line: `lanes_agent.torch_timing.install()`.

The node agent reads, per training step, how long a rank computed and how long it waited inside its
collectives (`lanes: step N compute_s=C wait_s=W`, see the launcher), and telemetry reads those for slow ranks
and degraded links. A job that does not print them itself gets them from this hook:

- each `torch.distributed` collective called synchronously (all-reduce, all-gather, reduce-scatter,
  broadcast, barrier, ...) adds its wall time to the step's wait; an asynchronous one (`async_op=True`)
  adds only what its call took, since its wait happens later, wherever the job waits on it;
- every optimizer step ends a training step (a global step post-hook on `torch.optim.Optimizer`), and the
  line is printed with the time since the previous step's end, less the wait.

It never changes what the job computes: the wrappers call the original functions with the same arguments
and return what they return. It costs two `perf_counter` calls per collective and a print per step
(`bench/torch_timing.py` measures it against the same loop unhooked). Install it before the job takes its
own references to the collectives (`from torch.distributed import all_reduce` binds the unwrapped one).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)
"""The `torch.distributed` functions whose time is a rank's wait."""
_installed: StepClock | None = None


class StepClock:
    """A rank's time in the current step: what it waited in collectives, and when the step began."""

    def __init__(
        self, out: Callable[[str], None], now: Callable[[], float] = time.perf_counter, *, rank: int | None = None
    ) -> None:
        self._out = out
        self._now = now
        self._said_rank = "" if rank is None else f" rank={rank}"
        """Each line names its rank: `lanes run` reads the one pipe a torchrun's workers share."""
        self.step = 0
        self.waited = 0.0
        self.began = now()

    def timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """`function`, with its wall time added to the step's wait."""

        @functools.wraps(function)
        def collective(*args: Any, **kwargs: Any) -> Any:
            entered = self._now()
            try:
                return function(*args, **kwargs)
            finally:
                self.waited += self._now() - entered

        collective.__lanes_timed__ = True  # type: ignore[attr-defined]
        return collective

    def step_done(self, *_: Any) -> None:
        """End the step (an optimizer step did): print its line, start the next."""
        now = self._now()
        self.step += 1
        computed = max(now - self.began - self.waited, 0.0)
        self._out(f"lanes: step {self.step} compute_s={computed:.6f} wait_s={self.waited:.6f}{self._said_rank}")
        self.waited, self.began = 0.0, now


def _say(line: str) -> None:
    # One write for the line and its newline: the workers of a torchrun share one pipe, and with unbuffered
    # output `print` writes the two apart, so two workers' lines could run into one.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def install(out: Callable[[str], None] = _say) -> StepClock:
    """Wrap this process's collectives and hook its optimizers' steps; returns the clock (once per process)."""
    global _installed  # noqa: PLW0603 - one clock per process: its collectives and optimizers are global too
    if _installed is not None:
        return _installed
    import torch.distributed as dist  # noqa: PLC0415 - torch is the job's, imported only when installed
    from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: PLC0415

    rank = os.environ.get("RANK", "")
    clock = _installed = StepClock(out, rank=int(rank) if rank.isdigit() else None)
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "__lanes_timed__", False):
            continue
        setattr(dist, name, clock.timed(original))
    register_optimizer_step_post_hook(clock.step_done)
    return clock
