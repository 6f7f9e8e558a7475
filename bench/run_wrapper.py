"""What `lanes run` costs a job: the same command raw and wrapped, same run, medians and their ratio.

The command prints `--lines` lines, one in 50 a line the evidence parsers recognise (a gloo peer error),
the rest plain output. Wrapped, every line is copied through and parsed, and the evidence goes to NATS
(embedded unless NATS_URL is set) or, with `--offline`, to the outbox file. Prints one JSON object.

    uv run python bench/run_wrapper.py [--lines 20000] [--runs 5] [--offline]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lanes_sandbox.embedded import EmbeddedNats

LANES = str(Path(sys.executable).parent / "lanes")
_PROGRAM = """
import sys
write = sys.stdout.write
for i in range({lines}):
    if i % 50 == 0:
        write("[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
              f"Connection closed by peer [10.0.0.{{i % 200}}]:29500\\n")
    else:
        write(f"step {{i}} loss 0.{{i % 997}}\\n")
"""


def _timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def main() -> None:
    """Run the bench and print its JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--offline", action="store_true", help="NATS down: events go to the outbox only.")
    args = parser.parse_args()
    program = [sys.executable, "-c", _PROGRAM.format(lines=args.lines)]
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        if args.offline:
            nats_url = "nats://127.0.0.1:1"
        else:
            nats_url = os.environ.get("NATS_URL") or stack.enter_context(EmbeddedNats()).url
        env = os.environ | {"NATS_URL": nats_url, "LANES_LOG_LEVEL": "error"}
        raw, wrapped = [], []
        for run in range(args.runs):
            raw.append(_timed(program, env))
            outbox = str(Path(tmp) / f"outbox-{run}.ndjson")
            wrapped.append(_timed([LANES, "run", "--job", f"bench-{run}", "--outbox", outbox, "--", *program], env))
    raw_s, wrapped_s = statistics.median(raw), statistics.median(wrapped)
    print(
        json.dumps(
            {
                "bench": "run_wrapper",
                "lines": args.lines,
                "evidence_lines": (args.lines + 49) // 50,
                "offline": args.offline,
                "runs": args.runs,
                "raw_median_s": round(raw_s, 3),
                "wrapped_median_s": round(wrapped_s, 3),
                "ratio": round(wrapped_s / raw_s, 2),
                "overhead_median_s": round(wrapped_s - raw_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
