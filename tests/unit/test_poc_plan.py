"""The POC plan: the shipped default, and every malformed plan named by its line and what was expected there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lanes_cli.poc_plan import InferenceStep, PlanError, default_plan_text, parse_plan
from lanes_contract.events import DrillKind

LANES = str(Path(sys.executable).parent / "lanes")
SMALL = """\
cluster:
  nodes: 3
rungs:
  - nodes: 1
    drills:
      - kind: kill
  - nodes: 2
    drills:
      - kind: hang
        rank: 1
"""


def test_the_default_plan_grows_from_one_node_to_four_with_a_drill_at_every_rung() -> None:
    plan = parse_plan(default_plan_text())
    assert [(rung.nodes, rung.gpus) for rung in plan.rungs] == [(1, 4), (2, 4), (4, 4)]
    assert all(rung.drills for rung in plan.rungs)
    assert plan.cluster.nodes > max(rung.nodes for rung in plan.rungs)  # a spare node to resume on
    assert plan.training.workload == "drill"
    assert plan.inference is not None
    assert plan.inference.steps == tuple(InferenceStep)


def test_a_small_plan_takes_the_defaults_it_does_not_name() -> None:
    plan = parse_plan(SMALL)
    assert plan.rungs[0].drills[0].kind is DrillKind.KILL
    assert plan.rungs[0].drills[0].rank == 0
    assert plan.rungs[1].gpus == 4
    assert plan.criteria.named_right
    assert plan.inference is None


def test_an_inference_service_of_more_replicas_and_clients_than_the_demos_is_accepted() -> None:
    plan = parse_plan(SMALL + "inference: {versions: [stable, canary], replicas: 3, clients: 5, steps: [upgrade]}\n")
    assert plan.inference is not None
    assert (plan.inference.versions, plan.inference.replicas, plan.inference.clients) == (("stable", "canary"), 3, 5)
    assert plan.inference.steps == (InferenceStep.UPGRADE,)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (SMALL.replace("kind: hang", "kind: melt"), "line 9: rungs.1.drills.0.kind: Input should be"),
        (SMALL.replace("rank: 1", "rank: 2"), "line 7: rungs.1: Value error, drill rank 2 does not exist"),
        (SMALL.replace("  nodes: 3\n", "  nodes: 0\n"), "line 2: cluster.nodes: Input should be greater than"),
        (SMALL.replace("  nodes: 3\n", "  nodes: true\n"), "line 2: cluster.nodes: Input should be a valid integer"),
        ("cluster:\n  nodes: 2\n", "line 1: rungs: Field required"),
        (SMALL + "rungs: []\n", "line 11: "),  # a key given twice is refused, not silently the last one
        (SMALL + "colour: blue\n", "line 11: colour: Extra inputs are not permitted"),
        ("- a\n- b\n", "line 1: expected a mapping"),
        ("cluster: {nodes: [1\n", "line 1: not valid YAML"),
        (SMALL + "training:\n  workload: drill\n  command: [x]\n", "line 12: training: Value error, give either"),
        (SMALL + "inference:\n  model: llama-70b\n", "line 12: inference: Value error, unknown model 'llama-70b'"),
        (SMALL + "inference: {versions: [v1, v1]}\n", "line 11: inference: Value error, the two versions must differ"),
        (SMALL + "inference: {versions: [v1, 'v.*']}\n", "line 11: inference.versions.1: Value error"),
        (
            SMALL + "inference: {replicas: 1}\n",
            "line 11: inference.replicas: Input should be greater than or equal to 2",
        ),
        (SMALL + "inference: {clients: 0}\n", "line 11: inference.clients: Input should be greater than or equal to 1"),
        (SMALL + "inference: {steps: [start, canary]}\n", "line 11: inference.steps.1: Input should be"),
        (
            SMALL.replace("kind: hang", "kind: replica-kill"),
            "line 7: rungs.1: Value error, replica-kill is a drill on an inference replica",
        ),
    ],
)
def test_a_malformed_plan_names_the_line_and_what_was_expected(text: str, expected: str) -> None:
    with pytest.raises(PlanError) as raised:
        parse_plan(text)
    assert str(raised.value).startswith(expected), str(raised.value)


def test_lanes_poc_run_refuses_a_malformed_plan_with_exit_2_before_starting_anything(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(SMALL.replace("kind: hang", "kind: melt"))
    env = {k: v for k, v in os.environ.items() if k not in {"NATS_URL", "DATABASE_URL", "REDIS_URL"}}
    ran = subprocess.run(
        [LANES, "poc", "run", str(plan)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 2, ran.stderr
    assert "line 9: rungs.1.drills.0.kind" in ran.stderr
    assert str(plan) in ran.stderr
    assert ran.stdout == ""


def test_lanes_poc_run_refuses_a_plan_that_is_not_a_text_file(tmp_path: Path) -> None:
    ran = subprocess.run([LANES, "poc", "run", str(tmp_path)], capture_output=True, text=True, timeout=60, check=False)
    assert ran.returncode == 2
    assert "is a directory" in ran.stderr
