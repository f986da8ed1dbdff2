"""``switchml bench soak`` (``cli/bench/soak.py``): config, loss check, exit status."""

from __future__ import annotations

import json

import pytest

from switchml.bench import soak as library
from switchml.bench.soak import SoakConfig, SoakReport
from switchml.cli import main
from switchml.cli.bench import soak


def test_flags_become_the_soak_config(parse):
    args = parse("bench", "soak")
    assert args.func is soak.run
    assert soak.config_from_args(args) == SoakConfig(duration_s=60.0, jobs=3, workers=2,
                                                     loss_rate=0.01, churn_interval_s=5.0)
    assert soak.config_from_args(parse(
        "bench", "soak", "--duration-s", "2", "--jobs", "1", "--workers", "3", "--loss", "0",
        "--churn-interval-s", "1", "--seed", "4")) == SoakConfig(
        duration_s=2.0, jobs=1, workers=3, loss_rate=0.0, churn_interval_s=1.0, seed=4)


@pytest.mark.parametrize("loss", ["1", "-0.1"])
def test_a_loss_rate_outside_0_1_is_refused(loss, capsys):
    assert main(["bench", "soak", "--loss", loss]) == 2
    assert f"--loss must be in [0, 1), got {float(loss)}" in capsys.readouterr().err


@pytest.mark.parametrize("wrong,status", [(0, 0), (2, 1)])
def test_a_wrong_result_fails_the_run(wrong, status, record, tmp_path, capsys):
    report = SoakReport(config={}, operations=10, wrong_results=wrong, errors=1,
                        error_samples=["worker 1 killed"], memory=[(0.0, 2**20), (1.0, 2**21)])
    run = record(library, "run_soak", report)
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--jobs", "1", "--json", str(out)]) == status
    assert run.args[0].jobs == 1
    captured = capsys.readouterr()
    assert "1.0 / 2.0 / 2.0" in captured.out and "error sample: worker 1 killed" in captured.err
    assert json.loads(out.read_text())["wrong_results"] == wrong
