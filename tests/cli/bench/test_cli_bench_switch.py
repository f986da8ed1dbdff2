"""``switchml bench switch`` (``cli/bench/switch.py``): config and interruption (the measurement
itself: tests/bench/test_switchcap.py)."""

from __future__ import annotations

from switchml.bench import switchcap as library
from switchml.bench.switchcap import SwitchCapConfig
from switchml.cli import main
from switchml.cli.bench import switch


def test_flags_become_the_capacity_config(parse):
    args = parse("bench", "switch")
    assert args.func is switch.run
    assert switch.config_from_args(args) == SwitchCapConfig()
    assert switch.config_from_args(parse(
        "bench", "switch", "-n", "2", "-k", "358", "-w", "16", "--seconds", "1",
        "--no-batching", "--shards", "2", "--generators", "1")) == SwitchCapConfig(
        workers=2, elements_per_packet=358, window=16, seconds=1.0, batching=False, shards=2,
        generators=1)


def test_an_interrupted_run_says_what_it_stopped(record, capsys):
    record(library, "run_switchcap", KeyboardInterrupt())
    assert main(["bench", "switch", "--seconds", "1"]) == 130
    assert "interrupted; the switch and the generator were stopped" in capsys.readouterr().err
    record(library, "run_switchcap", KeyboardInterrupt())
    assert main(["bench", "switch", "--shards", "2"]) == 130
    assert "the shards and the generators were stopped" in capsys.readouterr().err
