"""``switchml bench allreduce`` (``cli/bench/allreduce.py``): loopback and ``--testbed``
configs, the runner's call, and its tables."""

from __future__ import annotations

import pytest
from rich.console import Console

from switchml.bench import allreduce as library
from switchml.bench import testbed as testbed_library
from switchml.bench.allreduce import BenchConfig, Measurement
from switchml.bench.testbed import TestbedBenchConfig
from switchml.cli import main
from switchml.cli.bench import allreduce


def test_loopback_flags_become_the_bench_config(parse):
    args = parse("bench", "allreduce", "-n", "2", "--size", "1MiB", "--size", "4KiB",
                 "--iters", "3", "--warmup", "0", "--switch", "10.0.0.1:9", "--window", "8",
                 "--elements-per-packet", "256", "--bits", "16", "--no-gloo", "--no-batching",
                 "--timeout-s", "30")
    assert args.func is allreduce.run
    assert allreduce.config_from_args(args) == BenchConfig(
        workers=2, sizes_bytes=(1 << 20, 4096), iters=3, warmup=0, switch=(("10.0.0.1", 9),),
        window=8, elements_per_packet=256, bits=16, baselines=(), timeout_s=30.0,
        batching=False)


def test_a_sharded_switch_is_named_by_its_shards_or_started_with_shards(parse):
    args = parse("bench", "allreduce", "--switch", "10.0.0.1:9,10.0.0.2:10", "--mtu", "1500")
    assert allreduce.config_from_args(args).switch == (("10.0.0.1", 9), ("10.0.0.2", 10))
    assert allreduce.config_from_args(parse("bench", "allreduce", "--shards", "3")).shards == 3
    with pytest.raises(ValueError, match="BenchConfig.shards starts the benchmark's own switch"):
        allreduce.config_from_args(parse("bench", "allreduce", "--shards", "2", "--switch",
                                         "10.0.0.1:9"))
    with pytest.raises(ValueError, match="BenchConfig.shards must be >= 1"):
        allreduce.config_from_args(parse("bench", "allreduce", "--shards", "0"))


def test_the_chunk_fits_the_mtu_by_default(parse):
    cfg = allreduce.config_from_args(parse("bench", "allreduce", "--mtu", "1500"))
    assert cfg.elements_per_packet == 358 and cfg.sizes_bytes == (64 << 20,)


def test_testbed_flags_become_the_testbed_config(parse):
    args = parse("bench", "allreduce", "--testbed", "-n", "8", "--rate-mbit", "250",
                 "--loss", "0.001", "--systems", "switchml, gloo", "--fast-retransmit",
                 "--nack-gap", "0")
    assert allreduce.testbed_config_from_args(args) == TestbedBenchConfig(
        workers=8, rate_bps=250e6, loss_rate=0.001, mtu=1500, iters=5, warmup=2,
        systems=("switchml", "gloo"), fast_retransmit=True, nack_gap=0, timeout_s=600.0)


def test_jobs_split_the_workers_and_a_split_that_leaves_a_job_alone_is_refused(parse):
    args = parse("bench", "allreduce", "--testbed", "-n", "8", "--jobs", "2", "--systems",
                 "switchml,gloo")
    cfg = allreduce.testbed_config_from_args(args)
    assert cfg.jobs == 2
    # worker i in job i mod 2, ranks in order within each job (HSDP's shard groups)
    assert [cfg.job_of(i) for i in range(8)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2),
                                                 (1, 2), (0, 3), (1, 3)]
    for workers, jobs, systems in ((8, 3, ("switchml",)), (4, 4, ("switchml",)),
                                   (8, 2, ("switchml", "ps"))):
        with pytest.raises(ValueError, match="jobs"):
            TestbedBenchConfig(workers=workers, jobs=jobs, systems=systems)


def _measurement(system: str, ate: float) -> Measurement:
    return Measurement(system=system, workers=2, size_bytes=1 << 20, numel=1 << 18, iters=1,
                       elapsed_s=1.0, ate_per_s=ate, goodput_gbps=1.0, cpu_percent=[50.0],
                       max_rel_error=0.0)


def test_the_runner_measures_and_prints_switchml_against_gloo(record, tmp_path, capsys):
    run = record(library, "run_benchmark", ([_measurement("switchml", 2e8),
                                             _measurement("gloo", 1e8)], {}))
    written = record(library, "write_json")
    out = str(tmp_path / "r.json")
    assert main(["bench", "allreduce", "-n", "2", "--size", "1MiB", "--json", out]) == 0
    (cfg,) = run.args
    assert (cfg.workers, cfg.sizes_bytes) == (2, (1 << 20,))
    assert written.args[0] == out and written.args[1] is cfg
    text = capsys.readouterr().out
    assert "1 MiB" in text and "2.00" in text  # switchml/gloo


@pytest.mark.parametrize("argv, named", [
    (["--dtype", "float16"], "--dtype"),
    (["--racks", "3", "--csv", "x.csv"], "--racks, --csv"),
    (["--residual"], "--residual"),
    (["--loss", "0.1", "--systems", "switchml"], "--loss, --systems"),
])
def test_a_loopback_run_refuses_the_testbeds_options_by_name(argv, named, record, capsys):
    """They used to be accepted and ignored (a float32 loopback run, exit 0)."""
    from switchml.bench import allreduce as library
    ran = record(library, "run_benchmark", ([], {}))
    assert main(["bench", "allreduce", *argv]) == 2
    assert f"switchml: error: {named}: only with --testbed" in capsys.readouterr().err
    assert not ran.calls  # refused before anything ran


def test_outputs_and_timeouts_are_checked_before_the_run(tmp_path, capsys):
    """A --json or --csv in a directory that is not there, or a timeout of 0, once failed at
    the end of the run (or at its first wait); now the parser or the config says so first."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "allreduce", "--json", str(tmp_path / "missing" / "x.json")])
    assert exc.value.code == 2
    assert f"argument --json: {tmp_path / 'missing' / 'x.json'}: no directory" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "allreduce", "--testbed", "--csv", str(tmp_path / "missing" / "x.csv")])
    assert "argument --csv" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--timeout-s", "0"]) == 2
    assert "--timeout-s must be > 0, got 0.0" in capsys.readouterr().err


def test_the_testbed_runner_fails_on_a_wrong_sum(record):
    rows = [{"system": "switchml", "size_bytes": 1 << 20, "ate_per_s": 1e6,
             "fraction_of_line_rate": 0.5, "bound_ring_ate": 2.0, "bound_line_ate": 3.0,
             "cpu_percent": [10.0], "max_abs_error": 0.5}]
    record(testbed_library, "run_testbed_allreduce", rows)
    write = record(testbed_library, "write_outputs")
    assert main(["bench", "allreduce", "--testbed", "--csv", "x.csv"]) == 1
    assert write.args == (rows, None, "x.csv")


def test_a_degraded_row_is_flagged_in_the_table():
    from switchml.bench.testbed import DEGRADED_NO_ETHTOOL
    row = {"system": "switchml", "size_bytes": 1 << 20, "ate_per_s": 1e6,
           "fraction_of_line_rate": 0.15, "bound_ring_ate": 2.0, "bound_line_ate": 3.0,
           "cpu_percent": [10.0], "worker_cpu_s_per_gelem": 50.0,
           "degraded": DEGRADED_NO_ETHTOOL}
    gloo = {**row, "system": "gloo", "worker_cpu_s_per_gelem": 25.0}
    gloo.pop("degraded")
    console = Console(width=250, record=True)
    console.print(allreduce._testbed_table(TestbedBenchConfig(), 1000, [row, gloo]))
    text = console.export_text()
    assert "switchml (degraded)" in text and "no ethtool" in text
    assert "50.0 (2.00x)" in text


def test_a_bad_bit_width_is_refused(parse, capsys):
    with pytest.raises(SystemExit):
        parse("bench", "allreduce", "--bits", "8")
    assert "invalid choice: 8" in capsys.readouterr().err


def test_the_hooks_residual_is_a_16_bit_testbed_option(parse):
    args = parse("bench", "allreduce", "--testbed", "--bits", "16", "--residual")
    assert allreduce.testbed_config_from_args(args).residual is True
    with pytest.raises(ValueError, match="needs TestbedBenchConfig.bits 16"):
        allreduce.testbed_config_from_args(parse("bench", "allreduce", "--testbed",
                                                 "--residual"))
    with pytest.raises(ValueError, match="--residual: only with --testbed"):
        allreduce.run(parse("bench", "allreduce", "--residual"))
