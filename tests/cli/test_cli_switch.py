"""``switchml switch`` (``cli/switch.py``): its flags become a ``SwitchSpec`` by field, and the
service runs it; bad combinations fail with exit status 2 and the reason."""

from __future__ import annotations

import pytest

from switchml import service
from switchml.cli import main
from switchml.cli import switch as cmd
from switchml.service import SwitchSpec


@pytest.fixture(autouse=True)
def _no_switch_env(monkeypatch):
    for name in ("PORT", "HOST", "POOL_SLOTS", "LEASE_TIMEOUT_S", "MEMBER_TIMEOUT_S", "NACK_GAP",
                 "SECRET_FILE", "METRICS_PORT", "SECRET", "GSO", "LOG_LEVEL"):
        monkeypatch.delenv(f"SWITCHML_{name}", raising=False)


def test_the_defaults_are_the_services(parse):
    args = parse("switch")
    assert args.func is cmd.run
    assert cmd.config_from_args(args) == SwitchSpec()


def test_every_flag_lands_in_its_field(parse):
    spec = cmd.config_from_args(parse(
        "--log-level", "warning", "switch", "--host", "0.0.0.0", "--port", "9000",
        "--pool-slots", "64", "--stats-interval-s", "2", "--lease-timeout-s", "5",
        "--member-timeout-s", "3", "--nack-gap", "0", "--secret-file", "/s", "--insecure",
        "--metrics-port", "0", "--mtu", "1500", "--no-batching", "--stop-on-stdin-eof",
        "--shard", "1/4", "--upstream", "10.0.0.1:48864", "--rack", "0/2", "--job", "J",
        "--tenant-slots", "48", "--challenges-per-s", "100"))
    assert spec == SwitchSpec(
        host="0.0.0.0", port=9000, pool_slots=64, stats_interval_s=2.0, lease_timeout_s=5.0,
        member_timeout_s=3.0, nack_gap=0, secret_file="/s", insecure=True, metrics_port=0,
        tenant_slots=48, challenges_per_s=100.0,
        mtu=1500, batching=False, stop_on_stdin_eof=True, shard=(1, 4),
        upstream=("10.0.0.1", 48864), rack=(0, 2), job="J", log_level="warning")


def test_defaults_come_from_the_environment(monkeypatch, parse):
    monkeypatch.setenv("SWITCHML_PORT", "9001")
    monkeypatch.setenv("SWITCHML_POOL_SLOTS", "8")
    monkeypatch.setenv("SWITCHML_GSO", "0")
    spec = cmd.config_from_args(parse("switch"))
    assert (spec.port, spec.pool_slots, spec.batching) == (9001, 8, False)
    assert cmd.config_from_args(parse("switch", "--challenges-per-s", "0")).challenges_per_s \
        is None  # (0: no budget)


@pytest.mark.parametrize("argv,message", [
    (["--shard", "2/2"], "expected 0 <= I < S, got '2/2'"),
    (["--rack", "one"], "expected I/S (shard I of S), got 'one'"),
    (["--upstream", "nohostport"], "must be HOST:PORT"),
    (["--port", "x"], "expected a port, got 'x'"),
    (["--port", "70000"], "argument --port: a port is 0..65535, got 70000"),
    (["--metrics-port", "-1"], "argument --metrics-port: a port is 0..65535, got -1"),
])
def test_bad_flags_are_refused_by_the_parser(argv, message, parse, capsys):
    with pytest.raises(SystemExit) as exc:
        parse("switch", *argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_runner_hands_the_spec_to_the_service(record, stopped_at_once):
    stopped_at_once(cmd)
    serve = record(service, "serve", 0)
    assert main(["switch", "--port", "5", "--pool-slots", "16"]) == 0
    spec, stop = serve.args
    assert (spec.port, spec.pool_slots, spec.shards) == (5, 16, 1) and stop.is_set()


@pytest.mark.parametrize("argv,message", [
    (["--shards", "-1"], "--shards must be >= 0, got -1"),
    (["--shards", "2", "--shard", "0/2"], "give --shards (run them all here) or --shard I/S"),
    (["--shards", "2", "--port", "0"], "--shards needs a fixed --port"),
    (["--host", "192.0.2.1"], "listening on 192.0.2.1 exposes job creation to the network"),
    (["--upstream", "127.0.0.1:1", "--rack", "0/2"], "--upstream needs --rack I/R and --job"),
    # each shard is a process: a count past the machine is refused before any starts
    (["--shards", "100000", "--port", "40000"], "--shards 100000 is more than 4 per core"),
    (["--shards", "3", "--port", "65534"], "--port 65534 + 3 shards passes 65535"),
    (["--secret-file", "/nonexistent/secret"],
     "can't read --secret-file /nonexistent/secret: No such file or directory"),
    (["--upstream", "nosuchhost.invalid:9", "--rack", "0/2", "--job", "1:2:2:4:64"],
     "can't resolve the upstream host 'nosuchhost.invalid' to an IPv4 address"),
])
def test_bad_combinations_fail_with_the_reason(argv, message, stopped_at_once, capsys):
    stopped_at_once(cmd)
    assert main(["switch", "--port", "0", "--metrics-port", "0", *argv]) == 2
    assert f"switchml: error: {message}" in capsys.readouterr().err
