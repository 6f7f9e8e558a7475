"""The lines a rank prints that the launcher turns into events: listening, steps, checkpoints."""

from __future__ import annotations

import pytest

from lanes_agent.rank_output import READY_MARKER, communicator_ready, listening_endpoint
from lanes_contract.events import CheckpointSavedData, HeartbeatData, StepTiming
from lanes_contract.events.progress import MAX_TIMINGS
from lanes_evidence.progress_lines import TIMINGS_EVERY_S, TimingBatch, progress_report

DIGEST = "sha256:" + "ab" * 32


def test_the_listening_line_of_an_openai_compatible_server_gives_its_endpoint() -> None:
    line = "INFO:     Uvicorn running on http://127.0.0.1:43121 (Press CTRL+C to quit)\n"
    assert listening_endpoint(line) == "http://127.0.0.1:43121"
    # A server bound to every interface is reached on loopback by the local launcher.
    assert listening_endpoint("INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)") == (
        "http://127.0.0.1:8000"
    )
    assert listening_endpoint("INFO: Started server process [77]") is None


def test_a_server_on_every_interface_of_a_node_in_its_own_namespace_is_announced_at_the_node_address() -> None:
    # The router, in the host's namespace, reaches it across the bridge; loopback would be the node's own.
    line = "INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)"
    assert listening_endpoint(line, "10.77.0.3") == "http://10.77.0.3:8000"
    # A server that names its address is announced as it says.
    assert listening_endpoint("INFO:     Uvicorn running on http://10.77.0.4:9000", "10.77.0.3") == (
        "http://10.77.0.4:9000"
    )


def test_step_and_checkpoint_lines_become_heartbeat_and_checkpoint_data() -> None:
    assert progress_report("lanes: step 120\n") == HeartbeatData(step=120)
    saved = progress_report(f"lanes: checkpoint saved step=100 path=/ckpt/100.pt digest={DIGEST} image=trainer:3\n")
    assert saved == CheckpointSavedData(step=100, path="/ckpt/100.pt", digest=DIGEST, image="trainer:3")
    assert progress_report("epoch 3 loss 0.12") is None


def test_a_timed_step_line_carries_its_compute_and_wait_and_a_malformed_one_is_plain_output() -> None:
    timed = progress_report("lanes: step 7 compute_s=0.912000 wait_s=0.133500\n")
    assert timed == HeartbeatData(step=7, timings=(StepTiming(step=7, compute_s=0.912, wait_s=0.1335),))
    assert progress_report("lanes: step 7 compute_s=-1 wait_s=0.1") is None  # not the hook's line: output
    assert progress_report("lanes: step 7 compute_s=1e400 wait_s=0.1") is None


def _timed(step: int) -> HeartbeatData:
    return HeartbeatData(step=step, timings=(StepTiming(step=step, compute_s=1.0, wait_s=0.2),))


def test_step_timings_travel_in_one_heartbeat_a_second_and_what_is_left_when_the_output_ends() -> None:
    batch = TimingBatch(now=100.0)
    assert batch.add(HeartbeatData(step=3), now=100.0) == HeartbeatData(step=3)  # untimed: sent as it is
    assert [batch.add(_timed(step), now=100.0 + step / 10) for step in range(1, 10)] == [None] * 9
    sent = batch.add(_timed(10), now=100.0 + TIMINGS_EVERY_S)
    assert sent is not None
    assert (sent.step, [t.step for t in sent.timings]) == (10, list(range(1, 11)))
    assert batch.add(_timed(11), now=101.5) is None
    rest = batch.rest()
    assert rest is not None
    assert [t.step for t in rest.timings] == [11]
    assert batch.rest() is None


def test_a_full_batch_of_timings_goes_at_once_and_never_beyond_the_events_bound() -> None:
    batch = TimingBatch(now=0.0)
    sent = [beat for step in range(MAX_TIMINGS + 5) if (beat := batch.add(_timed(step), now=0.0))]
    assert [len(beat.timings) for beat in sent] == [MAX_TIMINGS]
    rest = batch.rest()
    assert rest is not None
    assert len(rest.timings) == 5


def test_a_malformed_checkpoint_line_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="unknown checkpoint field"):
        progress_report(f"lanes: checkpoint saved step=1 path=/c digest={DIGEST} colour=blue")
    with pytest.raises(ValueError, match="digest"):
        progress_report("lanes: checkpoint saved step=1 path=/c digest=nope")


def test_readiness_is_read_from_nccls_own_init_line_as_well_as_lanes_marker() -> None:
    # NCCL_DEBUG=INFO output of an unmodified workload: host:pid:tid [device] NCCL INFO comm ... Init COMPLETE
    nccl = (
        "gpu-07:48211:48390 [3] NCCL INFO comm 0x55d2c1a0f2e0 rank 27 nranks 64 cudaDev 3 nvmlDev 3 "
        "busId 4f000 commId 0x9c1e7b2a44f0d3e1 - Init COMPLETE\n"
    )
    assert communicator_ready(nccl) == "nccl"
    assert communicator_ready(f"{READY_MARKER}\n") == ""
    assert communicator_ready("gpu-07:48211:48390 [3] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0") is None
    assert communicator_ready("epoch 1 step 20 loss 2.31") is None
