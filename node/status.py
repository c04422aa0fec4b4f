"""The coordinator's HTTP side: the status page (`/`), its JSON (`/api/v1/state`) and Prometheus
metrics (`/metrics`), all served with aiohttp from a `SwarmView` the coordinator fills.

The page is one self-contained HTML document (inline CSS, JS and SVG; no external assets): it
renders the state embedded in it at load, then fetches /api/v1/state every 2 s and re-renders.
Stable hooks for tests and scrapers: `#nodes tr[data-node-id]` (cells `.stage`, `.status`),
`#links tr[data-src][data-dst]` (cell `.mbps`), `#chain` (SVG), `#loss-curve` (SVG), `#step`,
`#loss`, `#tokens-per-s`, `#bits-per-element`, `#events`.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

__all__ = ["NodeInfo", "LinkInfo", "TrainingInfo", "SwarmView", "make_app", "start_server", "STATUSES"]

STATUSES = ("active", "standby", "failed", "joining")  # always exported, even at 0
NODE_KEYS = ("id", "stage", "address", "status", "device")
LINK_KEYS = ("src", "dst", "mbps", "rtt_ms")
TRAINING_KEYS = ("step", "loss", "tokens_per_s", "bits_per_element")


@dataclass
class NodeInfo:
    id: str
    stage: int                       # -1 = standby
    address: str = ""
    status: str = "active"           # active | standby | failed | joining
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
        return cls(
            nodes=[_pick(n, NODE_KEYS) for n in state.get("nodes", [])],
            links=[_pick(link, LINK_KEYS) for link in state.get("links", [])],
            training=_pick(training, TRAINING_KEYS),
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
        self.nodes = Gauge("tahnode_nodes", "Nodes by status", ["status"], registry=r)
        self.node_stage = Gauge("tahnode_node_stage", "Stage each node holds (-1 = standby)", ["node"], registry=r)
        self.link_mbps = Gauge("tahnode_link_mbps", "Measured link bandwidth in Mbit/s", ["src", "dst"], registry=r)
        self.link_rtt = Gauge("tahnode_link_rtt_ms", "Measured link round-trip time in ms", ["src", "dst"], registry=r)

    def render(self, state: dict[str, Any]) -> bytes:
        t = state["training"]
        self.step.set(t["step"])
        self.loss.set(math.nan if t["loss"] is None else t["loss"])
        self.tokens.set(t["tokens_per_s"] or 0.0)
        self.bits.set(t["bits_per_element"] or 0.0)
        self.stages.set(state["stages"])
        for g in (self.nodes, self.node_stage, self.link_mbps, self.link_rtt):
            g.clear()  # nodes and links that left disappear from the scrape
        counts = dict.fromkeys(STATUSES, 0)
        for n in state["nodes"]:
            counts[n["status"]] = counts.get(n["status"], 0) + 1
            self.node_stage.labels(node=n["id"]).set(n["stage"])
        for status, count in counts.items():
            self.nodes.labels(status=status).set(count)
        for link in state["links"]:
            if link["mbps"] is not None:
                self.link_mbps.labels(src=link["src"], dst=link["dst"]).set(link["mbps"])
            if link["rtt_ms"] is not None:
                self.link_rtt.labels(src=link["src"], dst=link["dst"]).set(link["rtt_ms"])
        return generate_latest(self.registry)


# -- the app --------------------------------------------------------------------------------------

ViewProvider = Callable[[], "SwarmView | Awaitable[SwarmView]"]


def make_app(view_provider: ViewProvider) -> web.Application:
    """The status app. `view_provider` is called on every request (it may be a coroutine function)."""
    metrics = _Metrics()

    async def state() -> dict[str, Any]:
        view = view_provider()
        if inspect.isawaitable(view):
            view = await view
        return view.to_state_json()

    async def index(request: web.Request) -> web.Response:
        embedded = json.dumps(await state()).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        return web.Response(text=PAGE.replace("__STATE__", embedded), content_type="text/html",
                            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    async def api_state(request: web.Request) -> web.Response:
        return web.json_response(await state(), headers={"Cache-Control": "no-store"})

    async def prometheus(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(await state()), headers={"Content-Type": CONTENT_TYPE_LATEST})

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


PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tahnode swarm</title>
<style>
  :root { --bg:#f6f7f9; --card:#fff; --ink:#1d2430; --muted:#6a7383; --line:#dde1e7;
          --active:#1f9d55; --standby:#8a94a6; --failed:#d64545; --joining:#d9911a; --accent:#3b6fd8; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; background:var(--bg); color:var(--ink); }
  header { display:flex; align-items:baseline; gap:16px; padding:14px 24px; background:#1d2430; color:#fff; }
  header h1 { margin:0; font-size:18px; font-weight:600; }
  #conn { font-size:12px; color:#b8c1d1; } #conn.bad { color:#ff9b9b; }
  main { padding:16px 24px; display:grid; grid-template-columns:repeat(12,1fr); gap:16px; }
  section { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:12px 16px; }
  section h2 { margin:0 0 8px; font-size:13px; text-transform:uppercase; letter-spacing:.05em; color:var(--muted); }
  .span12 { grid-column:span 12; } .span7 { grid-column:span 7; } .span5 { grid-column:span 5; }
  #cards { display:grid; grid-template-columns:repeat(5,1fr); gap:16px; grid-column:span 12; }
  .card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 16px; }
  .card .label { font-size:12px; color:var(--muted); } .card .value { font-size:24px; font-weight:600; font-variant-numeric:tabular-nums; }
  table { border-collapse:collapse; width:100%; font-variant-numeric:tabular-nums; }
  th, td { text-align:left; padding:5px 8px; border-bottom:1px solid var(--line); }
  th { font-size:12px; color:var(--muted); font-weight:500; }
  td.num, th.num { text-align:right; }
  .badge { display:inline-block; padding:1px 8px; border-radius:10px; font-size:12px; color:#fff; background:var(--standby); }
  .badge.active { background:var(--active); } .badge.failed { background:var(--failed); } .badge.joining { background:var(--joining); }
  tr.on-chain td.mbps { font-weight:600; }
  svg { display:block; }
  #loss-curve { width:100%; height:auto; }
  #chain { max-width:100%; height:auto; }
  .legend { font-size:12px; color:var(--muted); font-weight:400; text-transform:none; letter-spacing:0; margin-left:8px; }
  #events { margin:0; padding:0; list-style:none; font:12px/1.5 ui-monospace,SFMono-Regular,Menlo,monospace; max-height:180px; overflow:auto; }
  .empty { color:var(--muted); font-style:italic; }
</style>
</head>
<body>
<header><h1>tahnode swarm</h1><span id="conn">loaded</span></header>
<main>
  <div id="cards">
    <div class="card"><div class="label">step</div><div class="value" id="step">–</div></div>
    <div class="card"><div class="label">loss</div><div class="value" id="loss">–</div></div>
    <div class="card"><div class="label">tokens/s</div><div class="value" id="tokens-per-s">–</div></div>
    <div class="card"><div class="label">bits/element</div><div class="value" id="bits-per-element">–</div></div>
    <div class="card"><div class="label">nodes (active / all)</div><div class="value" id="node-count">–</div></div>
  </div>
  <section class="span12"><h2>Pipeline <span class="legend">edges: measured Mbit/s, activations → and gradients ←</span></h2><svg id="chain" role="img" aria-label="pipeline chain"></svg></section>
  <section class="span7"><h2>Nodes</h2>
    <table id="nodes"><thead><tr><th>node</th><th>stage</th><th>status</th><th>address</th><th>device</th></tr></thead><tbody></tbody></table>
  </section>
  <section class="span5"><h2>Links (measured)</h2>
    <table id="links"><thead><tr><th>from</th><th>to</th><th class="num">Mbit/s</th><th class="num">RTT ms</th></tr></thead><tbody></tbody></table>
  </section>
  <section class="span7"><h2>Loss</h2><svg id="loss-curve" role="img" aria-label="loss curve"></svg></section>
  <section class="span5"><h2>Events</h2><ul id="events"></ul></section>
</main>
<script id="initial-state" type="application/json">__STATE__</script>
<script>
"use strict";
const SVGNS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function sv(parent, tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  parent.appendChild(e);
  return e;
}
function num(x, digits) {
  return (x === null || x === undefined || !isFinite(x)) ? "–" : Number(x).toFixed(digits);
}
function big(x) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  return x >= 1000 ? Math.round(x).toLocaleString("en-US") : Number(x).toFixed(1);
}
const COLORS = {active: "#1f9d55", standby: "#8a94a6", failed: "#d64545", joining: "#d9911a"};
const stageText = (s) => s >= 0 ? String(s) : "standby";

function linkMap(s) {
  const m = new Map();
  for (const l of s.links) m.set(l.src + "\u0000" + l.dst, l);
  return m;
}
function chainOf(s) {
  // The node holding each stage: an active one first, else any node still on it.
  const rank = {active: 0, joining: 1, failed: 2};
  const byStage = [];
  for (let k = 0; k < s.stages; k++) {
    const on = s.nodes.filter((n) => n.stage === k)
      .sort((a, b) => (rank[a.status] ?? 3) - (rank[b.status] ?? 3) || (a.id < b.id ? -1 : 1));
    byStage.push(on);
  }
  return byStage;
}

function renderCards(s) {
  const t = s.training;
  $("step").textContent = String(t.step ?? 0);
  $("loss").textContent = num(t.loss, 4);
  $("tokens-per-s").textContent = big(t.tokens_per_s);
  $("bits-per-element").textContent = num(t.bits_per_element, 2);
  const active = s.nodes.filter((n) => n.status === "active").length;
  $("node-count").textContent = active + " / " + s.nodes.length;
}

function renderNodes(s) {
  const body = $("nodes").tBodies[0];
  const rows = [...s.nodes].sort((a, b) =>
    ((a.stage < 0 ? 1e9 : a.stage) - (b.stage < 0 ? 1e9 : b.stage)) || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
  body.replaceChildren();
  if (!rows.length) body.appendChild(el("tr")).appendChild(el("td", {colspan: "5", class: "empty"}, "no node has joined yet"));
  for (const n of rows) {
    const tr = el("tr", {"data-node-id": n.id, "data-stage": String(n.stage), "data-status": n.status});
    tr.appendChild(el("td", {class: "id"}, n.id));
    tr.appendChild(el("td", {class: "stage"}, stageText(n.stage)));
    const st = el("td", {class: "status"});
    st.appendChild(el("span", {class: "badge " + n.status}, n.status));
    tr.appendChild(st);
    tr.appendChild(el("td", {class: "address"}, n.address || ""));
    tr.appendChild(el("td", {class: "device"}, n.device || ""));
    body.appendChild(tr);
  }
}

function renderLinks(s) {
  const body = $("links").tBodies[0];
  const chain = chainOf(s).map((on) => on.length ? on[0].id : null);
  const onChain = new Set();
  for (let k = 0; k + 1 < chain.length; k++) {
    onChain.add(chain[k] + "\u0000" + chain[k + 1]); onChain.add(chain[k + 1] + "\u0000" + chain[k]);
  }
  const rows = [...s.links].sort((a, b) => (a.src + "\u0000" + a.dst < b.src + "\u0000" + b.dst ? -1 : 1));
  body.replaceChildren();
  if (!rows.length) body.appendChild(el("tr")).appendChild(el("td", {colspan: "4", class: "empty"}, "no link measured yet"));
  for (const l of rows) {
    const tr = el("tr", {"data-src": l.src, "data-dst": l.dst});
    if (onChain.has(l.src + "\u0000" + l.dst)) tr.className = "on-chain";
    tr.appendChild(el("td", {class: "src"}, l.src));
    tr.appendChild(el("td", {class: "dst"}, l.dst));
    tr.appendChild(el("td", {class: "mbps num"}, num(l.mbps, 1)));
    tr.appendChild(el("td", {class: "rtt num"}, num(l.rtt_ms, 2)));
    body.appendChild(tr);
  }
}

function renderChain(s) {
  const g = $("chain");
  g.replaceChildren();
  const stages = chainOf(s), links = linkMap(s);
  const standbys = s.nodes.filter((n) => n.stage < 0);
  const W = stages.length > 5 ? 200 : 250, BW = W - 100 + 40 * (W < 250), BH = 46, GAP = 12, X0 = 4, Y0 = 30;
  const deepest = Math.max(1, ...stages.map((on) => on.length));
  const width = X0 * 2 + Math.max(1, stages.length, standbys.length) * W - (W - BW);
  const standbyY = Y0 + deepest * (BH + GAP) + 34;
  const height = standbys.length ? standbyY + BH + 10 : Y0 + deepest * (BH + GAP) + 4;
  g.setAttribute("viewBox", "0 0 " + width + " " + height);
  g.setAttribute("width", width);
  g.setAttribute("height", height);
  const defs = sv(g, "defs");
  const marker = sv(defs, "marker", {id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse"});
  sv(marker, "path", {d: "M0,0 L10,5 L0,10 z", fill: "#3b6fd8"});
  function box(n, x, y) {
    const grp = sv(g, "g", {class: "node", "data-node-id": n.id});
    const c = COLORS[n.status] || "#8a94a6";
    sv(grp, "rect", {x, y, width: BW, height: BH, rx: 7, fill: "#fff", stroke: c, "stroke-width": n.status === "active" ? 2.5 : 1.5,
                     "stroke-dasharray": n.status === "active" ? "" : "5 3"});
    sv(grp, "text", {x: x + BW / 2, y: y + 19, "text-anchor": "middle", "font-size": 13, "font-weight": 600, fill: "#1d2430"}, n.id);
    sv(grp, "text", {x: x + BW / 2, y: y + 36, "text-anchor": "middle", "font-size": 11, fill: c},
       n.status + (n.device ? " · " + n.device : ""));
  }
  stages.forEach((on, k) => {
    const x = X0 + k * W;
    sv(g, "text", {x: x + BW / 2, y: 20, "text-anchor": "middle", "font-size": 12, fill: "#6a7383"}, "stage " + k);
    if (!on.length) {
      sv(g, "rect", {x, y: Y0, width: BW, height: BH, rx: 7, fill: "none", stroke: "#d64545", "stroke-dasharray": "3 3"});
      sv(g, "text", {x: x + BW / 2, y: Y0 + 28, "text-anchor": "middle", "font-size": 12, fill: "#d64545"}, "unassigned");
    }
    on.forEach((n, i) => box(n, x, Y0 + i * (BH + GAP)));
    const next = stages[k + 1];
    if (on.length && next && next.length) {
      const a = on[0].id, b = next[0].id, xa = x + BW + 2, xb = x + W - 2, ym = Y0 + BH / 2;
      sv(g, "line", {x1: xa, y1: ym, x2: xb, y2: ym, stroke: "#3b6fd8", "stroke-width": 2, "marker-end": "url(#arrow)", "marker-start": "url(#arrow)"});
      const fwd = links.get(a + "\u0000" + b), bwd = links.get(b + "\u0000" + a);
      sv(g, "text", {x: (xa + xb) / 2, y: ym - 6, "text-anchor": "middle", "font-size": 11, fill: "#1d2430", class: "edge-mbps",
                     "data-src": a, "data-dst": b}, fwd ? num(fwd.mbps, 1) + " →" : "? →");
      sv(g, "text", {x: (xa + xb) / 2, y: ym + 15, "text-anchor": "middle", "font-size": 11, fill: "#6a7383", class: "edge-mbps",
                     "data-src": b, "data-dst": a}, bwd ? "← " + num(bwd.mbps, 1) : "← ?");
    }
  });
  if (standbys.length) {
    sv(g, "text", {x: X0, y: standbyY - 10, "font-size": 12, fill: "#6a7383"}, "standby and other nodes");
    standbys.forEach((n, i) => box(n, X0 + i * W, standbyY));
  }
}

function renderLoss(s) {
  const g = $("loss-curve");
  g.replaceChildren();
  const W = 640, H = 220, L = 52, R = 14, T = 12, B = 30;
  g.setAttribute("viewBox", "0 0 " + W + " " + H);
  const pts = s.loss_history.filter((p) => p[1] !== null && isFinite(p[1]));
  if (pts.length < 2) {
    sv(g, "text", {x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#6a7383", class: "empty"},
       pts.length ? "step " + pts[0][0] + ": loss " + num(pts[0][1], 4) : "no loss reported yet");
    return;
  }
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const px = (x) => L + (x - x0) / Math.max(1, x1 - x0) * (W - L - R);
  const py = (y) => T + (y1 - y) / (y1 - y0) * (H - T - B);
  sv(g, "line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#dde1e7"});
  sv(g, "line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#dde1e7"});
  for (const [y, anchorY] of [[y1, T + 4], [y0, H - B]]) {
    sv(g, "text", {x: L - 6, y: anchorY, "text-anchor": "end", "font-size": 11, fill: "#6a7383"}, num(y, 3));
  }
  sv(g, "text", {x: L, y: H - 10, "font-size": 11, fill: "#6a7383"}, "step " + x0);
  sv(g, "text", {x: W - R, y: H - 10, "text-anchor": "end", "font-size": 11, fill: "#6a7383"}, "step " + x1);
  sv(g, "polyline", {points: pts.map((p) => px(p[0]).toFixed(1) + "," + py(p[1]).toFixed(1)).join(" "),
                     fill: "none", stroke: "#3b6fd8", "stroke-width": 2, "stroke-linejoin": "round"});
  const last = pts[pts.length - 1];
  sv(g, "circle", {cx: px(last[0]), cy: py(last[1]), r: 3.5, fill: "#3b6fd8"});
}

function renderEvents(s) {
  const ul = $("events");
  ul.replaceChildren();
  if (!s.events.length) ul.appendChild(el("li", {class: "empty"}, "no events yet"));
  for (const e of s.events.slice(-30)) ul.appendChild(el("li", {}, e));
}

function render(s) {
  renderCards(s); renderNodes(s); renderLinks(s); renderChain(s); renderLoss(s); renderEvents(s);
  document.body.dataset.step = String(s.training.step ?? 0);
}

async function refresh() {
  try {
    const r = await fetch("api/v1/state", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    $("conn").textContent = "live · updated " + new Date().toLocaleTimeString();
    $("conn").className = "ok";
  } catch (e) {
    $("conn").textContent = "coordinator unreachable (" + e.message + "); retrying";
    $("conn").className = "bad";
  }
  setTimeout(refresh, 2000);
}

render(JSON.parse($("initial-state").textContent));
refresh();
</script>
</body>
</html>
"""
