"""The commands of ``switchml``, by name: the module that defines each (as pip's registry).

A command module has ``add_parser(sub)``, which adds its parser to the subparsers ``sub`` and
binds its runner with ``set_defaults(func=run)``; a runner takes the parsed arguments and
returns the exit status. The order here is the order of ``switchml --help``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

from switchml.cli.common import Subparsers

__all__ = ["BENCH_COMMANDS", "COMMANDS", "add_commands", "command_module"]

COMMANDS: Mapping[str, str] = {
    "switch": "switchml.cli.switch",
    "demo": "switchml.cli.demo",
    "stats": "switchml.cli.stats",
    "top": "switchml.cli.top",
    "testbed": "switchml.cli.testbed",
    "bench": "switchml.cli.bench",
    "predict": "switchml.cli.predict",
    "plan": "switchml.cli.plan",
    "calibrate": "switchml.cli.calibrate",
    "ps": "switchml.cli.ps",
    "sim": "switchml.cli.sim",
    "tls": "switchml.cli.tls",
    "job-key": "switchml.cli.jobkey",
}
"""``switchml COMMAND``: the module of each command."""

BENCH_COMMANDS: Mapping[str, str] = {
    "allreduce": "switchml.cli.bench.allreduce",
    "train": "switchml.cli.bench.train",
    "plot": "switchml.cli.bench.plot",
    "soak": "switchml.cli.bench.soak",
    "fuzz": "switchml.cli.bench.fuzz",
    "switch": "switchml.cli.bench.switch",
    "geo": "switchml.cli.bench.geo",
}
"""``switchml bench BENCH``: the module of each benchmark."""


def command_module(registry: Mapping[str, str], name: str) -> ModuleType:
    """The module of command ``name``.

    Raises:
        ValueError: no such command, listing the known ones.
    """
    try:
        return importlib.import_module(registry[name])
    except KeyError:
        raise ValueError(f"unknown command {name!r}; known: {', '.join(registry)}") from None


def add_commands(sub: Subparsers, registry: Mapping[str, str]) -> None:
    """Add every command of ``registry`` to ``sub``, in order."""
    for name in registry:
        command_module(registry, name).add_parser(sub)
