"""A setting of a run-configuration table ([train], [swarm]) with what its command-line flag says:
tahnode.config.flags makes one flag per such field, its metadata the flag's --help."""

from __future__ import annotations

from dataclasses import field
from typing import Callable

__all__ = ["knob", "parse_switch"]

SWITCH = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def knob(default, help: str, flag: str = "", choices: tuple = (), metavar: str = "", parse: Callable | None = None):
    """A dataclass field with its flag's help, name (default --field-name), choices and metavar;
    `parse` turns a flag's or TOML file's value into the field's (e.g. "auto" into 0)."""
    return field(default=default,
                 metadata={"help": help, "flag": flag, "choices": choices, "metavar": metavar, "parse": parse})


def parse_switch(value) -> bool:
    """A switch's value from a flag or a TOML file: a bool, or on/off, true/false, yes/no, 1/0."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in SWITCH:
        raise ValueError(f"a switch is on or off (true/false, yes/no, 1/0), got {value!r}")
    return SWITCH[word]
