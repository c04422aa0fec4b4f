"""A setting of a run-configuration table ([train], [swarm]) with what its command-line flag says:
tahnode.config.flags makes one flag per such field, its metadata the flag's --help."""

from __future__ import annotations

from dataclasses import field
from typing import Callable

__all__ = ["knob"]


def knob(default, help: str, flag: str = "", choices: tuple = (), metavar: str = "", parse: Callable | None = None):
    """A dataclass field with its flag's help, name (default --field-name), choices and metavar;
    `parse` turns a flag's or TOML file's value into the field's (e.g. "auto" into 0)."""
    return field(default=default,
                 metadata={"help": help, "flag": flag, "choices": choices, "metavar": metavar, "parse": parse})
