"""Router overhead: latency it adds over calling the replica directly at 1,000 requests/s, and its top rate.

Separate processes, as in production: a toy OpenAI-compatible replica, one router (`python -m lanes_router`,
with its registry, Redis leases and JetStream provenance all on) and a load generator (this script with
`--load`). On a 2-core machine the router is pinned to core 0, the replica and the load generator to core 1,
so "one router process on one core" holds and the direct and routed runs share the same replica and
client core.

1. Open loop at `--rate` requests/s (default 1,000): each request is sent at its scheduled time and its
   latency counts from that time (no coordinated omission). Direct and routed, non-streaming and
   streaming (to the end of the stream), in the same run; the added latency is routed minus direct at
   p50 and p99.
2. Closed loop with `--concurrency` clients for `--seconds`: the sustained requests/s of the replica
   directly and through the router; `rps_ratio` is router / direct.

    uv run python bench/router.py [--quick] [--rate 1000]

The last line of stdout is one JSON object. NATS and Redis: NATS_URL / REDIS_URL when set, embedded otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from lanes_contract.client import LanesClient
from lanes_contract.events import (
    JobPlaced,
    JobPlacedData,
    JobSubmitted,
    JobSubmittedData,
    RankAssignment,
    ReplicaListening,
    ReplicaListeningData,
)
from lanes_contract.ids import new_event_id
from lanes_contract.jobs import JobSpec, ProtectionMode, ServingSpec, WorkloadClass
from lanes_contract.streams import provision_streams
from lanes_sandbox.embedded import EmbeddedNats, EmbeddedRedis

MODEL = "bench"
LISTENING = "Uvicorn running on "
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello in sixteen tokens."}], "max_tokens": 16}


# --- load generator (runs in its own process) -------------------------------------------------------------


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, *, stream: bool) -> tuple[bool, float | None]:
    """Send one request; return whether it succeeded and, for a stream, when its first byte arrived."""
    first: float | None = None
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        if stream:
            async for _chunk in response.content.iter_any():
                if first is None:
                    first = time.perf_counter()
        else:
            await response.read()
        return response.status == 200, first  # noqa: PLR2004 - HTTP OK


async def open_loop(base: str, *, rate: float, seconds: float, stream: bool) -> dict[str, Any]:
    """Requests at fixed intervals; latency from each request's scheduled time to its end (and first byte)."""
    url = f"{base}/v1/chat/completions"
    body = json.dumps(BODY | {"stream": stream}).encode()
    latencies: list[float] = []
    firsts: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(50):  # warm the connection pools on both sides
            await _one(session, url, body, stream=stream)

        async def timed(scheduled: float) -> None:
            nonlocal errors
            try:
                ok, first = await _one(session, url, body, stream=stream)
            except aiohttp.ClientError:
                errors += 1
                return
            if not ok:
                errors += 1
                return
            latencies.append((time.perf_counter() - scheduled) * 1000)
            if first is not None:
                firsts.append((first - scheduled) * 1000)

        total = int(rate * seconds)
        start = time.perf_counter() + 0.05
        tasks = []
        for i in range(total):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(timed(scheduled)))
        await asyncio.gather(*tasks)
        achieved = total / (time.perf_counter() - start)
    return {
        "p50_ms": _percentile(latencies, 50),
        "p99_ms": _percentile(latencies, 99),
        "ttfb_p50_ms": _percentile(firsts, 50) if firsts else None,
        "ttfb_p99_ms": _percentile(firsts, 99) if firsts else None,
        "requests": total,
        "errors": errors,
        "achieved_rps": achieved,
    }


async def closed_loop(base: str, *, concurrency: int, seconds: float) -> dict[str, Any]:
    """`concurrency` clients sending back to back; the completed requests per second."""
    url = f"{base}/v1/chat/completions"
    body = json.dumps(BODY).encode()
    done = 0
    errors = 0
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(50):
            await _one(session, url, body, stream=False)
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal done, errors
            while time.perf_counter() < deadline:
                try:
                    ok, _ = await _one(session, url, body, stream=False)
                except aiohttp.ClientError:
                    ok = False
                done += ok
                errors += not ok

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"rps": done / elapsed, "errors": errors}


def _percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def run_load(args: argparse.Namespace) -> None:
    """The `--load` role: one measurement, one JSON line."""
    if args.load == "open":
        result = asyncio.run(open_loop(args.target, rate=args.rate, seconds=args.seconds, stream=args.stream))
    else:
        result = asyncio.run(closed_loop(args.target, concurrency=args.concurrency, seconds=args.seconds))
    print(json.dumps(result))


# --- orchestration --------------------------------------------------------------------------------------


def _progress(message: str) -> None:
    sys.stderr.write(f"bench/router: {message}\n")
    sys.stderr.flush()


def _pin(pid: int, core: int) -> None:
    cores = os.cpu_count() or 1
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(pid, {core % cores})


@contextlib.contextmanager
def _process(command: list[str], env: dict[str, str], core: int, log: Path) -> Iterator[subprocess.Popen[str]]:
    # stderr goes to a file: a pipe nobody reads would block the process once full.
    with log.open("w") as stderr:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    _pin(process.pid, core)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _announced_line(process: subprocess.Popen[str], marker: str, log: Path | None = None) -> str:
    """The first line with `marker` on the process's stdout, or in its stderr log file."""
    if log is None:
        assert process.stdout is not None  # noqa: S101 - piped above
        for line in process.stdout:
            if marker in line:
                return line
    else:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            for line in log.read_text().splitlines():
                if marker in line:
                    return line
            time.sleep(0.05)
    msg = f"the process ended before printing {marker!r}"
    raise RuntimeError(msg)


async def _register_replica(nats_url: str, endpoint: str) -> str:
    job = f"bench-{new_event_id()[-12:]}"
    serving = ServingSpec(
        model=MODEL, version="v1", max_concurrency=4096, protection=ProtectionMode.QUEUE, queue_timeout_s=30
    )
    spec = JobSpec(name=job, workload_class=WorkloadClass.INFERENCE, workers=1, serving=serving)
    async with await LanesClient.connect(nats_url, source="bench") as lanes:
        await provision_streams(lanes.js)
        await lanes.publish(JobSubmitted(source="bench", jobid=job, attempt=1, data=JobSubmittedData(spec=spec)))
        placement = JobPlacedData(assignments=(RankAssignment(rank=0, node="bench-node", gpus=(0,)),))
        await lanes.publish(JobPlaced(source="bench", jobid=job, attempt=1, data=placement))
        listening = ReplicaListeningData(endpoint=endpoint)
        await lanes.publish(ReplicaListening(source="bench", jobid=job, attempt=1, data=listening))
    return job


async def _wait_routable(router_url: str) -> None:
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{router_url}/readyz") as response:
                    if (await response.json()).get("routable", 0) >= 1:
                        return
            await asyncio.sleep(0.1)
    msg = "the router never saw the replica ready"
    raise RuntimeError(msg)


def _measure(env: dict[str, str], core: int, *args: str) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    _pin(process.pid, core)
    output, _ = process.communicate(timeout=600)
    if process.returncode != 0:
        msg = f"load generator failed: {' '.join(args)}"
        raise RuntimeError(msg)
    result: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    return result


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Start replica and router, measure direct and routed, return the report."""
    seconds = 4.0 if args.quick else 15.0
    max_seconds = 3.0 if args.quick else 10.0
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lanes-bench-router-")))
        nats_url = os.environ.get("NATS_URL") or stack.enter_context(EmbeddedNats()).url
        redis_url = os.environ.get("REDIS_URL") or stack.enter_context(EmbeddedRedis()).url
        env = os.environ | {"LANES_LOG_LEVEL": "warning", "LANES_LOG_FORMAT": "json"}
        replica = stack.enter_context(
            _process(
                [
                    sys.executable,
                    "-m",
                    "lanes_sandbox.toy_replica",
                    "--model",
                    MODEL,
                    "--version",
                    "v1",
                    "--tokens",
                    "16",
                ],
                env,
                core=1,
                log=logs / "replica.log",
            )
        )
        endpoint = _announced_line(replica, LISTENING).split(LISTENING, 1)[1].split()[0]
        _progress(f"replica at {endpoint}")
        asyncio.run(_register_replica(nats_url, endpoint))
        router_env = env | {
            "NATS_URL": nats_url,
            "REDIS_URL": redis_url,
            "LANES_ROUTER_PORT": "0",
            "LANES_LOG_LEVEL": "info",
        }
        router_log = logs / "router.log"
        router = stack.enter_context(_process([sys.executable, "-m", "lanes_router"], router_env, 0, router_log))
        router_url = json.loads(_announced_line(router, '"router listening"', router_log))["url"]
        _progress(f"router at {router_url}")
        asyncio.run(_wait_routable(router_url))
        _progress("replica routable")
        report: dict[str, Any] = {"rate": args.rate, "seconds_per_phase": seconds}
        runs: dict[str, dict[str, Any]] = {}
        for stream in (False, True):
            suffix = "_stream" if stream else ""
            for name, target in (("direct", endpoint), ("router", router_url)):
                flags = ["--load", "open", "--target", target, "--rate", str(args.rate), "--seconds", str(seconds)]
                runs[f"{name}{suffix}"] = _measure(env, 1, *flags, *(["--stream"] if stream else []))
                _progress(f"{name}{suffix}: {runs[f'{name}{suffix}']}")
        for name, target in (("direct", endpoint), ("router", router_url)):
            flags = ["--load", "closed", "--target", target, "--concurrency", str(args.concurrency)]
            runs[f"{name}_max"] = _measure(env, 1, *flags, "--seconds", str(max_seconds))
            _progress(f"{name}_max: {runs[f'{name}_max']}")
    for suffix in ("", "_stream"):
        direct, routed = runs[f"direct{suffix}"], runs[f"router{suffix}"]
        report[f"added_p50_ms{suffix}"] = round(routed["p50_ms"] - direct["p50_ms"], 3)
        report[f"added_p99_ms{suffix}"] = round(routed["p99_ms"] - direct["p99_ms"], 3)
    stream_direct, stream_routed = runs["direct_stream"], runs["router_stream"]
    report["added_ttfb_p50_ms_stream"] = round(stream_routed["ttfb_p50_ms"] - stream_direct["ttfb_p50_ms"], 3)
    report["added_ttfb_p99_ms_stream"] = round(stream_routed["ttfb_p99_ms"] - stream_direct["ttfb_p99_ms"], 3)
    report["router_max_rps"] = round(runs["router_max"]["rps"], 1)
    report["direct_max_rps"] = round(runs["direct_max"]["rps"], 1)
    report["rps_ratio"] = round(report["router_max_rps"] / report["direct_max_rps"], 3)
    report["runs"] = runs
    return report


def main() -> None:
    """Parse the options; run the bench or one load-generator measurement."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 s per latency phase, 3 s per rate phase")
    parser.add_argument("--rate", type=float, default=1000.0, help="open-loop requests/s (default 1000)")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients (default 32)")
    parser.add_argument("--load", choices=("open", "closed"), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=5.0, help=argparse.SUPPRESS)
    parser.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        run_load(args)
        return
    print(json.dumps(run_bench(args)))


if __name__ == "__main__":
    main()
