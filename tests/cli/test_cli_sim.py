"""``switchml sim`` (``cli/sim.py``): the SimConfig of each run of a sweep, and a real run."""

from __future__ import annotations

import pytest

from switchml.cli import main, sim
from switchml.protocol.errors import ConfigError


def test_flags_become_a_config_per_workers_and_loss(parse):
    args = parse("sim", "--size", "1MiB", "--rate-mbit", "100", "--spine-rate-mbit", "400",
                 "--delay-us", "5", "--mtu", "9000", "--window", "8", "--host-cost-us", "2",
                 "--switch-delay-us", "1", "--stragglers", "1", "--straggler-slowdown", "3",
                 "--straggler-delay-ms", "4", "--seed", "9", "--nack-gap", "0",
                 "--fail-link", "worker:1@0.5")
    assert args.func is sim.run
    cfg = sim.config_from_args(args)(8, 0.01)
    assert (cfg.workers, cfg.size_bytes, cfg.mtu, cfg.window, cfg.seed, cfg.nack_gap) == (
        8, 1 << 20, 9000, 8, 9, 0)
    assert cfg.access.rate_bps == 100e6 and cfg.access.loss_rate == 0.01
    assert cfg.access.delay_s == pytest.approx(5e-6)
    assert cfg.spine is not None and cfg.spine.rate_bps == 400e6
    assert cfg.host_cost_s == pytest.approx(2e-6) and cfg.switch_delay_s == pytest.approx(1e-6)
    assert (cfg.stragglers.count, cfg.stragglers.slowdown) == (1, 3.0)
    assert len(cfg.failures) == 1


def test_rack_size_makes_racks_once_n_exceeds_it(parse):
    config = sim.config_from_args(parse("sim", "--rack-size", "4"))
    assert config(4, 0.0).racks == 1 and config(16, 0.0).racks == 4
    with pytest.raises(ConfigError, match="--rack-size 4 does not divide n = 6"):
        config(6, 0.0)


def test_bad_values_are_refused(parse, capsys):
    with pytest.raises(ConfigError, match="--queue-ms > 0"):
        sim.config_from_args(parse("sim", "--queue-ms", "0"))
    with pytest.raises(SystemExit):
        parse("sim", "--racks", "2", "--rack-size", "4")
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_small_run_prints_its_row(capsys):
    assert main(["sim", "-n", "2", "--size", "64KiB", "--quiet"]) == 0
    out = capsys.readouterr().out
    header, rule, row = out.strip().splitlines()[-3:]
    assert header.split()[:4] == ["mode", "n", "racks", "size"] and "ATE/s" in header
    assert row.split()[:4] == ["timing", "2", "1", "65536"] and row.split()[-1] == "ok"
