"""The coordinator as users start it: bad requests get clear gRPC errors and change nothing, and
its status page, loaded in headless Chromium, shows the real swarm's nodes and links."""

from __future__ import annotations

import grpc
import pytest
from swarm import Swarm
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.proto import tahnode_pb2 as pb
from tahnode.proto import tahnode_pb2_grpc as pb_grpc
from test_status_page import DomIndex, chromium, run_chromium  # noqa: F401  (chromium is a fixture)

pytestmark = pytest.mark.slow
SMALL = ["--micro-batches", "2", "--batch-size", "2", "--seq-len", "32"]


@pytest.fixture
def swarm(tmp_path, tmp_path_factory):
    s = Swarm(tmp_path, cache=tmp_path_factory.getbasetemp() / "cache")
    yield s
    s.stop()


def nodes_of(state: dict) -> list:
    return sorted((n["id"], n["stage"], n["status"]) for n in state["nodes"])


def test_bad_requests_are_refused_and_change_nothing(swarm):
    swarm.start_coordinator("--steps", "5", "--stages", "3")
    swarm.wait_for(lambda s: True, 60, "the coordinator")
    key = SwarmKey(swarm.token)

    run = swarm.state()["run"]

    identities: dict[str, NodeKey] = {}

    def sealed(msg, key=key):  # sealed and signed by the node the request speaks for
        return Sealer(key, msg.node_id, run,
                      identities.setdefault(msg.node_id, NodeKey.generate())).seal(msg, COORDINATOR)

    with grpc.insecure_channel(swarm.coordinator) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        joined = sealed(pb.JoinRequest(node_id="good", address="127.0.0.1:1", stage=1, device="cpu"))
        assert stub.Join(joined, timeout=5).run == run
        # the status documents come from a snapshot made once a second
        before = swarm.wait_for(lambda s: nodes_of(s) == [("good", 1, "active")], 10, "the join on the status page")

        def refused(call, request, code, text):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=5)
            assert err.value.code() == code, err.value.details()
            assert text in err.value.details()

        refused(stub.Join, sealed(pb.JoinRequest(node_id="evil", address="127.0.0.1:2", stage=0), SwarmKey("guess")),
                grpc.StatusCode.UNAUTHENTICATED, "wrong swarm token")
        refused(stub.Join, pb.JoinRequest(node_id="nomac", address="127.0.0.1:2", stage=0),
                grpc.StatusCode.UNAUTHENTICATED, "wrong swarm token")
        refused(stub.Join, joined, grpc.StatusCode.PERMISSION_DENIED, "replayed")  # the same join again, recorded
        refused(stub.Heartbeat, sealed(pb.HeartbeatRequest(node_id="ghost")), grpc.StatusCode.NOT_FOUND,
                "unknown node 'ghost'")
        refused(stub.Join, sealed(pb.JoinRequest(node_id="x", address="127.0.0.1:3", stage=7)),
                grpc.StatusCode.INVALID_ARGUMENT, "stage 7 does not exist")
        refused(stub.Join, sealed(pb.JoinRequest(node_id="", address="127.0.0.1:3", stage=0)),
                grpc.StatusCode.INVALID_ARGUMENT, "needs a node id")
        refused(stub.Join, sealed(pb.JoinRequest(node_id="other", address="127.0.0.1:4", stage=1)),
                grpc.StatusCode.FAILED_PRECONDITION, "stage 1 is held by node good")
        refused(stub.Leave, sealed(pb.LeaveRequest(node_id="ghost")), grpc.StatusCode.NOT_FOUND, "unknown node")
        garbage = ch.unary_unary("/tahnode.v1.Coordinator/Join", request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            garbage(b"\xff\xff\xff\xff", timeout=5)
        assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN)

    def refusals(state: dict) -> dict:
        return {(r["receiver"], r["reason"]): r["count"] for r in state["refused"]}

    expected = {("coordinator", "bad_mac"): 2, ("coordinator", "replayed"): 1}
    after = swarm.wait_for(lambda s: refusals(s) == expected, 10, "the refusals on the status page")
    assert nodes_of(after) == nodes_of(before) == [("good", 1, "active")]
    assert after["epoch"] == before["epoch"]
    metrics = swarm.metrics()
    assert 'tahnode_refused_messages{reason="replayed",receiver="coordinator"} 1.0' in metrics


def test_status_page_in_chromium_shows_the_live_swarm(swarm, chromium, tmp_path):  # noqa: F811
    swarm.start_coordinator("--steps", "400", *SMALL)
    for k in range(3):
        swarm.join(f"node{k}", k, "--quiet")
    state = swarm.wait_for(lambda s: s["training"]["step"] >= 5 and len(s["links"]) >= 4, 120, "training with traffic")
    base = f"http://127.0.0.1:{swarm.http_port}"
    dom = run_chromium(chromium, tmp_path, "--dump-dom", base + "/").stdout
    shot = tmp_path / "status.png"
    run_chromium(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1280,900", base + "/")
    (tmp_path / "dom.html").write_text(dom)
    index = DomIndex()
    index.feed(dom)
    assert {"node0", "node1", "node2"} <= set(index.nodes)
    for k in range(3):
        assert index.nodes[f"node{k}"]["stage"] == str(k)
    shown = {pair: float(row["mbps"]) for pair, row in index.links.items()}
    assert ("node0", "node1") in shown and ("node1", "node0") in shown
    assert all(v > 0 for v in shown.values()), shown
    assert int(index.by_id["step"].replace(",", "")) >= state["training"]["step"]
    assert shot.exists() and shot.stat().st_size > 20_000
    metrics = swarm_metrics(swarm)
    assert 'tahnode_node_stage{node="node1"} 1.0' in metrics
    assert 'tahnode_nodes{status="active"} 3.0' in metrics
    assert 'tahnode_link_mbps{dst="node1",src="node0"}' in metrics


def swarm_metrics(swarm) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{swarm.http_port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_a_coordinator_killed_and_restarted_keeps_the_ledger(swarm):
    """kill -9 of the coordinator mid-run, then a restart on the same store: the nodes go on
    training, rejoin, and report what they trained meanwhile; the ledger ends with every step
    exactly once, the steps from before the crash included (it lives in SQLite)."""
    steps = 150
    swarm.start_coordinator("--steps", str(steps), *SMALL)
    for k in range(3):
        swarm.join(f"n{k}", k, "--quiet")
    before = swarm.wait_for(lambda s: s["training"]["step"] >= 8, 120, "step 8")
    swarm.procs["coordinator"].kill()
    swarm.procs["coordinator"].wait(10)
    swarm.start_coordinator("--steps", str(steps), *SMALL)
    swarm.wait_for(lambda s: True, 60, "the restarted coordinator")
    final = swarm.wait_finished(steps)
    ledger = swarm.ledger()["steps"]
    assert [p["step"] for p in ledger] == list(range(steps))
    assert len(before["loss_history"]) >= 8 and final["run"] == before["run"]
    samples = [i for p in ledger for i in p["sample_ids"]]
    assert len(samples) == len(set(samples))  # no sample trained twice within this short run
    assert final["epoch"] > before["epoch"]
    assert "restarted: the ledger holds steps" in swarm.log("coordinator")


def test_sigterm_stops_the_coordinator_in_the_middle_of_a_probe_round(swarm):
    """Probes between `--stage auto` nodes on slow links take a long time (here each pair more
    than 20 s at 200 kbit/s); SIGTERM cancels the round instead of waiting for it (it was ignored
    for as long as the round lasted)."""
    import signal
    import time

    swarm.start_coordinator("--steps", "5", "--stages", "2", *SMALL)
    for k in range(2):
        swarm.join(f"n{k}", "auto", "--quiet", "--emulate-rate", "200kbit")
    swarm.wait_for(lambda s: len(s["nodes"]) == 2, 120, "two nodes")
    time.sleep(6)  # past the 3 s settle time: the first probe (512 KiB at 200 kbit/s) is under way
    assert swarm.state()["training"]["step"] == 0 and not any(n["status"] == "active" for n in swarm.state()["nodes"])
    coordinator = swarm.procs["coordinator"]
    coordinator.send_signal(signal.SIGTERM)
    assert coordinator.wait(10) == 0  # one probe alone would have lasted 20 s more
    assert "coordinator stopped" in swarm.log("coordinator")
