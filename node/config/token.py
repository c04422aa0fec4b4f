"""Where the swarm token comes from: `--token-file`, the TAHNODE_TOKEN environment variable, or
`--token` (other local users can read a command line: warned); there is no default secret. A
coordinator given none makes a random token and keeps it in its store folder (`coordinator_token`).
Every secret kept on disk (token, node key, TLS key) is written by `write_secret`."""

from __future__ import annotations

import enum
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["TOKEN_ENV", "TokenOrigin", "SwarmToken", "TokenMissing", "resolve_token", "coordinator_token",
           "new_token_file", "write_secret"]

TOKEN_ENV = "TAHNODE_TOKEN"
TOKEN_FILE_NAME = "token"  # in the coordinator's store folder


class TokenOrigin(enum.Enum):
    FILE = "file"
    ENV = "environment"
    FLAG = "command line"
    STORED = "store"        # made by this coordinator earlier, read back
    GENERATED = "generated"  # made by this coordinator now


class TokenMissing(ValueError):
    """No token was given where one is required (a node), or the given one is unusable."""


@dataclass(frozen=True)
class SwarmToken:
    secret: str
    origin: TokenOrigin
    path: Path | None = None  # where it is kept (FILE, STORED, GENERATED)

    @property
    def warning(self) -> str | None:
        if self.origin is TokenOrigin.FLAG:
            return ("--token puts the swarm secret on the command line, where other users of this machine can read it "
                    f"(/proc/PID/cmdline); prefer --token-file FILE or {TOKEN_ENV}")
        return None


def _read(path: Path) -> str:
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise TokenMissing(f"cannot read the token file {path}: {exc.strerror}") from None
    if not secret:
        raise TokenMissing(f"the token file {path} is empty")
    return secret


def resolve_token(flag: str | None, file: str | None, env: Mapping[str, str] = os.environ) -> SwarmToken | None:
    """The token the user gave, by precedence --token-file, --token, TAHNODE_TOKEN; None if none."""
    if flag and file:
        raise TokenMissing("give the swarm token once: --token-file or --token, not both")
    if file:
        return SwarmToken(_read(Path(file)), TokenOrigin.FILE, Path(file))
    if flag:
        return SwarmToken(flag, TokenOrigin.FLAG)
    if env.get(TOKEN_ENV, "").strip():
        return SwarmToken(env[TOKEN_ENV].strip(), TokenOrigin.ENV)
    return None


def coordinator_token(flag: str | None, file: str | None, store: Path,
                      env: Mapping[str, str] = os.environ) -> SwarmToken:
    """The coordinator's token: the one given, else the one it made earlier in `store`, else a new
    random one written there (readable by its owner only)."""
    given = resolve_token(flag, file, env)
    if given:
        return given
    path = store / TOKEN_FILE_NAME
    if path.exists():
        return SwarmToken(_read(path), TokenOrigin.STORED, path)
    return SwarmToken(_read(new_token_file(path)), TokenOrigin.GENERATED, path)


def new_token_file(path: Path) -> Path:
    """A file at `path` holding a new random token, readable by its owner only (a file already
    there is replaced, never written into)."""
    write_secret(path, (secrets.token_urlsafe(24) + "\n").encode())
    return path


def write_secret(path: Path, data: bytes) -> None:
    """Write `data` to a new file at `path` readable by its owner only (its folder made if need
    be; a file already there is replaced, never written into, so it cannot keep wider rights)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
