"""The coordinator's HTTP side: the status page (`/`), its JSON (`/api/v1/state`) and Prometheus
metrics (`/metrics`), all served with aiohttp from a `SwarmView` the coordinator fills.

The page is one self-contained HTML document, status_page.html beside this module (inline CSS, JS
and SVG; no external assets): it renders the state embedded in it at load, then fetches
/api/v1/state every 2 s and re-renders.
Stable hooks for tests and scrapers: `#nodes tr[data-node-id]` (cells `.stage`, `.pipeline`, `.status`),
`#pipelines tr[data-pipeline]` (cells `.chain`, `.step`, `.tokens-per-s`, `.state`),
`#links tr[data-src][data-dst]` (cells `.mbps`, `.transport`), `#p2p-maddrs li`, `#chain` (SVG), `#loss-curve` (SVG),
`#step`, `#loss`, `#tokens-per-s`, `#bits-per-element`, `#events`, `#loss-alert` (shown with `data-kind` while the
loss diverges).
"""

from __future__ import annotations

import asyncio
import importlib.resources
import inspect
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from .state import NodeStatus

__all__ = ["NodeInfo", "LinkInfo", "TrainingInfo", "SwarmView", "make_app", "start_server", "STATUSES"]

STATUSES = tuple(s.value for s in NodeStatus)  # always exported, even at 0
NODE_KEYS = ("id", "stage", "address", "status", "device")
LINK_KEYS = ("src", "dst", "mbps", "rtt_ms")
TRAINING_KEYS = ("step", "loss", "tokens_per_s", "bits_per_element")


@dataclass
class NodeInfo:
    id: str
    stage: int                       # -1 = standby
    address: str = ""
    status: str = "active"           # a NodeStatus value: active | standby | failed | joining | left
    device: str = ""


@dataclass
class LinkInfo:
    src: str
    dst: str
    mbps: float                      # measured, Mbit/s (1e6 bit/s), direction src -> dst
    rtt_ms: float | None = None


@dataclass
class TrainingInfo:
    step: int = 0
    loss: float | None = None        # None before the first step
    tokens_per_s: float = 0.0
    bits_per_element: float = 0.0    # forward wire bits per activation element


@dataclass
class SwarmView:
    """What the status endpoints show. Items may be the dataclasses above or dicts with their keys.

    stages: the pipeline's stage count (None: inferred from the nodes); extra: further top-level
    keys for /api/v1/state (never replacing the schema's own).
    """

    nodes: list[NodeInfo | Mapping[str, Any]] = field(default_factory=list)
    links: list[LinkInfo | Mapping[str, Any]] = field(default_factory=list)
    training: TrainingInfo | Mapping[str, Any] = field(default_factory=TrainingInfo)
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    stages: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # (document, JSON), made ahead
    prepared: tuple[dict[str, Any], str] | None = field(default=None, repr=False, compare=False)

    async def prepare(self) -> "SwarmView":
        """Make the document and its JSON ahead of any request (the JSON in a thread)."""
        doc = self.to_state_json()
        self.prepared = (doc, await asyncio.to_thread(json.dumps, doc))
        return self

    def to_state_json(self) -> dict[str, Any]:
        """The /api/v1/state document: `nodes`, `links`, `training` with exactly the schema's keys,
        plus `stages`, `loss_history`, `events` and `extra`. Non-finite numbers become null."""
        nodes = [_pick(n, NODE_KEYS) for n in self.nodes]
        for n in nodes:
            n["id"], n["stage"] = str(n["id"]), int(n["stage"] if n["stage"] is not None else -1)
        links = [_pick(link, LINK_KEYS) for link in self.links]
        for link in links:
            link["mbps"] = _num(link["mbps"])
            link["rtt_ms"] = _num(link["rtt_ms"])
        training = _pick(self.training, TRAINING_KEYS)
        training["step"] = int(training["step"] or 0)
        for key in ("loss", "tokens_per_s", "bits_per_element"):
            training[key] = _num(training[key])
        stages = self.stages if self.stages is not None else max((n["stage"] for n in nodes), default=-1) + 1
        out: dict[str, Any] = {k: v for k, v in self.extra.items()}
        out.update({
            "nodes": nodes,
            "links": links,
            "training": training,
            "stages": stages,
            "loss_history": [[int(s), _num(v)] for s, v in self.loss_history],
            "events": [str(e) for e in self.events],
        })
        return out

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SwarmView:
        """A view from a state dict in the /api/v1/state shape (e.g. the coordinator's registry);
        keys outside the schema are kept (top-level ones in `extra`)."""
        training = dict(state.get("training") or {})
        extra = {k: v for k, v in state.items()
                 if k not in ("nodes", "links", "training", "loss_history", "events", "stages")}
        return cls(  # picked into the schema by to_state_json
            nodes=list(state.get("nodes", [])),
            links=list(state.get("links", [])),
            training=training,
            loss_history=[(int(s), v) for s, v in state.get("loss_history", [])],
            events=list(state.get("events", [])),
            stages=state.get("stages"),
            extra=extra,
        )


def _pick(item: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """The schema's keys (with defaults) first, then any further keys the item has."""
    d = asdict(item) if is_dataclass(item) else dict(item)
    defaults = {"address": "", "status": "active", "device": "", "rtt_ms": None, "step": 0, "loss": None,
                "tokens_per_s": 0.0, "bits_per_element": 0.0}
    return {**{k: d.get(k, defaults.get(k)) for k in keys}, **{k: v for k, v in d.items() if k not in keys}}


def _num(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


# -- Prometheus ---------------------------------------------------------------------------------

class _Metrics:
    """Gauges in a registry of their own (one per app), refreshed from the view at each scrape."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.step = Gauge("tahnode_step", "Last optimizer step reported by the last stage", registry=r)
        self.loss = Gauge("tahnode_loss", "Training loss of the last step (NaN before the first)", registry=r)
        self.tokens = Gauge("tahnode_tokens_per_second", "Training throughput in tokens per second", registry=r)
        self.bits = Gauge("tahnode_bits_per_element", "Forward wire bits per activation element", registry=r)
        self.stages = Gauge("tahnode_stages", "Pipeline stages", registry=r)
        self.alert = Gauge("tahnode_loss_alert", "1 while the loss is diverging or not finite (see /api/v1/state "
                           "loss_alert), else 0", registry=r)
        self.nodes = Gauge("tahnode_nodes", "Nodes by status", ["status"], registry=r)
        self.node_stage = Gauge("tahnode_node_stage", "Stage each node holds (-1 = standby)", ["node"], registry=r)
        self.link_mbps = Gauge("tahnode_link_mbps", "Measured link bandwidth in Mbit/s", ["src", "dst"], registry=r)
        self.link_rtt = Gauge("tahnode_link_rtt_ms", "Measured link round-trip time in ms", ["src", "dst"], registry=r)
        self.pipelines = _PipelineGauges(r)
        self.refused = Gauge("tahnode_refused_messages", "Messages refused so far (replayed, unauthentic, for another "
                             "run or recipient, off the clock), by receiver and reason", ["receiver", "reason"],
                             registry=r)

    def render(self, state: dict[str, Any]) -> bytes:
        t = state["training"]
        self.step.set(t["step"])
        self.loss.set(math.nan if t["loss"] is None else t["loss"])
        self.tokens.set(t["tokens_per_s"] or 0.0)
        self.bits.set(t["bits_per_element"] or 0.0)
        self.stages.set(state["stages"])
        self.alert.set(1 if state.get("loss_alert") else 0)
        for g in (self.nodes, self.node_stage, self.link_mbps, self.link_rtt, self.refused):
            g.clear()  # nodes and links that left disappear from the scrape
        counts = dict.fromkeys(STATUSES, 0)
        for n in state["nodes"]:
            counts[n["status"]] = counts.get(n["status"], 0) + 1
            self.node_stage.labels(node=n["id"]).set(n["stage"])
        self.pipelines.render(state)
        for status, count in counts.items():
            self.nodes.labels(status=status).set(count)
        for link in state["links"]:
            if link["mbps"] is not None:
                self.link_mbps.labels(src=link["src"], dst=link["dst"]).set(link["mbps"])
            if link["rtt_ms"] is not None:
                self.link_rtt.labels(src=link["src"], dst=link["dst"]).set(link["rtt_ms"])
        for r in state.get("refused", []):
            self.refused.labels(receiver=r["receiver"], reason=r["reason"]).set(r["count"])
        return generate_latest(self.registry)


class _PipelineGauges:
    """The pipelines' gauges: how many train, each one's step and tokens/s, each node's pipeline."""

    def __init__(self, r: CollectorRegistry):
        self.count = Gauge("tahnode_pipelines", "Pipelines that train (every stage held)", registry=r)
        self.step = Gauge("tahnode_pipeline_step", "Last step each pipeline's loss stage reported", ["pipeline"],
                          registry=r)
        self.tokens = Gauge("tahnode_pipeline_tokens_per_second", "Each pipeline's throughput in tokens per second",
                            ["pipeline"], registry=r)
        self.node = Gauge("tahnode_node_pipeline", "Pipeline each node holds a stage of (-1 = none)", ["node"],
                          registry=r)

    def render(self, state: dict[str, Any]) -> None:
        for g in (self.step, self.tokens, self.node):
            g.clear()  # pipelines and nodes that left disappear from the scrape
        for n in state["nodes"]:
            self.node.labels(node=n["id"]).set(-1 if n.get("pipeline") is None else n["pipeline"])
        pipelines = state.get("pipelines", [])
        self.count.set(sum(1 for p in pipelines if p["complete"]))
        for p in pipelines:
            self.step.labels(pipeline=str(p["index"])).set(p["step"] or 0)
            self.tokens.labels(pipeline=str(p["index"])).set(p["tokens_per_s"] or 0.0)


# -- the app --------------------------------------------------------------------------------------

ViewProvider = Callable[[], "SwarmView | Awaitable[SwarmView]"]
# (offset, limit) -> (a page of every link, how many there are): GET /api/v1/state?links=all
LinkPages = Callable[[int, int], "tuple[list[LinkInfo | Mapping[str, Any]], int]"]
PAGE_LIMIT = 1000  # links per page at most


class BadQuery(ValueError):
    """A query parameter of the state endpoint that is not a number in range."""


def _page(query: Mapping[str, str]) -> tuple[int, int]:
    try:
        offset, limit = int(query.get("offset", 0)), int(query.get("limit", PAGE_LIMIT))
    except ValueError:
        raise BadQuery("offset and limit must be integers") from None
    if offset < 0 or not 1 <= limit <= PAGE_LIMIT:
        raise BadQuery(f"offset must be >= 0 and limit within 1..{PAGE_LIMIT}")
    return offset, limit


def make_app(view_provider: ViewProvider, link_pages: LinkPages | None = None) -> web.Application:
    """The status app. `view_provider` is called on every request (it may be a coroutine function);
    `link_pages` serves `?links=all` (else only the view's links exist). Documents are built on the
    event loop from a fresh view and encoded in a thread."""
    metrics = _Metrics()
    rendering = asyncio.Lock()  # one scrape at a time renders the shared gauges
    page = importlib.resources.files(__package__).joinpath("status_page.html").read_text(encoding="utf-8")

    cached: dict[str, Any] = {"view": None}  # the last view's document and its JSON: a provider that hands out
    #                                              the same view again (a snapshot) costs a request nothing more

    async def state(query: Mapping[str, str] | None = None) -> tuple[dict[str, Any], str | None]:
        """The document, and its JSON text when it is the shared one (not a page of links)."""
        query = query or {}
        view = view_provider()
        if inspect.isawaitable(view):
            view = await view
        if query.get("links") == "all" and link_pages is not None:
            offset, limit = _page(query)
            page, total = link_pages(offset, limit)
            view = replace(view, links=page, extra={**view.extra, "links_page": {
                "offset": offset, "limit": limit, "total": total,
                "next": offset + limit if offset + limit < total else None}})
            return view.to_state_json(), None
        if view.prepared is not None:
            return view.prepared
        if cached["view"] is not view:
            doc = view.to_state_json()
            cached.update(view=view, doc=doc, text=await asyncio.to_thread(json.dumps, doc))
        return cached["doc"], cached["text"]

    async def index(request: web.Request) -> web.Response:
        _, text = await state()
        embedded = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        return web.Response(text=page.replace("__STATE__", embedded), content_type="text/html",
                            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    async def api_state(request: web.Request) -> web.Response:
        try:
            doc, text = await state(request.query)
        except BadQuery as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.Response(text=text if text is not None else await asyncio.to_thread(json.dumps, doc),
                            content_type="application/json", headers={"Cache-Control": "no-store"})

    async def prometheus(request: web.Request) -> web.Response:
        doc, _ = await state()
        async with rendering:
            body = await asyncio.to_thread(metrics.render, doc)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/api/v1/state", api_state)
    app.router.add_get("/metrics", prometheus)
    return app


async def start_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serves `app` on host:port (0 = any free port); returns the runner (await runner.cleanup()
    to stop) and the bound port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]
