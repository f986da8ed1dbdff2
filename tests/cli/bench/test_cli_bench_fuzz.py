"""``switchml bench fuzz`` (``cli/bench/fuzz.py``): config and exit status."""

from __future__ import annotations

import pytest

from switchml.bench import soak as library
from switchml.bench.soak import FuzzConfig
from switchml.cli import main
from switchml.cli.bench import fuzz


def test_flags_become_the_fuzz_config(parse):
    args = parse("bench", "fuzz")
    assert args.func is fuzz.run
    assert fuzz.config_from_args(args) == FuzzConfig()
    assert fuzz.config_from_args(parse("bench", "fuzz", "--datagrams", "10", "--senders", "1",
                                       "--rate", "0", "--no-secret", "--joins")) == FuzzConfig(
        datagrams=10, senders=1, rate_per_sender=0.0, secret=False, joins=True)


def _report(**bad: object) -> dict:
    return {"datagrams_sent": 10, "seconds": 1.0, "switch_packets_in": 12,
            "internal_errors": 0, "legit_operations": 3, "legit_wrong_results": 0,
            "legit_errors": [], "memory": [(0.0, 2**20)], "jobs_at_end": 0,
            "drops": {"short": 7, "bad_job": 3}, "flood_datagrams_per_s": 4000.0,
            "legit_elements_per_s_alone": 2e6, "legit_elements_per_s_during": 1.5e6, **bad}


@pytest.mark.parametrize("bad,status", [({}, 0), ({"internal_errors": 1}, 1),
                                        ({"legit_errors": ["timeout"]}, 1)])
def test_any_harm_to_the_legitimate_job_fails_the_run(bad, status, record, capsys):
    run = record(library, "run_fuzz", _report(**bad))
    assert main(["bench", "fuzz", "--datagrams", "10"]) == status
    assert run.args[0].datagrams == 10
    out = capsys.readouterr().out
    assert out.index("drops: short") < out.index("drops: bad_job")  # most first
    assert "2,000,000 / 1,500,000 (0.75x)" in out
