"""The ``switchml`` command.

Usage recipes::

    switchml switch                          # a software switch on 127.0.0.1:48864
    switchml stats                           # its live counters (metrics on 127.0.0.1:9109)
    switchml switch --host 0.0.0.0 --secret-file /etc/switchml.secret --pool-slots 8192
    switchml bench allreduce --workers 4 --size 64MiB --json results.json
    switchml bench allreduce --workers 2 --size 1MiB --size 16MiB --switch 127.0.0.1:48864
    switchml bench switch --workers 4 --elements-per-packet 256 --seconds 5   # switch capacity

Definitions: a *job* is one group of n workers (ranks 0..n-1) that all-reduce together; the
switch gives each job a *window* of W aggregation *slots* (each holding k int32 elements in two
*sets*) out of its *pool*. The switch's --host, --port, --pool-slots, --lease-timeout-s,
--secret-file, --metrics-port and --log-level may also come from the environment as
``SWITCHML_<FLAG>`` (e.g. ``SWITCHML_PORT=9000``), and stats' --url as ``SWITCHML_STATS_URL``.

Failure modes: a port in use makes ``switch`` exit with status 2 and the reason; a benchmark
worker that fails or hangs makes ``bench`` exit non-zero within its ``--timeout-s``.

Layout: one module per command (``cli/switch.py``, ``cli/bench/soak.py``, ...), listed by name
in :mod:`switchml.cli.registry`. Each has ``add_parser(sub)``, which builds its parser and binds
its runner with ``set_defaults(func=run)``, and, where the command has options worth a type,
``config_from_args(args)``, which turns them into the library's config (named by field, not by
flag). :func:`main` parses and calls ``args.func(args)``. What is not argument parsing or
printing lives in the library: switches are launched by :mod:`switchml.service`.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence

from switchml import __version__
from switchml.cli.common import env_default
from switchml.cli.registry import COMMANDS, add_commands
from switchml.protocol.errors import SwitchMLError

__all__ = ["as_options", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``switchml`` argument parser, every command's runner bound as ``func``."""
    parser = argparse.ArgumentParser(
        prog="switchml",
        description="In-network aggregation for distributed training: a software SwitchML "
                    "switch, worker library and benchmarks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'switchml COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"switchml {__version__}")
    parser.add_argument("--log-level", default=env_default("log_level", "info"),
                        choices=["debug", "info", "warning", "error"],
                        help="log verbosity (default: info)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub, COMMANDS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``switchml`` command line ``argv`` (default ``sys.argv[1:]``); its exit status:
    the command's, or 2 for bad arguments or an error the command reports."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        status: int = args.func(args)
    except (SwitchMLError, ValueError, RuntimeError, OSError) as exc:
        # (OSError: a file that is not there, a host that does not resolve, a port taken;
        # TimeoutError is one; --log-level debug shows where it came from)
        logging.getLogger("switchml").debug("the command failed", exc_info=True)
        why = str(exc) or type(exc).__name__
        print(f"switchml: error: {as_options(why, _chosen(parser, args))}", file=sys.stderr)
        return 2
    return status


_FIELD = re.compile(r"\b[A-Z]\w*(?:Config|Spec)\.([a-z_][a-z0-9_]*)\b")
_RENAMED = {"target_accuracy": "target", "wan_rtt_s": "wan_rtt_ms",
            "switch_back_after_s": "switch_back_after", "loss_rate": "loss",
            "replace_after_s": "replace_after", "catch_up_steps": "catch_up_after"}
"""Library fields whose option's ``dest`` has another name (a unit in the name, or short)."""


def as_options(message: str, parsers: Sequence[argparse.ArgumentParser]) -> str:
    """``message`` with each library field it names (``BenchConfig.workers``) replaced by the
    option of ``parsers`` that sets it (``--workers``); a field no option sets stays as it is.
    The library's errors name its fields; the command line's user sees its options."""
    flags = {a.dest: next((o for o in a.option_strings if o.startswith("--")),
                          a.option_strings[0])
             for p in parsers for a in p._actions if a.option_strings}
    return _FIELD.sub(lambda m: flags.get(m.group(1)) or flags.get(_RENAMED.get(m.group(1), ""))
                      or m.group(0), message)


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace
            ) -> list[argparse.ArgumentParser]:
    """The parser and the subcommands' parsers ``args`` came through."""
    chain = [parser]
    while True:
        sub = next((a for a in chain[-1]._actions
                    if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, sub.dest, None) if sub is not None else None
        if sub is None or name not in sub.choices:
            return chain
        chain.append(sub.choices[name])


if __name__ == "__main__":
    sys.exit(main())
