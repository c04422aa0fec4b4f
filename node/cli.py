"""The `tahnode` command line: one argparse tree whose subcommands call the modules that do the
work (codec eval, data prepare, join, coordinator, demo, bench, export, compose)."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys

from .codecs import CODECS, CodecError
from .config.flags import add_run_flags, run_config_from
from .config.node import COORDINATOR_P2P_LISTEN, NODE_P2P_LISTEN
from .net.errors import P2PError
from .net.loop import use_fast_event_loop
from .tools import data_prepare
from .tools.certs_cli import add_certs_command, run_certs

BENCHES = {  # `tahnode bench NAME`: tahnode.tools.bench_NAME.main
    "kernels": "Triton codec kernels vs x.clone() and the reference (needs a GPU)",
    "swarm": "training on a local swarm with shaped links, against the physical limit (root for tc)",
    "soak": "a swarm trains for --minutes while memory and open files of every process are sampled",
    "nat": "probed throughput of relayed and direct p2p links to volunteers behind NAT (root, nftables)",
    "coordinator": "a real coordinator against --nodes simulated volunteers: time to place them, heartbeat latency, "
                   "its CPU and memory, probe traffic, HTTP endpoints",
    "convergence": "codec pairs x seeds trained on the pipeline's math in one process: held-out loss against "
                   "uncompressed training, bits per element, time to the same loss",
    "abuse": "a real coordinator's memory and status latency while one token holder sends oversized heartbeats and "
             "Sybil joins",
    "copies": "how many times a message's payload is copied on the host from codec to wire (counted; needs cc)",
    "chaos": "a swarm of P pipelines and standbys trains while a seeded schedule kills, stops and cuts off its "
             "daemons and coordinator: tokens/s, stalls, ledger, replicas, time to full speed",
}


def bench_modules() -> dict:
    """`tahnode bench NAME` -> its module, tahnode.tools.bench_NAME (imported when a bench runs: most import torch)."""
    from .tools import (bench_abuse, bench_chaos, bench_convergence, bench_coordinator, bench_copies, bench_kernels,
                        bench_nat, bench_soak, bench_swarm)
    return {"kernels": bench_kernels, "swarm": bench_swarm, "soak": bench_soak, "nat": bench_nat,
            "coordinator": bench_coordinator, "convergence": bench_convergence, "abuse": bench_abuse,
            "copies": bench_copies, "chaos": bench_chaos}


def _add_codec_commands(sub) -> None:
    codec = sub.add_parser("codec", help="inspect and evaluate the activation/gradient codecs")
    csub = codec.add_subparsers(dest="codec_cmd", required=True)
    ev = csub.add_parser(
        "eval",
        help="encode+decode a stored tensor and report bits/element, SQNR, error and timings",
        description="Encode and decode a tensor (.pt holding one tensor of shape (..., C), or "
        ".safetensors) with one codec; report bits per element of the whole wire message (header "
        "included), SQNR in dB, max abs error, encode/decode time and device. aqsgd reports the "
        "second visit of the same samples; amaq reports untrained gates at the end of its schedule.",
    )
    ev.add_argument("file", help="tensor file: .pt (torch.save of one tensor) or .safetensors")
    ev.add_argument("--codec", required=True, choices=sorted(CODECS), help="codec to evaluate")
    ev.add_argument("--param", action="append", metavar="K=V",
                    help="codec parameter, repeatable (e.g. --param rho=0.7)")
    ev.add_argument("--key", help="tensor name inside a .safetensors file (or dict .pt) holding several")
    ev.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    ev.add_argument("--repeat", type=int, default=3, help="timed repetitions after one warm-up (median reported)")
    ev.add_argument("--drift", type=float, default=0.1,
                    help="aqsgd only: change of the activations between visits, in std units")
    ev.add_argument("--json", action="store_true",
                    help="print one JSON object instead of text (sqnr_db is null for an exact reconstruction)")


def _add_tls_flags(p, what: str) -> None:
    from .config import TlsMode

    p.add_argument("--tls", default=TlsMode.AUTO.value, choices=[m.value for m in TlsMode],
                   help=f"{what}; auto (default): on unless the address is loopback; on: loopback too")
    p.add_argument("--insecure", action="store_true", help="no TLS (same as --tls off): traffic travels in clear, "
                   "readable by anyone on the path; the token and signatures still authenticate every message")


def _tls_mode(args):
    from .config import TlsMode

    if args.insecure and args.tls == TlsMode.ON.value:
        raise ValueError("--insecure and --tls on contradict each other: give one")
    return TlsMode.OFF if args.insecure else TlsMode(args.tls)


def _add_export_command(sub) -> None:
    ex = sub.add_parser("export", help="write a trained swarm's model as a Hugging Face checkpoint folder",
                        description="Merge every stage's checkpoint of one step (the newest that every stage has, or "
                        "--step) from the coordinator's --store (or a folder of stage checkpoints) into OUT: sharded "
                        "safetensors with their index, config.json, generation_config.json and the run's tokenizer "
                        "files; transformers' AutoModelForCausalLM.from_pretrained(OUT) loads it.")
    ex.add_argument("--checkpoint-dir", required=True, help="the coordinator's --store, one of its run-* folders, or a "
                    "folder of stageK-ofN-stepS.safetensors files")
    ex.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    ex.add_argument("--step", type=int, help="the step to export (default: the newest every stage has)")
    ex.add_argument("--shard-mb", type=float, default=2048, help="largest safetensors shard in MB (default 2048)")


def _export(args) -> int:
    from .tools.hf_export import export

    done = export(args.checkpoint_dir, args.out, args.step, int(args.shard_mb * 2**20))
    print(f"exported step {done.step} of {done.stages} stages to {done.out}: {done.tensors} tensors, "
          f"{done.bytes / 2**20:.1f} MB in {done.shards} shard(s)"
          + ("; tokenizer files copied" if done.tokenizer
             else "; no tokenizer files (byte-level data, or not on this machine)"))
    return 0


def _add_p2p_flags(p, listen: str, node: bool) -> None:
    g = p.add_argument_group("p2p (libp2p through hivemind; needs pip install 'tahnode[p2p]')")
    g.add_argument("--p2p-listen", action="append", metavar="MULTIADDR",
                   help=f"multiaddr the p2p daemon listens on, repeatable (default {listen})")
    g.add_argument("--initial-peers", action="append", default=[], metavar="MULTIADDR",
                   help="a peer already in the swarm's DHT (the coordinator prints its own), repeatable" +
                   ("; without --coordinator the node finds the coordinator through it" if node else ""))
    g.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                   help="public multiaddr to announce instead of the ones the daemon sees (e.g. behind port "
                   "forwarding); a process that announces relays for volunteers behind NAT")
    g.add_argument("--use-relay", action=argparse.BooleanOptionalAction, default=True,
                   help="may reach peers (and be reached) through circuit relays (default: yes, as in hivemind)")
    g.add_argument("--use-auto-relay", action="store_true",
                   help="behind NAT: reserve a slot on a public peer that relays, so that neighbours can dial in")


def _p2p_settings(args, listen: str):
    from .config.node import P2PSettings

    return P2PSettings(listen=args.p2p_listen or [listen], announce=args.announce, initial_peers=args.initial_peers,
                       use_relay=args.use_relay, use_auto_relay=args.use_auto_relay)


def _add_swarm_commands(sub) -> None:
    from .config import TransportKind
    from .config.token import TOKEN_ENV

    co = sub.add_parser("coordinator", help="run the swarm's coordinator (control plane + status page)",
                        description="Run the coordinator: nodes join it, it tells each its stage and neighbours, "
                        "tracks heartbeats and serves the status page (/), /api/v1/state and /metrics.")
    co.add_argument("--listen", default="0.0.0.0:7000", help="control-plane gRPC address (default 0.0.0.0:7000)")
    co.add_argument("--transport", default="grpc", choices=["grpc", "p2p", "both"],
                    help="where nodes reach the control plane: gRPC on --listen, libp2p (with a DHT that volunteers "
                    "find it through), or both (default grpc)")
    co.add_argument("--http", default="0.0.0.0:8080", help="status page address (default 0.0.0.0:8080)")
    co.add_argument("--token-file", help=f"file holding the swarm secret every node must present (or set {TOKEN_ENV}); "
                    "without either, the coordinator makes a random one, keeps it in --store as 'token' and prints it")
    co.add_argument("--token", help="the swarm secret itself (other local users can read it on the command line: "
                    "prefer --token-file)")
    co.add_argument("--heartbeat-timeout", type=float, default=10.0,
                    help="seconds without heartbeats before a node is declared failed")
    co.add_argument("--store", default="tahnode-store",
                    help="directory of the stage checkpoints nodes upload (for standbys)")
    co.add_argument("--settle", type=float, default=3.0,
                    help="seconds without new joins before --stage auto nodes are placed")
    co.add_argument("--probe-wait", type=float, default=4.0,
                    help="then, before the first chain, at most this many seconds "
                    "for the nodes' small capacity probes and the full probes of the planned chain's links (default 4)")
    co.add_argument("--rebalance-every", type=float, default=30.0, help="seconds between rebalancing checks while "
                    "training: --stage auto nodes move when a fully probed plan is faster by --hysteresis "
                    "(0 = never; default 30)")
    co.add_argument("--hysteresis", type=float, default=0.2, help="share by which a new chain must cut the bottleneck "
                    "to replace the current one (default 0.2)")
    _add_tls_flags(co, "the control plane: TLS with a self-signed certificate kept in --store "
                   "(`tahnode certs` shows it)")
    _add_p2p_flags(co, COORDINATOR_P2P_LISTEN, node=False)
    add_run_flags(co)

    jo = sub.add_parser("join", help="join a swarm and hold one pipeline stage",
                        description="Run a stage daemon: join the coordinator, hold the assigned stage on this "
                        "machine's GPU (or CPU), exchange activations and gradients with the neighbour stages.")
    jo.add_argument("--coordinator", default="", help="coordinator HOST:PORT, or its p2p multiaddr (default: found "
                    "through --initial-peers, else 127.0.0.1:7000)")
    jo.add_argument("--stage", default="auto", help="stage number to hold, or 'auto' to let the coordinator choose")
    jo.add_argument("--listen", default="0.0.0.0:0", help="data-plane address to serve on (default: any port)")
    jo.add_argument("--advertise", default="", help="HOST:PORT other nodes reach this one at (default: from --listen)")
    jo.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda when available)")
    jo.add_argument("--token-file", help=f"file holding the swarm secret the coordinator printed (or set {TOKEN_ENV})")
    jo.add_argument("--token", help="the swarm secret itself (other local users can read it on the command line: "
                    "prefer --token-file)")
    jo.add_argument("--node-id", default="", help="this node's name, kept in its folder on its first start (default: "
                    "the one the folder keeps, else HOSTNAME-PID); a folder that keeps another id is an error")
    jo.add_argument("--checkpoint-dir", default="",
                    help="this node's folder: its stage's checkpoints, its key and its id (default: "
                    "tahnode-state/NODE_ID); started again with it, the node is the same node to the coordinator")
    jo.add_argument("--data-dir", default="",
                    help="where stage 0 prepares the built-in corpus (default ~/.cache/tahnode)")
    jo.add_argument("--init-from", default="",
                    help="local Hugging Face Llama/Qwen2 checkpoint directory to load this stage's weights from; its "
                    "config.json must describe the run's model (a field that differs is an error naming it)")
    jo.add_argument("--transport", default=TransportKind.GRPC.value, choices=[k.value for k in TransportKind],
                    help="data-plane transport to the neighbour stages (default grpc: every node reachable at "
                    "--advertise; p2p: libp2p, reachable behind NAT with --use-auto-relay)")
    jo.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: every core; give each of "
                    "several stages on one machine its share, as `tahnode demo` and `tahnode swarm up` do)")
    jo.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    _add_tls_flags(jo, "this node's data plane: TLS with a self-signed certificate kept beside its checkpoints, which "
                   "the coordinator hands to its neighbours")
    jo.add_argument("--coordinator-fingerprint", default="", metavar="sha256:HEX",
                    help="the coordinator's TLS certificate, as its start-up line and `tahnode certs` show it; without "
                    "it the node trusts the certificate it sees first and refuses any other later")
    em = jo.add_argument_group("emulated network (for test swarms; `tahnode swarm up` sets these)")
    em.add_argument("--emulate-rtt", default="", metavar="DURATION",
                    help="add this round-trip time (e.g. 50ms) to every message this node exchanges, data and control: "
                    "each message waits half of it before it leaves (in user space; TCP's own "
                    "acknowledgements are not delayed)")
    em.add_argument("--emulate-rate", default="", metavar="RATE",
                    help="pace every outgoing link at this rate (e.g. 20mbit), in user space: for "
                    "machines where tc cannot shape")
    em.add_argument("--emulate-link", action="append", default=[], metavar="PEER=RATE",
                    help="another rate for the link to one peer node id (e.g. n3=10mbit), repeatable")
    _add_p2p_flags(jo, NODE_P2P_LISTEN, node=True)
    jo.add_argument("--log-level", default="INFO", help="logging level (default INFO)")

    de = sub.add_parser("demo", help="the whole swarm on this machine: coordinator + stage daemons on 127.0.0.1",
                        description="Start a coordinator and one stage daemon per stage as real processes on 127.0.0.1 "
                        "(tiny LLaMA, built-in stdlib corpus, TAH-Quant), train, and print a summary.")
    add_run_flags(de)
    de.add_argument("--http-port", type=int, default=8080, help="status page port (default 8080; 0 = any free port)")
    de.add_argument("--workdir", default="", help="logs and checkpoints go here (default: a new temporary directory)")
    de.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    de.add_argument("--device", default="cpu",
                    help="where every stage computes: cpu (default), cuda or cuda:N (the stages share that GPU; "
                    "activations and gradients are quantized there by the Triton kernels)")

    da = sub.add_parser("data", help="prepare training data")
    dsub = da.add_subparsers(dest="data_cmd", required=True)
    pr = dsub.add_parser("prepare", help="tokenize text files or a built-in corpus into a token file for training",
                         description="Tokenize text (byte-level by default, or with a tokenizer.json) into a flat "
                         "uint16/uint32 token file plus a JSON index. Without --input: Python's stdlib sources, "
                         "or the corpus --corpus names.")
    data_prepare.add_flags(pr)

    be = sub.add_parser("bench", help="benchmarks (results appended to docs/benchmarks-log.md)")
    bsub = be.add_subparsers(dest="bench_cmd", required=True)
    for name, text in BENCHES.items():  # each parses its own flags (`tahnode bench NAME --help`)
        bsub.add_parser(name, help=text, add_help=False).add_argument("rest", nargs=argparse.REMAINDER)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tahnode",
        description="Train LLMs across volunteers' GPUs over slow links: each daemon holds one pipeline "
        "stage, activations travel TAH-Quant compressed.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_codec_commands(sub)
    _add_swarm_commands(sub)
    add_certs_command(sub)
    _add_export_command(sub)
    from .tools import swarm_cli
    swarm_cli.add_parser(sub)
    sub.add_parser("compose", add_help=False, help="the docker compose swarm on this machine: up, down, base, wheels "
                   "(tahnode compose --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # each its own parser (REMAINDER drops leading --flags)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHES:
        return bench_modules()[argv[1]].main(argv[2:])
    if argv[:1] == ["compose"]:  # its own parser too
        from .tools import compose
        return compose.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "codec" and args.codec_cmd == "eval":
            from .tools import codec_eval
            return codec_eval.main(args)
        if args.command == "coordinator":
            return _coordinator(args)
        if args.command == "join":
            return _join(args)
        if args.command == "demo":
            from .tools import demo
            return demo.main(args, run_config_from(args))
        if args.command == "data":
            return data_prepare.main(args)
        if args.command == "export":
            return _export(args)
        if args.command == "certs":
            return run_certs(args)
        if args.command == "swarm":
            from .tools import swarm_cli
            return swarm_cli.main(args)
    except (CodecError, ValueError, OSError) as exc:
        print(f"tahnode: error: {exc}", file=sys.stderr)
        return 2
    except P2PError as exc:
        print(f"tahnode: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


def _setup_logging(level: str = "INFO") -> None:
    import logging

    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("asyncio").setLevel(logging.WARNING)


def _say_token(token, listen: str) -> None:
    """Tell the operator about the coordinator's token: a warning for --token, the secret and the
    join command for one it made (or made earlier)."""
    from .config.token import TOKEN_ENV, TokenOrigin

    if token.warning:
        print(f"tahnode coordinator: warning: {token.warning}", file=sys.stderr, flush=True)
    if token.origin in (TokenOrigin.GENERATED, TokenOrigin.STORED):
        made = "made a new" if token.origin is TokenOrigin.GENERATED else "uses the"
        print(f"tahnode coordinator: {made} swarm token, kept in {token.path} (readable by you only); give it to the "
              f"volunteers you trust, who join with\n  {TOKEN_ENV}={token.secret} tahnode join --coordinator "
              f"{listen.replace('0.0.0.0', 'THIS_HOST')} --stage N", flush=True)


def _coordinator(args) -> int:
    from pathlib import Path

    from .config import CoordinatorConfig, PlacementSettings, TransportKind
    from .config.token import coordinator_token
    from .coordinator.server import serve
    from .train.data import check_run_data

    _setup_logging()
    run = run_config_from(args)
    check_run_data(run, here=False)  # data that does not fit the model: refused before anyone joins
    placement = PlacementSettings(settle_s=args.settle, probe_wait_s=args.probe_wait, rebalance_s=args.rebalance_every,
                                  hysteresis=args.hysteresis)  # bad values fail here, before any file is made
    token = coordinator_token(args.token, args.token_file, Path(args.store))
    _say_token(token, args.listen)
    transports = ((TransportKind.GRPC, TransportKind.P2P) if args.transport == "both"
                  else (TransportKind(args.transport),))
    cfg = CoordinatorConfig(listen=args.listen, http=args.http, token=token.secret,
                            heartbeat_timeout=args.heartbeat_timeout,
                            store=args.store, tls=_tls_mode(args), transports=transports,
                            placement=placement,
                            p2p=_p2p_settings(args, COORDINATOR_P2P_LISTEN))
    use_fast_event_loop()
    asyncio.run(serve(run, cfg))
    return 0


def _join(args) -> int:
    from .config import AUTO_STAGE, LinkEmulation, NodeConfig, TransportKind
    from .config.token import TOKEN_ENV, TokenMissing, resolve_token
    from .daemon.device import DeviceUnavailable
    from .daemon.folder import FolderError
    from .daemon.node import run_node
    from .net.errors import CoordinatorError

    _setup_logging(args.log_level)
    if args.stage != "auto" and not args.stage.isdigit():
        raise ValueError(f"--stage must be a stage number or 'auto', got {args.stage!r}")
    if args.coordinator_fingerprint and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", args.coordinator_fingerprint):
        raise ValueError(f"--coordinator-fingerprint must be sha256: and 64 hex digits, as `tahnode certs` shows it; "
                         f"got {args.coordinator_fingerprint!r}")
    token = resolve_token(args.token, args.token_file)
    if token is None:
        raise TokenMissing(f"no swarm token: give --token-file FILE or set {TOKEN_ENV} (the coordinator printed it "
                           "when it started, and keeps it in its store folder as 'token')")
    if token.warning:
        print(f"tahnode join: warning: {token.warning}", file=sys.stderr, flush=True)
    cfg = NodeConfig(coordinator=args.coordinator, stage=AUTO_STAGE if args.stage == "auto" else int(args.stage),
                     listen=args.listen,
                     advertise=args.advertise, device=args.device, token=token.secret, node_id=args.node_id,
                     checkpoint_dir=args.checkpoint_dir, data_dir=args.data_dir, init_from=args.init_from,
                     progress=not args.quiet, threads=args.threads, transport=TransportKind(args.transport),
                     tls=_tls_mode(args), coordinator_fingerprint=args.coordinator_fingerprint,
                     emulation=LinkEmulation.parse(args.emulate_rtt, args.emulate_rate, args.emulate_link),
                     p2p=_p2p_settings(args, NODE_P2P_LISTEN))
    use_fast_event_loop()
    try:
        return asyncio.run(run_node(cfg))
    except (CoordinatorError, DeviceUnavailable, P2PError, FolderError) as exc:
        print(f"tahnode join: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
