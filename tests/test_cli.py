"""The ``switchml`` command: help texts and argument errors."""

from __future__ import annotations

import pytest

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
