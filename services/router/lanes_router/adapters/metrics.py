"""The router's Prometheus metrics, kept in plain dicts and rendered as text exposition format.

Labels are bounded: model, version, replica, route, status and outcome; never a request id.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable

PREFIX = "lanes_router_"
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Labels = tuple[tuple[str, str], ...]


class Histogram:
    """Cumulative-bucket histogram per label set."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts: dict[Labels, list[int]] = {}
        self.sums: dict[Labels, float] = defaultdict(float)

    def observe(self, labels: Labels, value: float) -> None:
        """Count one observation."""
        counts = self.counts.get(labels)
        if counts is None:
            counts = self.counts[labels] = [0] * (len(self.buckets) + 1)
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[labels] += value


class RouterMetrics:
    """Counters, gauges and histograms of one router process."""

    def __init__(self) -> None:
        self.requests: dict[Labels, int] = defaultdict(int)
        self.attempts: dict[Labels, int] = defaultdict(int)
        self.transitions: dict[Labels, int] = defaultdict(int)
        self.latency = Histogram(LATENCY_BUCKETS_S)
        self.ttft = Histogram(LATENCY_BUCKETS_S)
        self.in_flight = 0
        self.gauges: dict[str, tuple[str, Callable[[], Iterable[tuple[Labels, float]]]]] = {}

    def request_done(self, model: str, status: str, http_status: int, latency_s: float, ttft_s: float | None) -> None:
        """Count a finished request and its latencies."""
        self.requests[(("model", model), ("status", status), ("code", str(http_status)))] += 1
        self.latency.observe((("model", model),), latency_s)
        if ttft_s is not None:
            self.ttft.observe((("model", model),), ttft_s)

    def attempt_done(self, model: str, replica: str, outcome: str) -> None:
        """Count one try of a request on one replica."""
        self.attempts[(("model", model), ("replica", replica), ("outcome", outcome))] += 1

    def gauge(self, name: str, help_text: str, read: Callable[[], Iterable[tuple[Labels, float]]]) -> None:
        """Register a gauge read at scrape time."""
        self.gauges[name] = (help_text, read)

    def render(self) -> str:
        """The text exposition format."""
        lines: list[str] = []
        _counter(lines, "requests_total", "Client requests by model, status and HTTP code.", self.requests)
        _counter(lines, "attempts_total", "Tries of requests on replicas by outcome.", self.attempts)
        _counter(lines, "replica_transitions_total", "Replica state changes folded.", self.transitions)
        _histogram(lines, "request_duration_seconds", "Request latency, end to end.", self.latency)
        _histogram(lines, "time_to_first_byte_seconds", "Time to the first byte of the answer.", self.ttft)
        lines += [f"# HELP {PREFIX}in_flight Requests being served.", f"# TYPE {PREFIX}in_flight gauge"]
        lines.append(f"{PREFIX}in_flight {self.in_flight}")
        for name, (help_text, read) in self.gauges.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} gauge"]
            lines.extend(f"{PREFIX}{name}{_labels(labels)} {value:g}" for labels, value in read())
        return "\n".join(lines) + "\n"


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _counter(lines: list[str], name: str, help_text: str, values: dict[Labels, int]) -> None:
    lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} counter"]
    lines.extend(f"{PREFIX}{name}{_labels(labels)} {value}" for labels, value in sorted(values.items()))


def _histogram(lines: list[str], name: str, help_text: str, histogram: Histogram) -> None:
    lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} histogram"]
    for labels, counts in sorted(histogram.counts.items()):
        running = 0
        for bound, count in zip((*histogram.buckets, float("inf")), counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f"{PREFIX}{name}_bucket{_labels((*labels, ('le', le)))} {running}")
        lines.append(f"{PREFIX}{name}_sum{_labels(labels)} {histogram.sums[labels]:.6f}")
        lines.append(f"{PREFIX}{name}_count{_labels(labels)} {running}")
