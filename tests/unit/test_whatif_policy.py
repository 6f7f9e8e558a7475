"""`lanes policy propose | approve | history`: a policy reaches recovery only with its what-if result.

Run over the committed demo log (tests/data/whatif/demo.ndjson), in a ledger under a temporary directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from lanes_cli import policy_cli
from lanes_recovery.views import policy_from_file

DATA = Path(__file__).resolve().parents[1] / "data" / "whatif"
DEMO_LOG = DATA / "demo.ndjson"
RETRY_ALGORITHM = DATA / "retry-algorithm.yaml"
EXIT_BAD_INPUT = 2
EXIT_NOT_FOUND = 3
runner = CliRunner()


def _lanes_policy(*args: str | Path | float) -> tuple[int, str]:
    result = runner.invoke(policy_cli.app, [str(a) for a in args])
    return result.exit_code, result.output


def _propose(store: Path, policy: Path = RETRY_ALGORITHM) -> dict[str, object]:
    code, output = _lanes_policy("propose", policy, "--from", DEMO_LOG, "--store", store, "--days", 30, "--json")
    assert code == 0, output
    entry: dict[str, object] = json.loads(output)
    return entry


def test_a_proposal_carries_its_what_if_diff_over_the_window(tmp_path: Path) -> None:
    entry = _propose(tmp_path)
    assert (entry["kind"], entry["name"], entry["version"]) == ("proposed", "retry-algorithm", 2)
    whatif = entry["whatif"]
    assert isinstance(whatif, dict)
    (change,) = whatif["diff"]
    assert change["job_id"].startswith("demo-fail-")
    assert (change["recorded"]["action"], change["new"]["action"]) == ("manual", "resume")
    assert whatif["deltas"]["pages"] == {"recorded": 1, "new": 0, "delta": -1}
    window = entry["window"]
    assert isinstance(window, dict)
    assert window["jobs"] >= 1
    assert (tmp_path / "retry-algorithm-v2.yaml").read_text() == RETRY_ALGORITHM.read_text()


def test_approving_writes_the_policy_recovery_loads_and_records_who_and_why(tmp_path: Path) -> None:
    _propose(tmp_path)
    code, output = _lanes_policy(
        "approve", 2, "--by", "ada", "--reason", "algorithm errors retry once", "--store", tmp_path
    )
    assert code == 0, output
    assert "LANES_RECOVERY_POLICY=" in output
    approved = policy_from_file(tmp_path / policy_cli.APPROVED)
    assert (approved.name, approved.version) == ("retry-algorithm", 2)
    code, output = _lanes_policy("history", "--store", tmp_path, "--from", DEMO_LOG, "--json")
    assert code == 0, output
    history = json.loads(output)
    assert [e["kind"] for e in history["ledger"]] == ["proposed", "approved"]
    assert (history["ledger"][1]["by"], history["ledger"][1]["reason"]) == ("ada", "algorithm errors retry once")
    # The demo's decisions name the policy that made them: three by the shipped default, v1.
    assert sum(row["decisions"] for row in history["decisions"]) == 3
    assert {(row["policy"], row["version"]) for row in history["decisions"]} == {("lanes-default", 1)}


def test_a_version_never_proposed_cannot_be_approved(tmp_path: Path) -> None:
    code, output = _lanes_policy("approve", 7, "--by", "ada", "--reason", "r", "--store", tmp_path)
    assert code == EXIT_NOT_FOUND
    assert "no proposal of version 7" in output
    assert not (tmp_path / policy_cli.APPROVED).exists()


def test_a_proposal_whose_text_changed_since_must_be_proposed_again(tmp_path: Path) -> None:
    _propose(tmp_path)
    kept = tmp_path / "retry-algorithm-v2.yaml"
    kept.write_text(kept.read_text().replace("max_retries: 3", "max_retries: 9"))
    code, output = _lanes_policy("approve", 2, "--by", "ada", "--reason", "r", "--store", tmp_path)
    assert code == EXIT_BAD_INPUT
    assert "changed since it was proposed" in output
    assert not (tmp_path / policy_cli.APPROVED).exists()


def test_one_version_names_one_text(tmp_path: Path) -> None:
    _propose(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(RETRY_ALGORITHM.read_text().replace("max_retries: 3", "max_retries: 4"))
    code, output = _lanes_policy("propose", other, "--from", DEMO_LOG, "--store", tmp_path)
    assert code == EXIT_BAD_INPUT
    assert "already proposed with other content" in output


def test_a_malformed_policy_names_its_line_exits_2_and_changes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = RETRY_ALGORITHM.read_text()
    line = next(n for n, row in enumerate(text.splitlines(), start=1) if "max_retries:" in row)
    bad.write_text(text.replace("max_retries: 3", "max_retries: -1", 1))
    store = tmp_path / "ledger"
    code, output = _lanes_policy("propose", bad, "--from", DEMO_LOG, "--store", store)
    assert code == EXIT_BAD_INPUT
    assert f"line {line}: defaults.max_retries:" in " ".join(output.split())
    assert not store.exists()


def test_a_yaml_syntax_error_names_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nversion: 1\nclasses: [\n")
    code, output = _lanes_policy("propose", bad, "--from", DEMO_LOG, "--store", tmp_path / "ledger")
    assert code == EXIT_BAD_INPUT
    assert "line 4: not valid YAML" in " ".join(output.split())


def test_the_lanes_command_has_the_policy_verbs() -> None:
    from lanes_cli.cli import app  # noqa: PLC0415 - the whole command line, only for this check

    assert "policy" in {group.name for group in app.registered_groups}
