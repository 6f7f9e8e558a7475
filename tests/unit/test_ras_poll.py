"""The agent's side of NCCL RAS: when a rank counts as stalled, and what a RAS client that cannot answer gives."""

from __future__ import annotations

import sys
from datetime import UTC
from pathlib import Path

import pytest

from lanes_agent.ras_poll import RasPolling, StallWatch, ask_ras
from lanes_evidence.parsers import SourceContext

DATA = Path(__file__).parents[1] / "data" / "ras"
CONTEXT = SourceContext(origin="job-1/ncclras@node-9", node="node-9", year=2026, tz=UTC)


def test_a_rank_is_stalled_once_per_silence_and_only_after_its_first_step() -> None:
    watch = StallWatch(10.0)
    assert watch.stalled(1_000.0) is None  # starting up is not stalling
    watch.stepped(100.0)
    assert watch.stalled(109.9) is None
    assert watch.stalled(110.5) == pytest.approx(10.5)
    assert watch.stalled(200.0) is None  # said once; the next step re-arms it
    watch.stepped(201.0)
    assert watch.stalled(211.0) == pytest.approx(10.0)


def test_the_command_is_split_as_a_shell_splits_it_and_an_empty_one_is_refused() -> None:
    assert RasPolling.from_command_line("ncclras -p 28029 -t 5").command == ("ncclras", "-p", "28029", "-t", "5")
    with pytest.raises(ValueError, match="empty"):
        RasPolling.from_command_line("   ")


async def test_a_report_becomes_the_asking_nodes_evidence_with_the_ranks_ras_named() -> None:
    found = await ask_ras(RasPolling(command=("cat", str(DATA / "one_behind_one_dead.txt"))), CONTEXT)
    assert found
    assert {e.node for e in found} == {"node-9"}  # RAS named gpu-a and gpu-b; this node is the one that asked
    behind = [e for e in found if "(behind;" in e.data.summary]
    assert [e.rank for e in behind] == [3]


@pytest.mark.parametrize(
    "command",
    [
        ("lanes-no-such-ras-client",),
        (sys.executable, "-c", "import sys; print('connection refused', file=sys.stderr); sys.exit(1)"),
        (sys.executable, "-c", "print('hello')"),
    ],
    ids=["missing", "fails", "not-a-report"],
)
async def test_a_client_that_cannot_answer_gives_no_evidence(command: tuple[str, ...]) -> None:
    assert await ask_ras(RasPolling(command=command), CONTEXT) == []


async def test_a_client_that_hangs_is_killed_at_the_timeout() -> None:
    hangs = RasPolling(command=(sys.executable, "-c", "import time; time.sleep(60)"), timeout_s=0.5)
    assert await ask_ras(hangs, CONTEXT) == []
