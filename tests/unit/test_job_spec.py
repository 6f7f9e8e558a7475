"""The job spec's lifecycle fields: optional with defaults (older specs stay valid), validated with clear errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lanes_contract.jobs import FailureCause, JobSpec, Owners, SuccessCriteria


def test_a_spec_from_before_the_lifecycle_fields_is_still_valid_with_defaults():
    spec = JobSpec.model_validate({"name": "old", "workers": 2})
    assert spec.model_version is None
    assert spec.checkpoint_location is None
    assert spec.success == SuccessCriteria(all_ranks_exit_zero=True, required_artifacts=())
    assert spec.retry_budget == 3
    assert spec.owners == Owners()


def test_a_full_spec_round_trips():
    raw = {
        "name": "llm",
        "workers": 8,
        "image": "registry/llm@sha256:" + "1" * 64,
        "model_version": "sha256:" + "a" * 64,
        "data_version": "sha256:" + "b" * 64,
        "config_version": "md5:" + "c" * 32,
        "checkpoint_location": "s3://ckpt/llm",
        "success": {"required_artifacts": ["model", "eval-report"]},
        "retry_budget": 5,
        "owners": {"algorithm": "ml-oncall", "network": "net-team"},
    }
    spec = JobSpec.model_validate(raw)
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
    assert spec.owners.network == "net-team"


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("model_version", "latest", "model_version"),
        ("retry_budget", -1, "retry_budget"),
        ("owners", {"finance": "bob"}, "owners.finance"),
        ("success", {"required_artifacts": ["bad name"]}, "success.required_artifacts.0"),
        ("checkpoint_location", "", "checkpoint_location"),
    ],
)
def test_a_bad_lifecycle_field_is_refused_naming_the_field(field, value, where):
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate({"name": "x", "workers": 1, field: value})
    assert [".".join(map(str, e["loc"])) for e in caught.value.errors()] == [where]


def test_every_cause_of_the_issue_exists():
    assert {c.value for c in FailureCause} == {
        "normal_completion",
        "user_cancel",
        "node_fault",
        "communication_failure",
        "user_code_error",
        "platform_action",
        "unknown",
    }
