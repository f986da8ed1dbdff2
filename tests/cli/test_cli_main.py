"""The ``switchml`` command as a whole (``cli/__init__.py``, ``cli/registry.py``): help texts,
argument errors, the registry of commands and the dispatch to their runners."""

from __future__ import annotations

import argparse
import importlib

import pytest

from switchml.cli import build_parser, main, registry, stats


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
    assert "must be HOST:PORT (or a comma-separated list of a sharded switch's shards), " \
           "got 'nohostport'" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["no-such-command"])
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


def test_an_os_error_is_one_line_not_a_traceback(tmp_path, capsys):
    """A file that is not there (or a host that does not resolve) is the user's to fix: one
    line and exit status 2, as for any bad argument."""
    missing = tmp_path / "no-such.json"
    assert main(["sim", "--quiet", "--compare", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"switchml: error: [Errno 2] No such file or directory: '{missing}'" in err
    assert main(["predict", "--against", str(missing)]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every runnable command: those without subcommands."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, (*path, name))


def test_every_command_has_its_own_runner_in_its_own_module():
    leaves = dict(_leaves(build_parser()))
    assert ("bench", "geo") in leaves and ("ps", "server") in leaves and ("sim",) in leaves
    handlers = [p.get_default("func") for p in leaves.values()]
    assert all(callable(h) and h.__name__.startswith("run") for h in handlers)
    assert len(set(handlers)) == len(handlers)
    for path, parser in leaves.items():
        reg = registry.BENCH_COMMANDS if path[0] == "bench" else registry.COMMANDS
        assert parser.get_default("func").__module__ == reg[path[-1] if path[0] == "bench"
                                                           else path[0]], path


def test_the_registry_orders_the_commands():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(registry.COMMANDS)
    bench = next(a for a in sub.choices["bench"]._actions
                 if isinstance(a, argparse._SubParsersAction))
    assert list(bench.choices) == list(registry.BENCH_COMMANDS)
    for module in (*registry.COMMANDS.values(), *registry.BENCH_COMMANDS.values()):
        assert callable(importlib.import_module(module).add_parser), module


def test_an_unknown_command_module_names_the_known_ones():
    assert registry.command_module(registry.COMMANDS, "stats") is stats
    with pytest.raises(ValueError, match="unknown command 'nope'; known: switch, demo, stats"):
        registry.command_module(registry.COMMANDS, "nope")


def test_main_dispatches_to_the_bound_runner(monkeypatch, capsys):
    seen = []

    def fake_stats(args: argparse.Namespace) -> int:
        seen.append(args.once)
        return 7

    monkeypatch.setattr(stats, "run", fake_stats)
    assert main(["stats", "--once"]) == 7 and seen == [True]

    def failing(args: argparse.Namespace) -> int:
        raise RuntimeError("it broke")

    from switchml.cli.bench import plot
    monkeypatch.setattr(plot, "run", failing)
    assert main(["bench", "plot", "x.json"]) == 2
    assert "switchml: error: it broke" in capsys.readouterr().err


def test_the_log_level_may_come_from_the_environment(monkeypatch, parse):
    assert parse("stats").log_level == "info"
    monkeypatch.setenv("SWITCHML_LOG_LEVEL", "debug")
    assert parse("stats").log_level == "debug"


def test_python_m_switchml_and_the_console_script_run_main(run_switchml):
    from importlib.metadata import entry_points

    from switchml import __version__
    (script,) = entry_points(group="console_scripts", name="switchml")
    assert script.load() is main
    res = run_switchml("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"switchml {__version__}"


def test_library_errors_name_fields_and_the_command_line_names_options(capsys):
    """The library's config names its own field; the same error through ``switchml`` names
    the option that sets it; a field no option sets keeps the library's name."""
    from switchml.bench.allreduce import BenchConfig
    from switchml.cli import as_options
    with pytest.raises(ValueError, match=r"^BenchConfig\.workers must be >= 1, got 0$"):
        BenchConfig(workers=0)
    assert main(["bench", "allreduce", "--workers", "0"]) == 2
    assert "switchml: error: --workers must be >= 1, got 0" in capsys.readouterr().err
    assert main(["switch", "--shards", "-1", "--port", "0", "--metrics-port", "0"]) == 2
    assert "switchml: error: --shards must be >= 0, got -1" in capsys.readouterr().err
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    allreduce = bench._subparsers._group_actions[0].choices["allreduce"]  # type: ignore[union-attr]
    assert as_options("BenchConfig.iters and TrainBenchConfig.kill_switch_at and "
                      "BenchConfig.no_such_field", [allreduce]) == \
        "--iters and TrainBenchConfig.kill_switch_at and BenchConfig.no_such_field"


@pytest.mark.parametrize("argv,message", [
    (["bench", "geo", "--wan-rtt-ms", "20000"], "--wan-rtt-ms must be 0 to 10 s (10000 ms), got "
                                                "20000 ms"),
    (["bench", "geo", "--target", "95"], "--target must be an accuracy in (0, 1]"),
    (["bench", "train", "--switch-back-after", "5"], "--switch-back-after needs --kill-switch-at"),
])
def test_fields_whose_option_is_named_otherwise_still_read_as_the_option(argv, message, capsys):
    assert main(argv) == 2
    assert f"switchml: error: {message}" in capsys.readouterr().err
