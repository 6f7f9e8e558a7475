"""Hostile input at every `lanes` command: one line on stderr, exit 2 (3 for an unknown id), nothing published.

Issue 43, "Every input bounded and every error one line". Each case runs the `lanes` entry point (`main`,
what the installed script calls) against a real NATS server with the Lanes streams, with stderr captured
(not a terminal, where rich once wrapped errors at 80 columns); a few run as a process of their own, exactly
as a user's shell runs them. After every case the streams hold no new message and the working directory
holds nothing new. The bounds themselves are in `lanes_cli.limits`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.cli import LANES

from lanes_cli.cli import main
from lanes_cli.limits import MAX_HOSTS, MAX_IMPORT_BYTES, MAX_YAML_DEPTH
from lanes_contract.client import connect_nats
from lanes_contract.streams import provision_streams
from lanes_sandbox.embedded import EmbeddedNats

pytestmark = pytest.mark.real_servers
EXIT_BAD_INPUT, EXIT_NOT_FOUND, EXIT_SERVER = 2, 3, 4
UNREACHABLE_DATABASE = "postgresql://127.0.0.1:9/none"
LONG_ID = "x" * 10_000

ALIAS_BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9) if previous else ', '.join(['lol'] * 9)}]\n"
    for previous, name in zip([None, *"abcdefgh"], "abcdefghi", strict=True)
)
DEEP_YAML = "a: " + "[" * 5_000 + "]" * 5_000 + "\n"
DEEP_JSON = '{"a": ' + "[" * 5_000 + "]" * 5_000 + "}"

FILES: dict[str, str | bytes] = {
    "hosts.conf": "SwitchName=s0 Nodes=gpu[1-200000]\n",
    "padded.conf": "SwitchName=s0 Nodes=gpu[001-99999999]\n",
    "digits.conf": f"SwitchName=s0 Nodes=gpu[1-{'9' * 5_000}]\n",
    "switches.conf": "SwitchName=s0 Nodes=gpu1\nSwitchName=top Switches=s[0-70000]\n",
    "many-lines.conf": "".join(f"SwitchName=s{i} Nodes=n{i}-[1-{MAX_HOSTS // 4}]\n" for i in range(5)),
    "bomb.yaml": ALIAS_BOMB,
    "deep.yaml": DEEP_YAML,
    "deep.json": DEEP_JSON,
    "binary.conf": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe",
    "bell.yaml": "nodes: []\npolicy: \x07\n",
    "plan.yaml": "drills: " + "[" * 5_000 + "]" * 5_000 + "\n",
    "not-utf8.yaml": b"name: \xff\xfe\n",
    "events.ndjson": '{"specversion": "1.0"}\n',
    "one.conf": "SwitchName=s0 Nodes=gpu1\n",
}


@dataclass(frozen=True)
class Case:
    """A command line, the exit code it must give, and what its one line must say."""

    args: list[str]
    code: int
    says: str
    env: Mapping[str, str] = field(default_factory=dict)
    must_not_exist: tuple[str, ...] = ()


CASES: dict[str, Case] = {
    # Unbounded memory from tiny inputs: refused by counting, before anything is built.
    "topology hostlist of 200,000 hosts": Case(
        ["topology", "import", "--format", "slurm", "hosts.conf"], EXIT_BAD_INPUT, f"limit of {MAX_HOSTS}"
    ),
    "topology hostlist of 99,999,999 padded hosts": Case(
        ["topology", "import", "--format", "slurm", "padded.conf"], EXIT_BAD_INPUT, f"limit of {MAX_HOSTS}"
    ),
    "topology hostlist with a 5,000-digit number": Case(
        ["topology", "import", "--format", "slurm", "digits.conf"], EXIT_BAD_INPUT, "limit of 9 digits"
    ),
    "topology hostlist of 70,000 switches": Case(
        ["topology", "import", "--format", "slurm", "switches.conf"], EXIT_BAD_INPUT, f"limit of {MAX_HOSTS}"
    ),
    "topology hostlists under the bound each, over it together": Case(
        ["topology", "import", "--format", "slurm", "many-lines.conf"], EXIT_BAD_INPUT, f"limit of {MAX_HOSTS}"
    ),
    "topology YAML alias bomb": Case(
        ["topology", "import", "--format", "lanes", "bomb.yaml"], EXIT_BAD_INPUT, "aliases"
    ),
    "submit YAML alias bomb": Case(["submit", "bomb.yaml"], EXIT_BAD_INPUT, "aliases"),
    "run with 100,000,000 ranks": Case(
        ["run", "--job", "x", "--ranks", "0-99999999", "--", "true"], EXIT_BAD_INPUT, "limit of 65536"
    ),
    "run with a rank beyond the bound": Case(
        ["run", "--job", "x", "--ranks", "65536", "--", "true"], EXIT_BAD_INPUT, "limit of 65536"
    ),
    "run with a world of 100,000,000": Case(
        ["run", "--job", "x", "--world-size", "99999999", "--", "true"], EXIT_BAD_INPUT, "65536"
    ),
    "run with srun's 100,000,000 tasks": Case(
        ["run", "--job", "x", "--", "srun", "-n", "99999999", "true"], EXIT_BAD_INPUT, "limit of 65536"
    ),
    "import of an endless device": Case(["import", "/dev/zero"], EXIT_BAD_INPUT, f"limit of {MAX_IMPORT_BYTES >> 20}"),
    "submit of an endless device": Case(["submit", "/dev/zero"], EXIT_BAD_INPUT, "not a regular file"),
    # Tracebacks before: deep nesting, binary files, numbers out of range, missing tools, unwritable paths.
    "submit 5,000-deep YAML": Case(["submit", "deep.yaml"], EXIT_BAD_INPUT, f"limit of {MAX_YAML_DEPTH} levels"),
    "submit 5,000-deep JSON": Case(["submit", "deep.json"], EXIT_BAD_INPUT, f"limit of {MAX_YAML_DEPTH} levels"),
    "topology 5,000-deep YAML": Case(
        ["topology", "import", "--format", "lanes", "deep.yaml"], EXIT_BAD_INPUT, f"limit of {MAX_YAML_DEPTH} levels"
    ),
    "topology 5,000-deep JSON with labels": Case(
        ["topology", "import", "--format", "labels", "deep.json"], EXIT_BAD_INPUT, f"limit of {MAX_YAML_DEPTH} levels"
    ),
    "drill plan 5,000 deep": Case(["drill", "--plan", "plan.yaml"], EXIT_BAD_INPUT, f"limit of {MAX_YAML_DEPTH}"),
    "topology binary file": Case(["topology", "import", "--format", "slurm", "binary.conf"], EXIT_BAD_INPUT, "binary"),
    "topology control character": Case(
        ["topology", "import", "--format", "lanes", "bell.yaml"], EXIT_BAD_INPUT, "not valid YAML"
    ),
    "submit invalid UTF-8": Case(["submit", "not-utf8.yaml"], EXIT_BAD_INPUT, "not a text file"),
    "analyze offset 99 hours": Case(["analyze", "--utc-offset", "99", "x.log"], EXIT_BAD_INPUT, "limit of 14 hours"),
    "analyze offset nan": Case(["analyze", "--utc-offset", "nan", "x.log"], EXIT_BAD_INPUT, "limit of 14 hours"),
    "analyze offset inf": Case(["analyze", "--utc-offset", "inf", "x.log"], EXIT_BAD_INPUT, "limit of 14 hours"),
    "analyze year 99999": Case(["analyze", "--year", "99999", "x.log"], EXIT_BAD_INPUT, "9998"),
    "replay from 1e30": Case(["replay", "--from-seq", "1e30"], EXIT_BAD_INPUT, "--from-seq"),
    "replay past 64 bits": Case(["replay", "--from-seq", str(2**64)], EXIT_BAD_INPUT, str(2**64 - 1)),
    "audit key not hex": Case(["audit", "verify", "--public-key", "zz"], EXIT_BAD_INPUT, "Ed25519"),
    "audit key too short": Case(["audit", "verify", "--public-key", "00ff"], EXIT_BAD_INPUT, "64 hex digits"),
    "run a wildcard job": Case(["run", "--job", "a*", "--", "true"], EXIT_BAD_INPUT, "no wildcards"),
    "slurm watch without squeue": Case(
        ["slurm", "watch", "--once", "--outbox", "slurm.ndjson"], EXIT_BAD_INPUT, "squeue is not on PATH"
    ),
    "run into /dev/full": Case(["run", "--job", "x", "--outbox", "/dev/full", "--", "true"], EXIT_BAD_INPUT, "space"),
    "timeline html into a missing directory": Case(
        ["timeline", "x", "--html", "missing/x.html"], EXIT_BAD_INPUT, "does not exist"
    ),
    "incident into /dev/null": Case(["incident", "x", "--out", "/dev/null"], EXIT_BAD_INPUT, "not a directory"),
    "asyncapi into /proc": Case(["asyncapi", "--dir", "/proc/x"], EXIT_BAD_INPUT, "cannot write /proc/x"),
    # Silently wrong before.
    "topology state of an unknown node": Case(
        ["topology", "state", "no-such-node", "ready"], EXIT_NOT_FOUND, "unknown node"
    ),
    "drill an unknown job": Case(["drill", "no-such-job", "--kind", "kill"], EXIT_NOT_FOUND, "unknown job"),
    "replay an unknown stream": Case(["replay", "--stream", "NOPE"], EXIT_BAD_INPUT, "no such stream"),
    "replay a backwards range": Case(["replay", "--from-seq", "10", "--to-seq", "5"], EXIT_BAD_INPUT, "after --to-seq"),
    "replay backwards times": Case(
        ["replay", "--since", "2026-12-07T10:00:00", "--until", "2026-12-07T09:00:00"], EXIT_BAD_INPUT, "after --until"
    ),
    "run a backwards rank range": Case(
        ["run", "--job", "x", "--ranks", "5-1", "--", "true"], EXIT_BAD_INPUT, "backwards"
    ),
    "run a command that does not exist": Case(
        ["run", "--job", "x", "--ranks", "0-3", "--", "/nonexistent/bin"], 127, "nothing was reported"
    ),
    "an unreachable NATS": Case(
        ["timeline", "x"], EXIT_SERVER, "cannot reach NATS", env={"NATS_URL": "nats://127.0.0.1:9"}
    ),
    # And more of the same kind.
    "an endless keyring": Case(["audit", "verify", "--keyring", "/dev/zero"], EXIT_BAD_INPUT, "not a regular file"),
    "a 5,000-deep keyring": Case(["audit", "verify", "--keyring", "deep.json"], EXIT_BAD_INPUT, "limit of 64 levels"),
    "topology with negative GPUs": Case(
        ["topology", "import", "--format", "slurm", "one.conf", "--gpus", "-1"], EXIT_BAD_INPUT, "gpus"
    ),
    "topology with a pool that is no id": Case(
        ["topology", "import", "--format", "slurm", "one.conf", "--pool", "a b"], EXIT_BAD_INPUT, "pool"
    ),
    "an attempt of 2**70 to run": Case(
        ["run", "--job", "x", "--attempt", str(2**70), "--", "true"], EXIT_BAD_INPUT, "10000"
    ),
    "an attempt of 2**70 to retry": Case(["retry", "x", "--attempt", str(2**70)], EXIT_BAD_INPUT, "10000"),
    "a rank of 2**70 to drill": Case(["drill", "x", "--kind", "kill", "--rank", str(2**70)], EXIT_BAD_INPUT, "65535"),
    "100,000 local nodes": Case(["up", "--nodes", "100000"], EXIT_BAD_INPUT, "256"),
    "a 10,000-character replica": Case(["route", "drain", LONG_ID], EXIT_BAD_INPUT, "must be 1-128"),
    "poc of a wildcard job": Case(["poc", "--job", "a*"], EXIT_BAD_INPUT, "no wildcards"),
    "poc of an empty window": Case(
        ["poc", "--since", "2026-12-07", "--until", "2026-12-01"], EXIT_BAD_INPUT, "after --until"
    ),
    "an endless heartbeat": Case(["agent", "--node", "n1", "--heartbeat", "inf"], EXIT_BAD_INPUT, "86400"),
    "a drill that waits forever": Case(["drill", "x", "--kind", "kill", "--timeout", "1e400"], EXIT_BAD_INPUT, "86400"),
    "a slurm poll every nan seconds": Case(["slurm", "watch", "--interval", "nan"], EXIT_BAD_INPUT, "--interval"),
    "a 10,000-character job id": Case(["timeline", LONG_ID], EXIT_BAD_INPUT, "no wildcards"),
    "a 10,000-character node": Case(["topology", "state", LONG_ID, "ready"], EXIT_BAD_INPUT, "must be 1-128"),
    "a wildcard job to the timeline": Case(["timeline", "a.>"], EXIT_BAD_INPUT, "no wildcards"),
    "nvidia-smi without --node": Case(
        ["topology", "import", "--format", "nvidia-smi", "bell.yaml"], EXIT_BAD_INPUT, "--node"
    ),
    "an unknown topology format": Case(["topology", "import", "--format", "xml", "bell.yaml"], EXIT_BAD_INPUT, "xml"),
    "a pace of x0": Case(["replay", "--pace", "x0"], EXIT_BAD_INPUT, "--pace"),
    "import of a directory": Case(["import", "."], EXIT_BAD_INPUT, "cannot read"),
    "import of an invalid event": Case(["import", "events.ndjson"], EXIT_BAD_INPUT, "events.ndjson:1"),
    "an unknown command": Case(["nonsense"], EXIT_BAD_INPUT, "No such command"),
    "a missing argument": Case(["submit"], EXIT_BAD_INPUT, "Missing argument"),
    "an unknown option": Case(["submit", "--bogus", "x"], EXIT_BAD_INPUT, "--bogus"),
}

IN_A_PROCESS = (
    "a 10,000-character job id",
    "topology hostlist of 200,000 hosts",
    "submit 5,000-deep YAML",
    "replay from 1e30",
    "topology state of an unknown node",
    "an unreachable NATS",
)
"""Cases also run as the installed `lanes` script, its stderr a pipe: what a user's script sees."""


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A NATS server of this module's own, with the Lanes streams and nothing in them."""
    with EmbeddedNats() as nats:

        async def provision() -> None:
            nc = await connect_nats(nats.url, name="hostile-inputs")
            try:
                await provision_streams(nc.jetstream())
            finally:
                await nc.close()

        asyncio.run(provision())
        yield nats.url


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name, content in FILES.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    (tmp_path / "x.log").write_text("2026-12-07T10:00:00Z worker started\n")
    (tmp_path / "empty-path").mkdir()
    (tmp_path / "outbox").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def stored_messages(url: str) -> int:
    async def total() -> int:
        nc = await connect_nats(url, name="hostile-inputs-count")
        try:
            return sum([info.state.messages for info in await nc.jetstream().streams_info()])
        finally:
            await nc.close()

    return asyncio.run(total())


def environment(nats_url: str, workdir: Path, case: Case) -> dict[str, str]:
    return {
        "NATS_URL": nats_url,
        "DATABASE_URL": UNREACHABLE_DATABASE,
        "LANES_LOG_FORMAT": "json",
        "LANES_OUTBOX_DIR": str(workdir / "outbox"),
        # Only this directory's commands: no squeue, whatever the machine has; `true` and `srun` never run.
        "PATH": f"{workdir / 'empty-path'}:/usr/bin:/bin" if "slurm" not in case.args else str(workdir / "empty-path"),
        **case.env,
    }


def in_this_process(
    args: list[str], env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """`lanes ARGS` through the script's own entry point, in a worker thread (its event loop, no signal handlers)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capfd.readouterr()

    def run() -> int:
        try:
            main(args)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        return 0

    with ThreadPoolExecutor(max_workers=1) as worker:
        code = worker.submit(run).result()
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def as_a_process(args: list[str], env: Mapping[str, str]) -> tuple[int, str, str]:
    """`lanes ARGS` as the installed script, stdin closed, stderr a pipe (not a terminal)."""
    done = subprocess.run(
        [LANES, *args],
        env=os.environ | dict(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def files_in(directory: Path) -> set[Path]:
    return set(directory.rglob("*"))


def check(case: Case, code: int, stdout: str, stderr: str, *, before: set[Path], after: set[Path]) -> None:
    assert code == case.code, stderr
    assert stdout == "", stdout[:2000]
    lines = stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines[0]
    assert case.says in lines[0], lines[0]
    assert after == before, f"written: {sorted(map(str, after - before))}"


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_gets_one_line_the_right_exit_and_changes_nothing(
    name: str, nats_url: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    case = CASES[name]
    stored = stored_messages(nats_url)
    before = files_in(workdir)
    code, stdout, stderr = in_this_process(case.args, environment(nats_url, workdir, case), monkeypatch, capfd)
    check(case, code, stdout, stderr, before=before, after=files_in(workdir))
    assert stored_messages(nats_url) == stored


@pytest.mark.slow
@pytest.mark.parametrize("name", IN_A_PROCESS)
def test_the_installed_script_gives_the_same_one_line_to_a_pipe(name: str, nats_url: str, workdir: Path) -> None:
    case = CASES[name]
    stored = stored_messages(nats_url)
    before = files_in(workdir)
    code, stdout, stderr = as_a_process(case.args, environment(nats_url, workdir, case))
    check(case, code, stdout, stderr, before=before, after=files_in(workdir))
    assert stored_messages(nats_url) == stored


def test_a_known_node_still_changes_state(
    nats_url: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The unknown-node refusal does not refuse a node Lanes knows (the other side of the same check)."""
    conf = workdir / "one.conf"
    conf.write_text("SwitchName=s0 Nodes=hostile-known-1\n")
    env = environment(nats_url, workdir, Case([], 0, ""))
    imported, _, stderr = in_this_process(
        ["topology", "import", "--format", "slurm", str(conf), "--gpus", "8"], env, monkeypatch, capfd
    )
    assert imported == 0, stderr
    stored = stored_messages(nats_url)
    changed, _, stderr = in_this_process(
        ["topology", "state", "hostile-known-1", "cordoned", "--reason", "test"], env, monkeypatch, capfd
    )
    assert changed == 0, stderr
    assert stored_messages(nats_url) == stored + 1
