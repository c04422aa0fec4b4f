"""`tahnode compose up|down|base|wheels`: the docker compose swarm of deploy/docker-compose.yml (a
coordinator and three stage nodes) on this machine, with a local Debian base image and host-built
wheels where Docker Hub cannot be reached."""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (tahnode -> node/ in an editable install)
DEPLOY = ROOT / "deploy"
HUB_BASE = "python:3.11-slim"
LOCAL_BASE = "tahnode-base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
PROJECT = "tahnode"
IMAGE_LABEL = "org.opencontainers.image.title=tahnode"  # deploy/Dockerfile's label on every tahnode image


class ComposeError(Exception):
    """What stops `tahnode compose` (said to the user as it is)."""


@dataclass
class ComposeSpec:
    """What `up` builds and starts."""

    project: str = PROJECT
    base: str = ""            # "" = python:3.11-slim if it can be had, else the local Debian base
    torch: str = "torch==2.13.0"
    http_port: int = 8080
    gpu: bool = False
    quiet: bool = False
    env: dict[str, str] = field(default_factory=dict)


def run(cmd: list[str], quiet: bool = False, **kw) -> subprocess.CompletedProcess:
    """A command, its output shown (or captured when `quiet`); ComposeError when it fails."""
    if not quiet:
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=quiet, text=True, **kw)
    if out.returncode != 0:
        detail = (out.stderr or out.stdout or "")[-2000:] if quiet else ""
        raise ComposeError(f"`{' '.join(cmd)}` failed with exit code {out.returncode}{': ' + detail if detail else ''}")
    return out


def check_checkout() -> None:
    if not (DEPLOY / "docker-compose.yml").is_file():
        raise ComposeError(f"no deploy/docker-compose.yml beside this tahnode ({ROOT}): run `tahnode compose` from a "
                           "checkout of the repository (pip install -e .)")


def compose_command() -> list[str]:
    """`docker compose` (v2) where the plugin is there, else `docker-compose` (v1)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise ComposeError("neither `docker compose` nor `docker-compose` is installed (Debian: apt-get install "
                       "docker.io docker-compose)")


def check_engine() -> None:
    if not shutil.which("docker"):
        raise ComposeError("docker is not installed (Debian: apt-get install docker.io docker-compose)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        raise ComposeError("no Docker engine answers: start one (`systemctl start docker`, or `dockerd &` as root "
                           "where there is no service manager)")


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def make_local_base(mirror: str = DEBIAN_MIRROR) -> str:
    """tahnode-base:bookworm: a minimal Debian with python3 and python3-venv, made with debootstrap
    and imported into Docker (kept: later runs reuse it)."""
    if image_exists(LOCAL_BASE):
        return LOCAL_BASE
    if not shutil.which("debootstrap"):
        raise ComposeError("Docker Hub cannot be reached and debootstrap is not installed to make a local base image "
                           "(Debian: apt-get install debootstrap), or give --base IMAGE")
    if os.geteuid() != 0:
        raise ComposeError("making the local base image (debootstrap) needs root; or give --base IMAGE")
    with tempfile.TemporaryDirectory(prefix="tahnode-base-") as tmp:
        print(f"tahnode compose: making {LOCAL_BASE} with debootstrap (about 40 s, once)", file=sys.stderr)
        run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", tmp,
             mirror],
            quiet=True)
        tar = subprocess.Popen(["tar", "-C", tmp, "-c", "."], stdout=subprocess.PIPE)
        run(["docker", "import", "-", LOCAL_BASE], quiet=True, stdin=tar.stdout)
        tar.wait()
    return LOCAL_BASE


def choose_base(spec: ComposeSpec) -> tuple[str, bool]:
    """(base image, whether it is the local Debian one): python:3.11-slim when present or pullable."""
    if spec.base:
        return spec.base, spec.base == LOCAL_BASE
    if image_exists(HUB_BASE):
        return HUB_BASE, False
    try:
        pulled = subprocess.run(["docker", "pull", HUB_BASE], capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        pulled = False
    if pulled:
        return HUB_BASE, False
    print(f"tahnode compose: {HUB_BASE} cannot be pulled (no Docker Hub): using a local Debian base", file=sys.stderr)
    return make_local_base(), True


def build_wheels(torch_req: str, quiet: bool = False, extras: str = "p2p") -> Path:
    """deploy/wheels/: everything tahnode needs (torch included) as wheels, for a build that uses no
    network (the image still builds tahnode itself from the source it copies, so a changed checkout
    is what runs). Built for this machine's Python, which must be the base image's (3.11 on
    bookworm)."""
    out = DEPLOY / "wheels"
    out.mkdir(exist_ok=True)
    index = ["--extra-index-url", "https://download.pytorch.org/whl/cpu"] if "+cpu" in torch_req else []
    run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(out), *index,
         f"{ROOT}[{extras}]" if extras else str(ROOT), torch_req], quiet=quiet)
    return out


def token_file() -> Path:
    """deploy/swarm.env with a fresh TAHNODE_TOKEN, made once (readable by its owner only)."""
    path = DEPLOY / "swarm.env"
    if not path.exists():  # created readable by its owner only: the secret is never visible to others
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(f"TAHNODE_TOKEN={secrets.token_urlsafe(32)}\n")
    return path


def compose(spec: ComposeSpec, *args: str) -> subprocess.CompletedProcess:
    files = ["-f", str(DEPLOY / "docker-compose.yml")] + (["-f", str(DEPLOY / "docker-compose.gpu.yml")] if spec.gpu
                                                          else [])
    env = {**os.environ, "TAHNODE_HTTP_PORT": str(spec.http_port), "TAHNODE_TORCH": spec.torch, **spec.env}
    return run([*compose_command(), *files, "-p", spec.project, *args], quiet=spec.quiet, env=env)


def up(spec: ComposeSpec) -> None:
    check_checkout()
    check_engine()
    base, local = choose_base(spec)
    spec.env["TAHNODE_BASE"] = base
    if local:  # no network in the build: every dependency from wheels made here (gRPC nodes: no p2p extra)
        if sys.version_info[:2] != (3, 11):
            raise ComposeError(f"the local Debian base has Python 3.11, and wheels built by this Python "
                               f"{sys.version_info[0]}.{sys.version_info[1]} would not install there: run tahnode "
                               "compose from a Python 3.11 environment, or give --base an image with this Python")
        spec.env["TAHNODE_EXTRAS"] = ""
        print("tahnode compose: building the wheels of tahnode's dependencies on this machine (deploy/wheels/; "
              "pip's cache makes it quick after the first time)", file=sys.stderr)
        build_wheels(spec.torch, spec.quiet, extras="")
    token_file()
    compose(spec, "build")
    prune_replaced_images(spec.quiet)
    compose(spec, "up", "-d")
    print(f"tahnode compose: the swarm runs; status page http://localhost:{spec.http_port}/ ; stop it with "
          f"`tahnode compose down{' --project ' + spec.project if spec.project != PROJECT else ''}`", file=sys.stderr)


def prune_replaced_images(quiet: bool = False) -> None:
    """Remove the tahnode images a build left untagged (the previous tahnode:latest of a changed
    checkout, about 1 GB each, which docker keeps until pruned); none a container still uses."""
    run(["docker", "image", "prune", "--force", "--filter", f"label={IMAGE_LABEL}"], quiet=quiet)


def down(spec: ComposeSpec, keep_volumes: bool = False) -> None:
    check_checkout()
    check_engine()
    compose(spec, "down", "--remove-orphans", *([] if keep_volumes else ["--volumes"]))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode compose", description=__doc__.split("\n\n")[0].replace("\n", " "))
    sub = ap.add_subparsers(dest="action", required=True)
    u = sub.add_parser("up", help="build the image and start the coordinator and three nodes (detached)")
    u.add_argument("--base", default="", help=f"base image (default {HUB_BASE}; where it cannot be pulled, "
                   f"{LOCAL_BASE}, made with debootstrap as root)")
    u.add_argument("--torch", default="torch==2.13.0",
                   help="torch requirement of the image (default torch==2.13.0, CPU build)")
    u.add_argument("--gpu", action="store_true", help="one NVIDIA GPU per node (deploy/docker-compose.gpu.yml)")
    u.add_argument("--http-port", type=int, default=8080, help="host port of the status page (default 8080)")
    d = sub.add_parser("down", help="stop the swarm; remove its containers, network and volume")
    d.add_argument("--keep-volumes", action="store_true", help="keep the volume with the store and checkpoints")
    sub.add_parser("base", help=f"make {LOCAL_BASE} (debootstrap, root) without starting anything")
    w = sub.add_parser("wheels", help="build deploy/wheels/ (tahnode, torch and their needs) for "
                       "a build without network")
    w.add_argument("--torch", default="torch==2.13.0", help="torch requirement (default torch==2.13.0)")
    for p in (u, d):
        p.add_argument("--project", default=PROJECT, help=f"compose project name (default {PROJECT})")
        p.add_argument("--quiet", action="store_true", help="show the tools' output only when they fail")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.action == "up":
            up(ComposeSpec(project=args.project, base=args.base, torch=args.torch, http_port=args.http_port,
                           gpu=args.gpu, quiet=args.quiet))
        elif args.action == "down":
            down(ComposeSpec(project=args.project, quiet=args.quiet), args.keep_volumes)
        elif args.action == "base":
            check_engine()
            print(make_local_base())
        else:
            print(build_wheels(args.torch))
    except ComposeError as exc:
        print(f"tahnode compose: {exc}", file=sys.stderr)
        return 2
    return 0
