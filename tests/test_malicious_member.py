"""A token holder that lies to the coordinator (issue 26, the control plane), over real gRPC: only the
current holder of a stage uploads its checkpoints, of steps the ledger knows, no larger than such a
checkpoint is, and only files that fit the stage are stored (finding 3); only the loss stage's holder
reports losses, within the run, as numbers (finding 5)."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from safetensors.torch import save

from tahnode.coordinator.state import NodeStatus
from tahnode.net.freshness import COORDINATOR
from tahnode.pipeline.checkpoint import DIGEST_KEY, digest, read_verified
from tahnode.proto import tahnode_pb2 as pb
from servers import NODE, Servers
from test_replay import RPCS, send


@pytest.fixture
def servers(tmp_path):
    s = Servers(tmp_path)
    yield s
    s.stop()


def chunks(servers: Servers, data: bytes, step: int, node: str = NODE, stage: int = 0, size: int = 1 << 20) -> list[bytes]:
    sealer = servers.sealer(node)
    pieces = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
    n = servers.run_cfg.stages
    return [sealer.seal(pb.CheckpointChunk(node_id=node, stage=stage, num_stages=n, step=step, data=d, last=k == len(pieces) - 1),
                        COORDINATOR).SerializeToString() for k, d in enumerate(pieces)]


def upload(servers: Servers, data: bytes, step: int, **kwargs) -> grpc.StatusCode | None:
    try:
        send(servers, RPCS["UploadCheckpoint"], chunks(servers, data, step, **kwargs))
    except grpc.RpcError as exc:
        return exc.code()
    return None


def stored(servers: Servers) -> list[int]:
    return [c.step for c in servers.registry.store.list(0, servers.run_cfg.stages)]


def sound(servers: Servers) -> bytes:
    return servers.checkpoint.read_bytes()


def test_the_holder_uploads_a_sound_checkpoint(servers):
    assert upload(servers, sound(servers), step=7) is None and stored(servers) == [7]


@pytest.mark.parametrize("status", [NodeStatus.LEFT, NodeStatus.FAILED, NodeStatus.BANNED])
def test_a_former_holder_may_not_upload(servers, status):
    servers.registry.nodes[NODE].status = status  # it held stage 0; a standby may hold it now
    assert upload(servers, sound(servers), step=7) == grpc.StatusCode.INVALID_ARGUMENT
    assert stored(servers) == []


@pytest.mark.parametrize("step", [10**15, 101, 0])
def test_a_step_outside_the_run_or_the_ledger_is_refused(servers, step):
    """A step of 10^15 pruned every real copy (keep = 3) and new holders resumed from it."""
    assert upload(servers, sound(servers), step=7) is None
    assert upload(servers, sound(servers), step=step) == grpc.StatusCode.INVALID_ARGUMENT
    assert stored(servers) == [7]


def test_a_file_with_a_right_checksum_that_does_not_fit_the_stage_is_not_stored(servers):
    tensors, meta = read_verified(servers.checkpoint)
    name = next(k for k in tensors if k.startswith("model/") and tensors[k].dim() == 2)
    tensors[name] = torch.zeros(2, 2)
    meta[DIGEST_KEY] = digest(tensors, meta)
    assert upload(servers, save(tensors, metadata=meta), step=7) == grpc.StatusCode.DATA_LOSS
    assert stored(servers) == [] and not list(servers.registry.store.dir.glob("*.part"))


def test_an_upload_larger_than_a_checkpoint_of_the_stage_is_cut_off(servers):
    huge = bytes(200 << 20)  # far beyond a llama-tiny stage (about 6 MB with its optimizer)
    assert upload(servers, huge, step=7) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stored(servers) == [] and not list(servers.registry.store.dir.glob("*.part"))


def heartbeat(servers: Servers, node: str, points: list[pb.LossPoint]) -> None:
    msg = servers.sealer(node).seal(pb.HeartbeatRequest(node_id=node, stats=pb.TrainingStats(losses=points)), COORDINATOR)
    send(servers, RPCS["Heartbeat"], [msg.SerializeToString()])


def test_only_the_loss_stage_holder_reports_losses_and_only_numbers(servers):
    """A standby (or any live node) sent LossPoint(step=0), and the durable ledger went from 50
    steps to 1; NaN losses were stored."""
    reg = servers.registry
    for name, stage in (("n-last", reg.run.loss_stage), ("standby", -1)):
        reg.join(servers.sealer(name, run="").seal(pb.JoinRequest(node_id=name, address="127.0.0.1:5", stage=stage), COORDINATOR))
    heartbeat(servers, "n-last", [pb.LossPoint(step=k, loss=5.0 - k / 50, sample_ids=[k]) for k in range(50)])
    assert sorted(reg.ledger()) == list(range(50))
    heartbeat(servers, "standby", [pb.LossPoint(step=0, loss=9.0, sample_ids=[1])])
    heartbeat(servers, NODE, [pb.LossPoint(step=0, loss=9.0, sample_ids=[1])])  # stage 0 computes no loss here
    assert sorted(reg.ledger()) == list(range(50)) and reg.ledger()[0].loss == 5.0
    heartbeat(servers, "n-last", [pb.LossPoint(step=50, loss=math.nan), pb.LossPoint(step=10**9, loss=1.0),
                                  pb.LossPoint(step=50, loss=math.inf)])
    assert sorted(reg.ledger()) == list(range(50))
    assert all(math.isfinite(p.loss) for p in reg.ledger().values())
