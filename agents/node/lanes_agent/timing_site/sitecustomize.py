"""Step timings in an unmodified torch job: what `LANES_TORCH_TIMING=1 lanes run -- ...` puts first on PYTHONPATH.

Python imports `sitecustomize` at start-up, before the job's script. In a torch.distributed worker (RANK is
set: torchrun and srun set it per worker, never for the launcher itself) with LANES_TORCH_TIMING=1, this
installs `lanes_agent.torch_timing`: the collectives are wrapped before the script can bind its own
references to them. Everything else (the launcher, a compiler, a tool the job shells out to) starts as it
would, torch not imported.

The hook is loaded from its file beside this directory, so the job's interpreter needs torch but not Lanes.
A `sitecustomize` of the job's own environment still runs: this one hands over to the next on the path.
"""

# ruff: noqa: INP001 - this directory is a PYTHONPATH entry, never a package
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _next_sitecustomize() -> None:
    """Run the sitecustomize this one shadows, if the path holds another."""
    for entry in sys.path:
        if not entry or Path(entry).resolve() == _HERE:
            continue
        candidate = Path(entry) / "sitecustomize.py"
        if candidate.is_file():
            _load("_lanes_shadowed_sitecustomize", candidate)
            return


if os.environ.get("LANES_TORCH_TIMING") == "1" and os.environ.get("RANK") is not None:
    hook = _load("lanes_torch_timing", _HERE.parent / "torch_timing.py")
    hook.install()
_next_sitecustomize()
