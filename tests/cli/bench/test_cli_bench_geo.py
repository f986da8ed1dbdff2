"""``switchml bench geo`` (``cli/bench/geo.py``): config, runner call and its table."""

from __future__ import annotations

from switchml.bench import geo as library
from switchml.bench import geo_report
from switchml.bench.geo import GeoBenchConfig
from switchml.cli import main
from switchml.cli.bench import geo


def test_flags_become_the_geo_config(parse, capsys):
    args = parse("bench", "geo", "--dcs", "3,1", "--wan-mbit", "10", "--lan-mbit", "100",
                 "--modes", "wan,gaia,", "--steps", "5", "--batch", "4", "--lr", "0.1",
                 "--model", "mlp", "--target", "0.5", "--eval-every", "2", "--threshold",
                 "0.2", "--decay", "--staleness", "1", "--gaia-lr-scale", "0.5",
                 "--dc-backend", "switchml", "--inner-steps", "7", "--outer-lr", "0.5",
                 "--outer-momentum", "0.8", "--outer-bits", "32", "--seeds", "3")
    assert args.func is geo.run
    assert geo.config_from_args(args) == GeoBenchConfig(
        dcs=(3, 1), wan_bps=10e6, lan_bps=100e6, modes=("wan", "gaia"), steps=5, batch=4,
        lr=0.1, model="mlp", eval_every=2, target_accuracy=0.5, threshold=0.2, decay=True,
        staleness=1, gaia_lr_scale=0.5, dc_backend="switchml", inner_steps=7, outer_lr=0.5,
        outer_momentum=0.8, outer_bits=32, seeds=3)
    # the command runs Gaia at the library's defaults, on the model whose settings fit them
    cfg = geo.config_from_args(parse("bench", "geo"))
    import inspect

    from switchml.gaia.trainer import GaiaSync
    lib = inspect.signature(GaiaSync).parameters
    assert (cfg.threshold, cfg.decay) == (lib["threshold"].default, lib["decay"].default)
    assert cfg.modes == ("lan", "wan", "gaia", "diloco")
    assert (cfg.model, cfg.steps, cfg.momentum, cfg.target_accuracy) == ("mf", 800, 0.0, 0.88)
    # a model's settings fill in what the flags leave out; a flag wins
    cfg = geo.config_from_args(parse("bench", "geo", "--model", "cnn", "--momentum", "0.5"))
    assert (cfg.steps, cfg.lr, cfg.momentum, cfg.target_accuracy) == (150, 0.05, 0.5, 0.95)
    cfg = geo.config_from_args(parse("bench", "geo", "--thresholds", "0,0.01,0.3",
                                     "--wan-rtt-ms", "100"))
    assert cfg.thresholds == (0.0, 0.01, 0.3) and cfg.wan_rtt_s == 0.1
    import pytest
    with pytest.raises(SystemExit):
        parse("bench", "geo", "--thresholds", "0.1,lots")
    assert "expected a comma list of numbers such as 0,0.01,0.1, got '0.1,lots'" in \
        capsys.readouterr().err


def test_the_runner_prints_one_line_per_mode(record, capsys):
    rows = [{"mode": "lan", "time_to_target_s": 1.5, "final_accuracy": 0.96,
             "wan_bytes": 0, "comparison": {}},
            {"mode": "gaia", "time_to_target_s": None, "final_accuracy": 0.9,
             "wan_bytes": 2e6, "comparison": {"speedup_vs_wan": 2.0}}]
    run = record(library, "run_geo_bench", rows)
    written = record(geo_report, "write_outputs", ["o/geo.json"])
    assert main(["bench", "geo", "--dcs", "2x2", "--out", "o"]) == 0
    assert run.args[0].dcs == (2, 2) and written.args[2] == "o"
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:4] == ["lan", "1.50", "0.9600", "-"]
    assert lines[2].split()[:5] == ["gaia", "-", "0.9000", "-", "2.00"]
    assert lines[-1] == "o/geo.json"
