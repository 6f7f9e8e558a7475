"""kubectl reads the test API server (support.k8s_api) as it reads a real one: a check on that server's wire format.

If kubectl understands its discovery, its lists, its chunked watch stream and its 410 Status, the observer's
watch tests run against the protocol a real API server speaks, not one only the observer understands.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support.k8s_api import FakeKubeApi
from support.optional import KUBECTL, require
from support.waiting import eventually

require(KUBECTL)

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"


def stream(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    server = FakeKubeApi()
    await server.start()
    for item in stream("kueue-podsreadytimeout.ndjson")[:4]:  # a workload admitted, two pods
        await server.apply(item["type"], item["object"])
    try:
        yield server
    finally:
        await server.stop()


async def kubectl(api: FakeKubeApi, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    binary = shutil.which("kubectl")
    assert binary is not None
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    proc = await asyncio.create_subprocess_exec(
        binary, "--server", api.url, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_kubectl_discovers_and_lists_workloads_and_pods(api, tmp_path):
    code, out, err = await kubectl(api, tmp_path, "get", "workloads.kueue.x-k8s.io", "-A", "-o", "name")
    assert code == 0, err
    assert out.split() == ["workload.kueue.x-k8s.io/job-train-3f2a1"]
    code, out, err = await kubectl(api, tmp_path, "get", "pods", "-n", "team-a", "-o", "json")
    assert code == 0, err
    listed = json.loads(out)
    assert sorted(p["metadata"]["name"] for p in listed["items"]) == ["train-0-abcde", "train-1-fghij"]


async def test_kubectl_follows_the_chunked_watch_stream(api, tmp_path):
    watching = asyncio.create_task(
        kubectl(api, tmp_path, "get", "pods", "-n", "team-a", "--watch", "-o", "json", "--request-timeout=4s")
    )

    async def watching_now() -> bool:
        return bool(api.watch_requests("pods"))

    await eventually(watching_now, what="kubectl watching")
    evicted = stream("kueue-podsreadytimeout.ndjson")[6]  # train-0 deleted
    version = await api.apply(evicted["type"], evicted["object"])
    code, out, err = await watching
    assert code == 0, err
    decoder = json.JSONDecoder()
    objects, at = [], 0
    while at < len(out.strip()):
        obj, end = decoder.raw_decode(out, at)
        objects.append(obj)
        at = end + (len(out[end:]) - len(out[end:].lstrip()))
    assert [o["metadata"]["resourceVersion"] for o in objects][-1] == str(version)
    assert api.watch_requests("pods")[0]["watch"] in {"1", "true"}


async def test_kubectl_reads_a_410_gone_as_an_expired_resource_version(api, tmp_path):
    old = api.version
    await api.bump()
    api.compact()
    api.faults.gone_as_status = True
    code, _out, err = await kubectl(api, tmp_path, "get", "--raw", f"/api/v1/pods?watch=1&resourceVersion={old - 2}")
    assert code != 0
    assert "too old resource version" in err
