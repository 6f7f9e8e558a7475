"""`lanes run -- <command>`: wrap any launcher; its job, ranks and evidence go on the timeline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

import lanes_agent
from lanes_cli.console import EXIT_BAD_INPUT, checked_job_id, err, fail, load_settings, run_async
from lanes_cli.limits import MAX_ATTEMPT, MAX_RANKS
from lanes_observe.outbox import Outbox
from lanes_observe.wrap import CommandNotStartedError, default_outbox, identity_from, run_wrapped, slurm_placement

TORCH_TIMING = "LANES_TORCH_TIMING"
"""Set to 1 in `lanes run`'s environment: the torch job's workers print their step timings (`torch_timing`)."""
TIMING_SITE = Path(lanes_agent.__file__).parent / "timing_site"


def with_torch_timing(env: dict[str, str]) -> dict[str, str]:
    """The command's environment: with LANES_TORCH_TIMING=1, the timing hook's directory first on PYTHONPATH.

    Python runs the `sitecustomize` it finds there at every start-up; it installs the hook in torch.distributed
    workers only (see `lanes_agent/timing_site`). Chosen over asking the job to import the hook because the
    job stays unmodified, and over a `.pth` file because nothing is written into any environment: unset the
    variable and the job runs exactly as before.
    """
    if env.get(TORCH_TIMING) != "1":
        return env
    path = [str(TIMING_SITE), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return env | {"PYTHONPATH": os.pathsep.join(path)}


def run(  # noqa: PLR0917 - typer maps each option to a parameter
    command: Annotated[list[str], typer.Argument(help="The command to run, after `--`.", show_default=False)],
    job: Annotated[str | None, typer.Option(help="Job id (default: slurm-$SLURM_JOB_ID, else a new one).")] = None,
    attempt: Annotated[
        int | None, typer.Option(min=1, max=MAX_ATTEMPT, help="Attempt (default: $SLURM_RESTART_COUNT + 1).")
    ] = None,
    node: Annotated[str | None, typer.Option(help="Node (default: $SLURMD_NODENAME, else the host name).")] = None,
    ranks: Annotated[
        str | None, typer.Option(help="Ranks this command runs, e.g. 0-3 (default: from torchrun/srun or $RANK).")
    ] = None,
    world_size: Annotated[
        int | None, typer.Option(min=1, max=MAX_RANKS, help="Ranks in the whole job (default: env).")
    ] = None,
    register: Annotated[
        bool, typer.Option("--register/--no-register", help="Publish the job's submission and placement.")
    ] = True,
    outbox: Annotated[
        Path | None, typer.Option(help="Where events wait while Lanes is unreachable (default: ~/.cache/lanes/outbox).")
    ] = None,
) -> None:
    """Run COMMAND unchanged and exit with its status; report its job, ranks and evidence to Lanes.

    If Lanes is unreachable, the command still runs: events wait in the outbox file and are sent as soon as
    NATS answers; any left at the end are named on stderr, to publish later with `lanes import FILE`.
    """
    settings = load_settings(quiet=True)
    env = dict(os.environ)
    os.environ.update(with_torch_timing(env))  # the command inherits this process's environment
    if job is not None:
        checked_job_id(job)
    try:
        identity = identity_from(
            command,
            env,
            job=job,
            attempt=attempt,
            node=node,
            ranks=ranks,
            world_size=world_size,
            register=register,
            max_ranks=MAX_RANKS,
        )
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    box = Outbox(outbox or default_outbox(identity, env))
    placement = slurm_placement(identity) if identity.register else None
    try:
        result = run_async(lambda: run_wrapped(command, identity, box, settings.nats_url, placement=placement))
    except CommandNotStartedError as exc:
        # As a shell says it: 127 for a command not found, 126 for one found but not executable.
        fail(f"{exc}; nothing was reported", 127 if isinstance(exc.cause, FileNotFoundError) else 126)
    except OSError as exc:
        fail(f"cannot write the outbox {box.path}: {exc.strerror or exc}", EXIT_BAD_INPUT)
    if result.unsent:
        err.print(
            f"lanes run: Lanes unreachable ({result.error}); {result.unsent} events kept in {result.outbox}; "
            f"publish them with: lanes import {result.outbox}",
            highlight=False,
            soft_wrap=True,
        )
    if result.set_aside:
        err.print(
            f"lanes run: {result.set_aside} events not stored: their ids are held by other events in Lanes "
            f"(the log says which); they are kept in {box.conflicts_path}",
            highlight=False,
            soft_wrap=True,
        )
    raise typer.Exit(result.status)
