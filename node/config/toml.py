"""Reading and writing the small TOML documents of tahnode's configuration (presets, run files);
errors name the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["load_toml", "toml_table"]


def load_toml(path: str | Path, what: str = "config file", missing: type[Exception] = ValueError) -> dict:
    """The parsed document; `missing` is raised (naming `what` and the path) if there is no file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise missing(f"{what} {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid TOML: {exc}") from None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def toml_table(name: str, table: dict) -> str:
    """`[name]` followed by one `key = value` line per entry (scalars and inline tables); entries
    that are None (a setting left to its default) are left out."""
    # None: the default
    return f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items() if v is not None)
