"""Bad input at the CLI edge: one clear line on stderr, exit 2, and nothing sent (issue 16, "Bad input").

None of these reach a server: the spec is refused while it is read, the id before any connection.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lanes_cli.cli import app
from lanes_cli.input_files import MAX_SPEC_BYTES, InputFileError, parse_yaml
from lanes_cli.limits import (
    MAX_HOSTS,
    MAX_RANKS,
    MAX_YAML_DEPTH,
    MAX_YAML_EXPANSION,
    InputLimitError,
    check_utc_offset,
    check_yaml_shape,
)
from lanes_cli.timeline import TimelineEntry, job_header
from lanes_cli.topology_formats import TopologyFormatError, expand_hostlist
from lanes_contract.codec import MAX_EVENT_BYTES, encode
from lanes_contract.errors import InvalidEventError
from lanes_contract.events import JobStateChanged, JobStateChangedData, JobSubmitted, JobSubmittedData
from lanes_contract.jobs import MAX_COMMAND_CHARS, JobSpec, JobState
from lanes_observe.wrap import parse_ranks

runner = CliRunner()
EXIT_BAD_INPUT = 2
# No server is needed: each command must refuse before it connects (a connection would fail with exit 4).
UNREACHABLE = {"NATS_URL": "nats://127.0.0.1:9", "DATABASE_URL": "postgresql://127.0.0.1:9/x"}


def refused(args: list[str]) -> str:
    result = runner.invoke(app, args, env=UNREACHABLE)
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    message = result.stderr.strip()
    assert message.startswith("error:"), message
    assert "Traceback" not in result.output
    return " ".join(message.split())  # rich wraps long lines at the terminal width


def test_a_binary_spec_file_is_refused(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    assert "not a text file" in refused(["submit", str(spec)])


def test_an_oversized_spec_file_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: big\nworkers: 1\n# " + "x" * MAX_SPEC_BYTES + "\n")
    assert "larger than" in refused(["submit", str(spec)])


def test_a_device_or_directory_is_not_a_spec(tmp_path: Path) -> None:
    assert "not a regular file" in refused(["submit", "/dev/zero"])
    assert "a directory" in refused(["submit", str(tmp_path)])


def test_an_oversized_command_is_refused(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: huge\nworkers: 1\ncommand: [python, -c, '{'x' * (10 * 1024 * 1024)}']\n")
    message = refused(["submit", str(spec)])
    assert "command" in message


def test_a_command_just_over_the_total_bound_is_refused(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    arguments = ", ".join(["a" * 30_000] * (MAX_COMMAND_CHARS // 30_000 + 1))
    spec.write_text(f"name: many\nworkers: 1\ncommand: [{arguments}]\n")
    assert f"at most {MAX_COMMAND_CHARS}" in refused(["submit", str(spec)])


@pytest.mark.parametrize("field", ["workers", "gpus_per_worker", "priority", "retry_budget"])
def test_a_boolean_posing_as_an_integer_is_refused(tmp_path: Path, field: str) -> None:
    spec = tmp_path / "spec.yaml"
    lines = {"name": "b", "workers": "2", field: "true"}
    spec.write_text("".join(f"{key}: {value}\n" for key, value in lines.items()))
    assert field in refused(["submit", str(spec)])


def test_a_duplicate_key_is_refused_not_silently_overwritten(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: dup\nworkers: 1\nworkers: 64\n")
    assert "duplicate key 'workers'" in refused(["submit", str(spec)])
    nested = tmp_path / "nested.yaml"
    nested.write_text("name: dup\nworkers: 1\nowners:\n  host: a\n  host: b\n")
    assert "duplicate key 'host'" in refused(["submit", str(nested)])


@pytest.mark.parametrize("command", ["timeline", "incident", "job", "cancel"])
@pytest.mark.parametrize("job_id", ["*", ">", "a.b", "job *"])
def test_a_wildcard_where_a_job_id_is_expected_is_refused(command: str, job_id: str) -> None:
    assert "job id" in refused([command, job_id])


def test_a_one_megabyte_submitted_event_can_never_reach_the_log() -> None:
    """Whatever builds it (the CLI, the HTTP API, a script), such an event is refused before it is sent."""
    spec = JobSpec.model_construct(name="big", workers=1, command=("x" * (1024 * 1024),))
    event = JobSubmitted.model_construct(
        id="e1", source="lanes/cli", jobid="big", attempt=1, data=JobSubmittedData.model_construct(spec=spec)
    )
    with pytest.raises(InvalidEventError):
        encode(event)
    with pytest.raises(InvalidEventError, match=f"at most {MAX_EVENT_BYTES}"):
        encode(event, revalidate=False)


def test_analyze_names_a_device_for_what_it_is() -> None:
    assert "/dev/zero is a character device" in refused(["analyze", "/dev/zero"])


@pytest.mark.slow
def test_analyze_streams_a_large_log_in_bounded_memory(tmp_path: Path) -> None:
    """A 40 MB log, one 20 MB line included, in a bounded RSS (reading it whole used ~10x its size).

    Measured here: 40 MiB peaks at 145 MiB (most of it the interpreter and imports); 300 MiB of the same
    took 221 s and stayed under 300 MiB. Memory is flat, so 40 MiB shows it in seconds.
    """
    log = tmp_path / "rank0.log"
    chatter = "[rank0]: step {} loss 2.{:02d} tokens/s 91234 lr 3e-4 some chatter here\n"
    block = "".join(chatter.format(i, i % 97) for i in range(4096))
    with log.open("w") as handle:
        handle.write("x" * (20 * 1024 * 1024) + "\n")  # one 20 MB line without a break in it
        for _ in range((20 * 1024 * 1024) // len(block)):
            handle.write(block)
        handle.write("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    child = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(log)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "NATS_URL": "", "LANES_LOG_LEVEL": "error"},
    )
    assert child.returncode == 0, child.stderr[-2000:]
    peak_mib = int(child.stdout.strip().splitlines()[-1]) / 1024
    print(f"lanes analyze: {log.stat().st_size / 2**20:.0f} MiB log, peak RSS {peak_mib:.0f} MiB")  # noqa: T201
    assert peak_mib < 200, f"peak RSS {peak_mib:.0f} MiB"


_MEASURE = """
import sys
from typer.testing import CliRunner
from lanes_cli.cli import app
result = CliRunner().invoke(app, ["analyze", sys.argv[1], "--json"])
assert result.exit_code in (0, 1), result.output[-2000:]
assert "oom" in result.stdout.lower() or "out_of_memory" in result.stdout.lower(), result.stdout[-2000:]
# VmHWM is this process's own peak: getrusage's ru_maxrss survives exec on Linux, so in a child of a large
# pytest process it would report the parent's size.
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


# --- the bounds of lanes_cli.limits, checked before any work (issue 43) ------------------------------------


def test_yaml_aliases_within_the_expansion_bound_are_read_and_a_bomb_is_not() -> None:
    assert parse_yaml("base: &b {gpus: 8}\nnodes: [*b, *b, *b]\n")["nodes"] == [{"gpus": 8}] * 3
    bomb = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}' if i else 'x'] * 9)}]\n" for i in range(9))
    with pytest.raises(InputFileError, match=f"at most {MAX_YAML_EXPANSION} times"):
        parse_yaml(bomb)


def test_yaml_nesting_is_bounded_before_it_is_built() -> None:
    inner = MAX_YAML_DEPTH - 1  # the top mapping is a level
    nested: list[object] = []
    for _ in range(inner - 1):
        nested = [nested]
    assert parse_yaml("a: " + "[" * inner + "]" * inner) == {"a": nested}
    with pytest.raises(InputFileError, match=f"limit of {MAX_YAML_DEPTH} levels"):
        parse_yaml("a: " + "[" * 5_000 + "]" * 5_000)
    with pytest.raises(InputLimitError, match="levels"):
        check_yaml_shape("".join(f"{'  ' * depth}k{depth}:\n" for depth in range(MAX_YAML_DEPTH + 1)) + "  " * 65 + "x")


def test_a_yaml_key_that_is_a_list_is_refused_not_a_crash() -> None:
    with pytest.raises(InputFileError, match="a list as a key"):
        parse_yaml("? [a, b]\n: 1\n")


def test_hosts_are_counted_before_a_hostlist_is_expanded() -> None:
    assert len(expand_hostlist(f"gpu[1-{MAX_HOSTS}]")) == MAX_HOSTS
    with pytest.raises(TopologyFormatError, match=f"limit of {MAX_HOSTS}"):
        expand_hostlist(f"gpu[1-{MAX_HOSTS + 1}]")
    with pytest.raises(TopologyFormatError, match="limit of 9 digits"):
        expand_hostlist("gpu[1-" + "9" * 5_000 + "]")


def test_ranks_are_counted_before_they_are_listed() -> None:
    assert parse_ranks("0-3,8", max_ranks=MAX_RANKS) == (0, 1, 2, 3, 8)
    assert len(parse_ranks(f"0-{MAX_RANKS - 1}", max_ranks=MAX_RANKS)) == MAX_RANKS
    for text, says in [
        (f"0-{MAX_RANKS}", f"limit of {MAX_RANKS}"),
        ("5-1", "runs backwards"),
        ("1" * 5_000, f"limit of {MAX_RANKS}"),
        (",".join([f"0-{MAX_RANKS - 1}"] * 2), f"more than the limit of {MAX_RANKS}"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_ranks(text, max_ranks=MAX_RANKS)


@pytest.mark.parametrize("hours", [99.0, -14.5, float("nan"), float("inf"), float("-inf")])
def test_an_offset_no_clock_has_is_refused(hours: float) -> None:
    with pytest.raises(InputLimitError, match="limit of 14 hours"):
        check_utc_offset(hours)


def test_the_timeline_header_is_the_state_its_own_transitions_give() -> None:
    def moved(seq: int, attempt: int, to_state: JobState) -> TimelineEntry:
        data = JobStateChangedData(from_state=None, to_state=to_state, cause_type="io.lanes.job.placed.v1")
        event = JobStateChanged(source="lanes/lifecycle", jobid="j-1", attempt=attempt, data=data)
        return TimelineEntry(seq, "lanes.job.j-1.state_changed", event)

    entries = [moved(1, 1, JobState.RUNNING), moved(2, 1, JobState.FAILED), moved(3, 2, JobState.RUNNING)]
    assert job_header("j-1", entries) == {
        "job_id": "j-1",
        "state": "running",
        "attempts": [{"number": 1, "state": "failed"}, {"number": 2, "state": "running"}],
    }
    assert job_header("j-1", [])["state"] is None
