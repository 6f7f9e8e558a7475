"""`lanes recover <job> --approve | --rollback | --abandon --reason "…" [--by WHO]`: an owner's manual decision.

It publishes a `manual_action` event on the job's timeline; the recovery service carries it out (approve:
the recovery the policy would have run; rollback: resume from the verified checkpoint before the last one;
abandon: end the job) and records a decision naming who and why.
"""

from __future__ import annotations

import getpass
from typing import Annotated

import typer

from lanes_cli.console import EXIT_BAD_INPUT, EXIT_NOT_FOUND, fail, load_settings, out, require, run_async
from lanes_cli.limits import excerpt
from lanes_cli.terminal import print_json
from lanes_contract.client import LanesClient
from lanes_contract.events import ManualAction, ManualActionData, ManualActionRequested
from lanes_contract.ids import is_valid_token
from lanes_contract.streams import JOBS
from lanes_runtime.reader import Selection, count

SOURCE = "lanes/cli"


def register(app: typer.Typer) -> None:
    """Add `lanes recover` to the `lanes` app."""
    app.command()(recover)


def recover(  # noqa: PLR0917 - typer maps each parameter to an option
    job_id: str,
    approve: Annotated[bool, typer.Option("--approve", help="Run the recovery the policy would have run.")] = False,
    rollback: Annotated[
        bool, typer.Option("--rollback", help="Resume from the verified checkpoint before the last one.")
    ] = False,
    abandon: Annotated[bool, typer.Option("--abandon", help="Give up: the job ends cancelled.")] = False,
    reason: Annotated[str, typer.Option(help="Why; recorded with the decision.")] = "",
    by: Annotated[str, typer.Option(help="Who decides; default: the current user.")] = "",
) -> None:
    """Decide for a job waiting on the manual recovery path (exactly one of --approve, --rollback, --abandon)."""
    chosen = [action for action, flag in ((ManualAction.APPROVE, approve), (ManualAction.ROLLBACK, rollback),
                                           (ManualAction.ABANDON, abandon)) if flag]  # fmt: skip
    if len(chosen) != 1:
        fail("give exactly one of --approve, --rollback, --abandon", EXIT_BAD_INPUT)
    if not reason.strip():
        fail("--reason is required: the decision is audited with who and why", EXIT_BAD_INPUT)
    if not is_valid_token(job_id):
        fail(f"job id {excerpt(job_id)} must be 1-128 characters from A-Z a-z 0-9 _ -", EXIT_BAD_INPUT)
    nats_url = require(load_settings(quiet=True).nats_url, "NATS_URL")
    who = by or _current_user()
    data = ManualActionData(action=chosen[0], reason=reason, requested_by=who)

    async def publish() -> int:
        async with await LanesClient.connect(nats_url, source=SOURCE) as client:
            if await count(client.js, Selection(JOBS.name, f"lanes.job.{job_id}.submitted")) == 0:
                fail(f"unknown job {job_id!r}: nothing was submitted on lanes.job.{job_id}", EXIT_NOT_FOUND)
            return await client.publish(ManualActionRequested(source=client.source, jobid=job_id, data=data))

    seq = run_async(publish)
    # The reason and the name are the user's own text, echoed back: as ASCII JSON, whatever they hold.
    print_json(out, {"job_id": job_id, "action": chosen[0].value, "by": who, "reason": reason, "seq": seq})


def _current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers): the decision still needs a name
        return "unknown-user"
