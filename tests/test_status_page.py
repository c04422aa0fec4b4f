"""The coordinator's status endpoints over real HTTP: the /api/v1/state schema, the Prometheus
metrics (the pipelines' too), and the page rendered by headless Chromium (DOM read back, the
pipelines' table among it, screenshot saved)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import struct
import subprocess
import threading
import urllib.error
import urllib.request
from html.parser import HTMLParser

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tahnode.coordinator.status_page import LinkInfo, NodeInfo, SwarmView, TrainingInfo, make_app, start_server

NODES = [
    NodeInfo("node-a", 0, "10.77.0.11:7100", "active", "cpu"),
    NodeInfo("node-b", 1, "10.77.0.12:7100", "active", "cuda:0"),
    NodeInfo("node-d", 2, "10.77.0.14:7100", "active", "cpu"),
    NodeInfo("node-c", -1, "10.77.0.13:7100", "standby", "cpu"),
]
LINKS = [
    LinkInfo("node-a", "node-b", 187.24, 0.41),
    LinkInfo("node-b", "node-a", 192.0, 0.40),
    LinkInfo("node-b", "node-d", 176.5, 0.52),
    LinkInfo("node-d", "node-b", 181.3, None),
    LinkInfo("node-b", "node-c", 19.6, 1.9),
]
P2P_MADDR = "/ip4/10.79.0.1/tcp/7001/p2p/QmTyedzTAa5UGo2wHDCZDpeNT2phPS6dPv6Jhp1P8H5neS"
EVENT_WITH_MARKUP = "12:00:03 odd id </script><img src=x onerror=alert(1)> & more"
PIPELINES = [  # as tahnode.coordinator.view.pipelines writes them: a training pipeline and one with open stages
    {"index": 0, "nodes": ["node-a", "node-b", "node-d"], "complete": True, "finished": False, "step": 41,
     "tokens_per_s": 1234.5, "loss": 3.0,
     "links": [{"src": "node-a", "dst": "node-b", "mbps": 187.24, "back_mbps": 192.0},
               {"src": "node-b", "dst": "node-d", "mbps": 176.5, "back_mbps": 181.3}]},
    {"index": 1, "nodes": ["node-late", None, None], "complete": False, "finished": False, "step": None,
     "tokens_per_s": 0.0, "loss": None, "links": []},
]
ALERT = {"kind": "diverging", "step": 41, "trend": 3.1, "best": 1.4,
         "message": "the loss is diverging: its mean over recent steps rose to 3.1000 at step 41 (codecs "
                    "tahquant/naive)"}


def make_view(step: int = 40, late: bool = False) -> SwarmView:
    nodes = list(NODES) + ([NodeInfo("node-late", -1, "10.77.0.15:7100", "joining", "cpu")] if late else [])
    links = list(LINKS) + ([{"src": "node-late", "dst": "node-a", "mbps": 55.55, "rtt_ms": 0.7, "transport": "p2p"}]
                           if late else [])
    history = [(s, 5.5 - 2.5 * s / max(step, 1) + 0.05 * (s % 3)) for s in range(1, step + 1)]
    return SwarmView(
        nodes=nodes, links=links,
        training=TrainingInfo(step=step, loss=history[-1][1], tokens_per_s=1234.5, bits_per_element=4.31),
        loss_history=history, events=["12:00:00 coordinator listening", "12:00:01 node-a assigned stage 0",
                                      EVENT_WITH_MARKUP], stages=3,
        extra={"epoch": 2,
               **({"p2p_maddrs": [P2P_MADDR], "loss_alert": ALERT, "pipelines": PIPELINES} if late else {})})


class Provider:
    """The first call (the page itself) sees the initial view; later calls (the page's own
    fetches) see a newer one: what the browser shows then came from its live refresh."""

    def __init__(self):
        self.calls = 0

    def __call__(self) -> SwarmView:
        self.calls += 1
        return make_view() if self.calls == 1 else make_view(step=41, late=True)


@contextlib.contextmanager
def serve(provider, link_pages=None):
    """Runs the app with a real aiohttp runner on a free 127.0.0.1 port in a background thread."""
    loop = asyncio.new_event_loop()
    ready, box = threading.Event(), {}

    def run():
        asyncio.set_event_loop(loop)
        try:
            box["runner"], box["port"] = loop.run_until_complete(start_server(make_app(provider, link_pages),
                                                                              "127.0.0.1", 0))
        except BaseException as e:  # surfaced in the main thread below
            box["error"] = e
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(box["runner"].cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10), "the status server did not start"
    if "error" in box:
        raise box["error"]
    try:
        yield f"http://127.0.0.1:{box['port']}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


def strict_json(text: str):
    def no_constants(name):
        raise ValueError(f"non-JSON constant {name}")
    return json.loads(text, parse_constant=no_constants)


# -- JSON and metrics -----------------------------------------------------------------------------

def test_state_json_schema_exactly():
    with serve(lambda: make_view()) as base:
        ctype, body = get(base + "/api/v1/state")
    assert ctype.startswith("application/json")
    state = strict_json(body)
    assert {"nodes", "links", "training"} <= state.keys()
    assert [set(n) for n in state["nodes"]] == [{"id", "stage", "address", "status", "device"}] * len(NODES)
    assert [set(link) for link in state["links"]] == [{"src", "dst", "mbps", "rtt_ms"}] * len(LINKS)
    assert set(state["training"]) == {"step", "loss", "tokens_per_s", "bits_per_element"}
    assert state["nodes"][1] == {"id": "node-b", "stage": 1, "address": "10.77.0.12:7100", "status": "active",
                                 "device": "cuda:0"}
    assert state["nodes"][3]["stage"] == -1 and state["nodes"][3]["status"] == "standby"
    assert state["links"][0] == {"src": "node-a", "dst": "node-b", "mbps": 187.24, "rtt_ms": 0.41}
    assert state["links"][3]["rtt_ms"] is None
    t = state["training"]
    assert (t["step"] == 40 and isinstance(t["loss"], float) and t["tokens_per_s"] == 1234.5
            and t["bits_per_element"] == 4.31)
    assert state["stages"] == 3 and state["epoch"] == 2 and len(state["loss_history"]) == 40
    assert state["events"][-1] == EVENT_WITH_MARKUP


def test_state_json_before_training_and_from_dicts():
    # No loss yet (None), a NaN rtt, dict items as the coordinator's registry builds them.
    view = SwarmView.from_state({
        "nodes": [{"id": "x", "stage": 0, "address": "h:1", "status": "joining", "device": "cpu", "memory": 1}],
        "links": [{"src": "x", "dst": "y", "mbps": 12.0, "rtt_ms": float("nan")}],
        "training": {"step": 0, "loss": None, "tokens_per_s": 0.0, "bits_per_element": 0.0, "replays": 2},
        "loss_history": [], "events": [], "stages": 2, "epoch": 5,
    })

    async def async_provider():
        return view

    with serve(async_provider) as base:
        state = strict_json(get(base + "/api/v1/state")[1])
        _, metrics = get(base + "/metrics")
    # the schema's keys, normalized, then whatever else the registry reports
    assert (state["nodes"]
            == [{"id": "x", "stage": 0, "address": "h:1", "status": "joining", "device": "cpu", "memory": 1}])
    assert state["links"] == [{"src": "x", "dst": "y", "mbps": 12.0, "rtt_ms": None}]
    assert state["training"] == {"step": 0, "loss": None, "tokens_per_s": 0.0, "bits_per_element": 0.0, "replays": 2}
    assert state["epoch"] == 5
    assert "tahnode_loss NaN" in metrics


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_per_app_registry_and_stale_labels_dropped():
    current = {"view": make_view()}
    with serve(lambda: current["view"]) as base, serve(lambda: make_view(step=7)) as other:
        ctype, text = get(base + "/metrics")
        assert ctype.startswith("text/plain")
        m = metric_samples(text)
        assert m[("tahnode_step", ())] == 40
        assert m[("tahnode_tokens_per_second", ())] == 1234.5
        assert m[("tahnode_bits_per_element", ())] == pytest.approx(4.31)
        assert m[("tahnode_loss", ())] == pytest.approx(make_view().training.loss)
        assert m[("tahnode_stages", ())] == 3
        assert m[("tahnode_nodes", (("status", "active"),))] == 3
        assert m[("tahnode_nodes", (("status", "standby"),))] == 1
        assert m[("tahnode_nodes", (("status", "failed"),))] == 0
        assert m[("tahnode_nodes", (("status", "left"),))] == 0  # every status, even at 0
        assert m[("tahnode_node_stage", (("node", "node-c"),))] == -1
        for link in LINKS:
            assert m[("tahnode_link_mbps", (("dst", link.dst), ("src", link.src)))] == link.mbps
        assert m[("tahnode_link_rtt_ms", (("dst", "node-b"), ("src", "node-a")))] == 0.41
        assert ("tahnode_link_rtt_ms", (("dst", "node-b"), ("src", "node-d"))) not in m
        # A second app in the same process has its own registry (no clash, its own values).
        assert metric_samples(get(other + "/metrics")[1])[("tahnode_step", ())] == 7
        # A node that failed and a link that went away show up in the next scrape.
        current["view"] = make_view(step=41)
        current["view"].nodes[1] = NodeInfo("node-b", 1, "10.77.0.12:7100", "failed", "cuda:0")
        current["view"].nodes[3] = NodeInfo("node-c", -1, "10.77.0.13:7100", "left", "cpu")
        current["view"].links = LINKS[:2]
        m = metric_samples(get(base + "/metrics")[1])
        assert m[("tahnode_step", ())] == 41
        assert m[("tahnode_nodes", (("status", "failed"),))] == 1
        assert m[("tahnode_nodes", (("status", "left"),))] == 1
        assert ("tahnode_link_mbps", (("dst", "node-d"), ("src", "node-b"))) not in m
        # The pipelines: how many train, each one's step and tokens/s, each node's pipeline.
        current["view"] = make_view(step=41, late=True)
        current["view"].nodes = [{**vars(n), "pipeline": 0 if n.stage >= 0 else None} for n in NODES]
        m = metric_samples(get(base + "/metrics")[1])
        assert m[("tahnode_pipelines", ())] == 1
        assert m[("tahnode_pipeline_step", (("pipeline", "0"),))] == 41
        assert m[("tahnode_pipeline_tokens_per_second", (("pipeline", "0"),))] == 1234.5
        assert m[("tahnode_pipeline_step", (("pipeline", "1"),))] == 0
        assert m[("tahnode_node_pipeline", (("node", "node-b"),))] == 0
        assert m[("tahnode_node_pipeline", (("node", "node-c"),))] == -1


def test_page_is_self_contained():
    with serve(lambda: make_view()) as base:
        ctype, html = get(base + "/")
    assert ctype.startswith("text/html")
    assert not re.search(r"""<(script|link|img|iframe)[^>]*\s(src|href)=""", html, re.I)
    assert "@import" not in html and "url(http" not in html
    assert html.count("</script>") == 2  # the markup in the event cannot close the embedded JSON


# -- the page in a real browser --------------------------------------------------------------------

@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if path:
        return path
    wants = os.environ.get("CI") or os.environ.get("TAHNODE_INSTALL_BROWSER")
    if not wants or os.geteuid() != 0:
        pytest.skip("Debian chromium is not installed (/usr/bin/chromium); set CI=1 or TAHNODE_INSTALL_BROWSER=1 "
                    "and run as root to install it (apt-get install -y chromium)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode:
            pytest.fail(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return shutil.which("chromium") or "/usr/bin/chromium"


def run_chromium(binary: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"chromium failed ({r.returncode}): {r.stderr[-3000:]}"
    return r


class DomIndex(HTMLParser):
    """Collects, from a dumped DOM, the rows of #nodes and #links and the text of elements by id."""

    VOID = {"meta", "link", "br", "img", "input", "hr", "area", "base", "col", "embed", "source", "wbr"}

    def __init__(self):
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.nodes: dict[str, dict[str, str]] = {}
        self.links: dict[tuple[str, str], dict[str, str]] = {}
        self.pipelines: dict[str, dict[str, str]] = {}
        self.by_id: dict[str, str] = {}
        self.svg_texts: list[str] = []
        self.events: list[str] = []
        self._row: dict | None = None
        self._cell: str | None = None
        self._open_ids: list[tuple[int, str]] = []
        self._buf: dict[int, list[str]] = {}

    def within(self, elem_id: str) -> bool:
        return any(a.get("id") == elem_id for _, a in self.stack)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in self.VOID:
            return
        self.stack.append((tag, a))
        if "id" in a:
            self._open_ids.append((len(self.stack), a["id"]))
            self._buf[len(self.stack)] = []
        if tag == "tr" and self.within("nodes") and "data-node-id" in a:
            self._row = self.nodes.setdefault(a["data-node-id"], {})
        elif tag == "tr" and self.within("links") and "data-src" in a:
            self._row = self.links.setdefault((a["data-src"], a["data-dst"]), {})
        elif tag == "tr" and self.within("pipelines") and "data-pipeline" in a:
            self._row = self.pipelines.setdefault(a["data-pipeline"], {})
        elif tag == "td" and self._row is not None:
            self._cell = (a.get("class") or "").split()[0] if a.get("class") else ""
            self._row[self._cell] = ""

    def handle_endtag(self, tag):
        if tag in self.VOID or not self.stack:
            return
        depth = len(self.stack)
        if self._open_ids and self._open_ids[-1][0] == depth:
            _, elem_id = self._open_ids.pop()
            self.by_id[elem_id] = "".join(self._buf.pop(depth)).strip()
        if tag == "td":
            self._cell = None
        elif tag == "tr":
            self._row = None
        self.stack.pop()

    def handle_data(self, data):
        for depth in self._buf:
            self._buf[depth].append(data)
        if self._row is not None and self._cell is not None:
            self._row[self._cell] += data
        if self.stack and self.stack[-1][0] == "text" and self.within("chain"):
            self.svg_texts.append(data)
        if self.stack and self.stack[-1][0] == "li" and self.within("events"):
            self.events.append(data)


def test_page_in_headless_chromium(chromium, tmp_path):
    provider = Provider()
    with serve(provider) as base:
        dom = run_chromium(chromium, tmp_path, "--dump-dom", base + "/").stdout
        assert provider.calls >= 2, "the page never fetched /api/v1/state"
        (tmp_path / "dom.html").write_text(dom)
        shot = tmp_path / "status.png"
        run_chromium(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1280,900", base + "/")

    index = DomIndex()
    index.feed(dom)
    expected = make_view(step=41, late=True)
    # Every node with its stage and status, including the one only the live refresh knows about.
    assert set(index.nodes) == {n.id for n in expected.nodes}
    for n in expected.nodes:
        row = index.nodes[n.id]
        assert row["id"] == n.id
        assert row["stage"] == (str(n.stage) if n.stage >= 0 else "standby")
        assert row["status"] == n.status and row["address"] == n.address and row["device"] == n.device
    # Every link with its measured Mbit/s.
    links = [link if isinstance(link, dict) else {"src": link.src, "dst": link.dst, "mbps": link.mbps}
             for link in expected.links]
    assert set(index.links) == {(link["src"], link["dst"]) for link in links}
    for link in links:
        row = index.links[(link["src"], link["dst"])]
        assert row["mbps"] == f"{link['mbps']:.1f}" and row["transport"] == link.get("transport", "")
    assert index.by_id["p2p-maddrs"] == P2P_MADDR  # where volunteers behind NAT join
    # Every pipeline, its nodes stage by stage, its step and tokens/s, its slowest link, whether it trains.
    assert index.pipelines == {
        "0": {"index": "0", "chain": "node-a → node-b → node-d", "step": "41", "tokens-per-s": "1,235",
              "slowest": "176.5", "state": "training"},
        "1": {"index": "1", "chain": "node-late → (open) → (open)", "step": "–", "tokens-per-s": "0.0", "slowest": "–",
              "state": "incomplete"}}
    # The chain graph names the stage holders and carries the chain links' Mbit/s.
    svg = " ".join(index.svg_texts)
    for node_id in ("node-a", "node-b", "node-d", "node-c", "node-late"):
        assert node_id in svg
    for label in ("187.2 →", "← 192.0", "176.5 →", "← 181.3", "stage 0", "stage 2"):
        assert label in svg
    assert index.by_id["step"] == "41"
    assert index.by_id["tokens-per-s"] == "1,235" and index.by_id["bits-per-element"] == "4.31"
    assert index.by_id["conn"].startswith("live")
    assert EVENT_WITH_MARKUP in index.events  # shown as text, not parsed as markup
    assert "<polyline" in dom  # the loss curve
    assert index.by_id["loss-alert"] == ALERT["message"]  # the live refresh raised the divergence alert
    tag = re.search(r'<div id="loss-alert"[^>]*>', dom).group(0)
    assert "hidden" not in tag and 'data-kind="diverging"' in tag

    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1280, 900)
    assert len(data) > 20_000, f"screenshot suspiciously small ({len(data)} bytes)"


def test_every_link_comes_page_by_page_and_a_bad_page_is_refused():
    """?links=all replaces the view's few links by a page of every measured link; the page says
    where the next one starts; offset and limit out of range are a 400 that says why."""
    every = [LinkInfo(f"n{i}", f"n{i + 1}", float(i)) for i in range(2500)]

    def pages(offset: int, limit: int):
        return every[offset:offset + limit], len(every)

    with serve(make_view, pages) as base:
        few = strict_json(get(base + "/api/v1/state")[1])
        first = strict_json(get(base + "/api/v1/state?links=all")[1])
        last = strict_json(get(base + "/api/v1/state?links=all&offset=2000&limit=1000")[1])
        with pytest.raises(urllib.error.HTTPError) as refused:
            get(base + "/api/v1/state?links=all&limit=5000")
    assert "links_page" not in few and len(few["links"]) == len(make_view().links)
    assert len(first["links"]) == 1000 and first["links"][0]["src"] == "n0"
    assert first["links_page"] == {"offset": 0, "limit": 1000, "total": 2500, "next": 1000}
    assert [link["mbps"] for link in last["links"]] == [float(i) for i in range(2000, 2500)]
    assert last["links_page"]["next"] is None and last["nodes"] == first["nodes"]
    assert refused.value.code == 400 and "limit within 1..1000" in refused.value.read().decode()
