"""The ``switchml`` command: help texts and argument errors."""

from __future__ import annotations

import argparse

import pytest

from switchml import cli
from switchml.cli import build_parser, main


@pytest.mark.parametrize("argv,expect", [
    ([], "switch"),
    (["switch"], "--pool-slots"),
    (["bench", "allreduce"], "ATE/s"),
    (["bench", "train"], "network-bound"),
    (["bench", "soak"], "wrong results"),
    (["bench", "fuzz"], "hostile"),
    (["bench", "plot"], "speedup"),
    (["testbed"], "namespace"),
    (["stats"], "counters"),
    (["demo"], "digits"),
])
def test_help_explains(argv, expect, run_switchml):
    res = run_switchml(*argv, "--help")
    assert res.returncode == 0
    assert expect in res.stdout


def test_bad_arguments_say_what_is_wrong(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "allreduce", "--size", "12 parsecs"])
    assert exc.value.code == 2
    assert "bad size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "allreduce", "--switch", "nohostport"])
    assert "must be HOST:PORT, got 'nohostport'" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every runnable command: those without subcommands."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, (*path, name))


def test_every_command_has_its_own_handler():
    leaves = dict(_leaves(build_parser()))
    assert ("bench", "geo") in leaves and ("ps", "server") in leaves and ("sim",) in leaves
    handlers = [p.get_default("func") for p in leaves.values()]
    assert all(callable(h) and h.__name__.startswith("_run_") for h in handlers)
    assert len(set(handlers)) == len(handlers)


def test_main_dispatches_to_the_bound_handler(monkeypatch, capsys):
    seen = []

    def fake_stats(args: argparse.Namespace) -> int:
        seen.append(args.once)
        return 7

    monkeypatch.setattr(cli, "_run_stats", fake_stats)
    assert main(["stats", "--once"]) == 7 and seen == [True]

    def failing(args: argparse.Namespace) -> int:
        raise RuntimeError("it broke")

    monkeypatch.setattr(cli, "_run_bench_plot", failing)
    assert main(["bench", "plot", "x.json"]) == 2
    assert "switchml: error: it broke" in capsys.readouterr().err
