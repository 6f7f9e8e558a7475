"""Property-based fuzzing of every parser a user's input reaches (issue 43): the job spec loader, the topology
formats, the log parsers and `lanes import`'s event decoder.

Whatever the input, each gives a result or the project's typed error, never another exception, and stays
bounded: a small input never costs more than a bounded amount of memory (measured with tracemalloc), and a
parser that reads a long stream keeps a bounded amount of it.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lanes_cli.cli import spec_of
from lanes_cli.input_files import InputFileError, parse_yaml
from lanes_cli.limits import MAX_HOSTS, MAX_YAML_DEPTH
from lanes_cli.topology_formats import (
    TopologyFormatError,
    expand_hostlist,
    parse_k8s_labels,
    parse_native,
    parse_nvidia_smi,
    parse_slurm,
)
from lanes_contract.codec import decode_structured, to_structured
from lanes_contract.errors import DecodeError
from lanes_contract.events import JobSubmitted, JobSubmittedData
from lanes_contract.jobs import JobSpec
from lanes_evidence.evidence import Evidence
from lanes_evidence.parsers import MAX_LINE, LogParser, SourceContext, clock_of

_T = TypeVar("_T")
DATA = Path(__file__).resolve().parent.parent / "data"
SMALL_INPUT_PEAK_BYTES = 64 * 1024 * 1024
"""What parsing a few kilobytes may cost at most; an alias bomb or a hostlist expansion costs gigabytes."""
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def peak_of(work: Callable[[], _T]) -> tuple[_T | Exception, int]:
    """What `work` returned (or raised), and the most memory it held at once, in bytes."""
    tracemalloc.start()
    try:
        try:
            result: _T | Exception = work()
        except Exception as exc:  # noqa: BLE001 - the caller checks which exceptions are allowed
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def assert_result_or(result: object, *allowed: type[Exception]) -> None:
    if isinstance(result, Exception):
        assert isinstance(result, allowed), f"{type(result).__name__}: {result}"


# --- text that looks like what each parser reads --------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=25,
)
yaml_fragments = st.sampled_from(
    [
        "&a ",
        "*a",
        "<<: *a\n",
        "? ",
        "- ",
        ": ",
        "[",
        "]",
        "{",
        "}",
        "!!python/object:os.system ",
        "!!binary ",
        "---\n",
        "...\n",
        "%YAML 1.1\n",
        "|\n  ",
        ">-\n  ",
        '"\\x',
        "'",
        "#",
        "\t",
        "\n",
        "  ",
        "\x07",
        "\ufeff",
        "name: ",
        "workers: ",
        "job_id: ",
        "command: ",
        "nodes: ",
        "policy: ",
        "kind: Node\n",
        "kind: Topology\n",
    ]
)


def mutated(base: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Text from `base` with fragments of YAML syntax inserted at arbitrary places."""

    @st.composite
    def build(draw: st.DrawFn) -> str:
        text = draw(base)
        for _ in range(draw(st.integers(0, 6))):
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(yaml_fragments) + text[at:]
        return text

    return build()


yaml_texts = st.one_of(
    st.text(max_size=400),
    mutated(documents.map(lambda d: yaml.safe_dump(d, default_flow_style=None))),
    mutated(documents.map(json.dumps)),
    mutated(
        st.fixed_dictionaries(
            {"name": scalars, "workers": scalars},
            optional={"job_id": scalars, "gpus_per_worker": scalars, "command": documents, "priority": scalars},
        ).map(yaml.safe_dump)
    ),
    st.integers(1, 3 * MAX_YAML_DEPTH).map(lambda depth: "a: " + "[" * depth + "]" * depth),
    st.integers(1, 12).map(
        lambda levels: "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}' if i else 'x'] * 9)}]\n" for i in range(levels))
    ),
)


# --- the job spec loader ---------------------------------------------------------------------------------


def load_spec_text(text: str) -> tuple[str | None, JobSpec]:
    return spec_of(parse_yaml(text))


@FUZZ
@given(text=yaml_texts)
def test_any_spec_text_is_a_spec_or_an_input_file_error_in_bounded_memory(text: str) -> None:
    result, peak = peak_of(lambda: load_spec_text(text))
    assert_result_or(result, InputFileError)
    assert peak < SMALL_INPUT_PEAK_BYTES


def test_a_valid_spec_survives_the_loader() -> None:
    assert load_spec_text("job_id: j-1\nname: train\nworkers: 2\n")[0] == "j-1"


# --- topology formats -------------------------------------------------------------------------------------

hostlist_alphabet = st.text(alphabet="gpu0123456789[]-, ", max_size=40)
slurm_keys = st.sampled_from(["SwitchName", "Switches", "Nodes", "BlockName", "BlockSizes", "LinkSpeed", "Other"])
slurm_lines = st.lists(
    st.lists(st.tuples(slurm_keys, st.one_of(hostlist_alphabet, st.text(max_size=10))), min_size=1, max_size=4).map(
        lambda pairs: " ".join(f"{key}={value}" for key, value in pairs)
    ),
    max_size=8,
)
slurm_texts = st.one_of(
    st.text(max_size=400),
    slurm_lines.map("\n".join),
    slurm_lines.map(lambda lines: " \\\n".join(lines) + "#" + "\n"),
)
smi_texts = st.one_of(
    st.text(max_size=400),
    st.lists(
        st.lists(st.sampled_from(["GPU0", "GPU1", "NIC0", "mlx5_0", "X", "NV12", "PIX", "SYS", "??", " "]), max_size=5),
        max_size=5,
    ).map(lambda rows: "\t" + "\n".join("\t".join(row) for row in rows)),
)


@FUZZ
@given(expression=st.one_of(hostlist_alphabet, st.text(max_size=60)))
def test_any_hostlist_expands_within_its_bound_or_is_refused(expression: str) -> None:
    result, peak = peak_of(lambda: expand_hostlist(expression))
    assert_result_or(result, TopologyFormatError)
    if not isinstance(result, Exception):
        assert len(result) <= MAX_HOSTS
    assert peak < SMALL_INPUT_PEAK_BYTES


command_defaults = st.dictionaries(
    st.sampled_from(["gpus", "gpu_model", "gpu_memory_gib", "pool"]),
    st.one_of(st.integers(-5, 2**70), st.text(max_size=8)),
)
"""What `lanes topology import --gpus/--gpu-model/--gpu-memory/--pool` add to every node, typed or not."""


@FUZZ
@given(text=slurm_texts, defaults=command_defaults)
def test_any_topology_conf_is_a_cluster_or_a_format_error(text: str, defaults: dict[str, object]) -> None:
    result, peak = peak_of(lambda: parse_slurm(text, defaults=defaults))
    assert_result_or(result, TopologyFormatError)
    assert peak < SMALL_INPUT_PEAK_BYTES


@FUZZ
@given(text=yaml_texts)
def test_any_native_inventory_is_a_cluster_or_a_format_error(text: str) -> None:
    result, peak = peak_of(lambda: parse_native(text))
    assert_result_or(result, TopologyFormatError)
    assert peak < SMALL_INPUT_PEAK_BYTES


k8s_texts = st.one_of(
    yaml_texts,
    mutated(st.just((DATA / "topology" / "k8s_nodes.yaml").read_text()[:3000])),
    mutated(st.just((DATA / "topology" / "cluster.yaml").read_text())),
)


@FUZZ
@given(text=k8s_texts)
def test_any_kubernetes_node_list_is_a_cluster_or_a_format_error(text: str) -> None:
    result, peak = peak_of(lambda: parse_k8s_labels(text))
    assert_result_or(result, TopologyFormatError)
    assert peak < SMALL_INPUT_PEAK_BYTES


@FUZZ
@given(text=st.one_of(smi_texts, mutated(st.just((DATA / "topology" / "nvidia_smi_topo.txt").read_text()))))
def test_any_nvidia_smi_matrix_is_a_matrix_or_a_format_error(text: str) -> None:
    result, peak = peak_of(lambda: parse_nvidia_smi(text))
    assert_result_or(result, TopologyFormatError)
    assert peak < SMALL_INPUT_PEAK_BYTES


# --- log parsers ----------------------------------------------------------------------------------------

CONTEXT = SourceContext(origin="fuzz", year=2026, tz=UTC)
log_fragments = st.sampled_from(
    [
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "    loss.backward()",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "Failures:",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-12-07_10:00:00",
        "  host      : node-1",
        "  rank      : 3 (local_rank: 1)",
        "  exitcode  : -9 (pid: 4242)",
        "  traceback : Signal 9 (SIGKILL) received by PID 4242",
        "-------------------------------------",
        "=====================================",
        "[rank3]:",
        "[default0]:",
        "node-2: ",
        "E1207 10:00:00.123456 4242 ProcessGroupNCCL.cpp:1 ",
        "NCCL WARN Call to ibv_poll_cq failed",
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus.",
        "Out of memory: Killed process 4242 (python)",
        "local_ranks=[0, 1] global_ranks=[6, 7]",
        "nproc_per_node=99999 node_rank=999999",
        "srun: error: node-1: task 2: Exited with exit code 3",
        "Dec  7 10:00:00 ",
        "2026-02-31T25:61:61Z ",
        "\x00",
        "\r",
    ]
)
log_lines = st.lists(
    st.lists(st.one_of(log_fragments, st.text(max_size=30)), min_size=1, max_size=4).map("".join), max_size=40
)


@FUZZ
@given(lines=log_lines)
def test_any_log_is_evidence_and_never_an_exception(lines: list[str]) -> None:
    parser = LogParser(CONTEXT)
    found: list[Evidence] = []
    for line in lines:
        found.extend(parser.feed(line))
    found.extend(parser.finish())
    assert all(len(line) <= MAX_LINE for evidence in found for line in evidence.data.lines)


@FUZZ
@given(head=st.text(max_size=300))
def test_any_head_gives_a_clock(head: str) -> None:
    year, zone = clock_of(head, fallback=datetime(2026, 12, 7, tzinfo=UTC))
    assert 1 <= year <= 9999
    assert zone.utcoffset(None) is not None


ENDLESS_BLOCKS = {
    "a rank's traceback": (["[rank3]: Traceback (most recent call last):"], '[rank3]:   File "x.py", line {n}, in f'),
    "a worker's traceback": (
        ["[default0]:[rank1]: Traceback (most recent call last):"],
        "[default0]:[rank1]:     f({n})",
    ),
    "a failure entry": (["Failures:", "[0]:"], "  rank      : {n} (local_rank: 0)"),
}


@pytest.mark.parametrize("block", list(ENDLESS_BLOCKS))
def test_an_endless_block_keeps_a_bounded_part_of_itself(block: str) -> None:
    """A traceback or a failure entry that never ends holds memory for its head and last frames only."""
    start, filler = ENDLESS_BLOCKS[block]
    parser = LogParser(CONTEXT)
    for line in [*start, filler.format(n=0)]:
        parser.feed(line)
    tracemalloc.start()
    try:
        held = tracemalloc.get_traced_memory()[0]
        for n in range(1, 5_001):
            parser.feed(filler.format(n=n))  # each line a string of its own, as read from a file
        grown = tracemalloc.get_traced_memory()[0] - held
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes kept after 5,000 lines"
    assert all(len(evidence.data.lines) <= 8 for evidence in parser.finish())


# --- lanes import's decoder -------------------------------------------------------------------------------

SAMPLE = to_structured(
    JobSubmitted(source="fuzz", jobid="j-1", attempt=1, data=JobSubmittedData(spec=JobSpec(name="n", workers=1)))
)
event_objects = st.one_of(
    documents,
    st.builds(lambda extra: SAMPLE | extra, st.dictionaries(st.sampled_from(list(SAMPLE)), documents, max_size=3)),
)
event_lines = st.one_of(
    st.binary(max_size=400),
    event_objects.map(lambda o: json.dumps(o).encode()),
    mutated(event_objects.map(json.dumps)).map(str.encode),
)


@FUZZ
@given(line=event_lines)
def test_any_import_line_is_an_event_or_a_decode_error(line: bytes) -> None:
    result, peak = peak_of(lambda: decode_structured(line))
    assert_result_or(result, DecodeError)
    assert peak < SMALL_INPUT_PEAK_BYTES


def test_the_sample_event_decodes() -> None:
    assert decode_structured(json.dumps(SAMPLE).encode()).jobid == "j-1"


prefixes = st.sampled_from(["", "[rank3]: ", "[default1]:[rank3]: ", "node-2: [rank3]: ", "3: ", "[1,3]<stderr>: "])
frames = st.lists(
    st.tuples(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), st.integers(1, 9999)), min_size=1, max_size=6
)


@FUZZ
@given(prefix=prefixes, stack=frames, message=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126)))
def test_a_traceback_is_one_exception_with_its_last_frames_whatever_wraps_its_lines(
    prefix: str, stack: list[tuple[str, int]], message: str
) -> None:
    lines = ["Traceback (most recent call last):"]
    for function, number in stack:
        lines += [f'  File "/srv/{function}.py", line {number}, in {function}', f"    {function}()"]
    lines.append(f"ValueError: {message}".rstrip())
    parser = LogParser(CONTEXT)
    found = [evidence for line in lines for evidence in parser.feed(prefix + line)] + parser.finish()
    assert [evidence.category.value for evidence in found] == ["python_exception"]
    kept = found[0].data.lines
    assert kept[0].endswith(lines[0])
    assert kept[-1].endswith(lines[-1])
    assert [line.split('"')[1] for line in kept[1:-1]] == [f"/srv/{function}.py" for function, _ in stack[-3:]]
