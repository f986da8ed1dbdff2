"""``switchml bench switch``: the switch capacity benchmark, end to end over loopback."""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
import time

import pytest

from switchml.bench.switchcap import SwitchCapConfig, run_switchcap
from switchml.cli import main


def _check_counts(doc: dict, workers: int, window: int = 64, shards: int = 1) -> None:
    """What must hold after any run on loopback, batched or not."""
    g = doc["generator"]
    assert doc["switch_datagrams_in"] > 0 and doc["switch_datagrams_out"] > 0
    assert g["requests"] > 0 and g["results"] > 0
    assert g["wrong_results_total"] == 0
    assert doc["drops"] == {}
    assert not any(doc["switch_errors"].values())
    assert g["unexpected_total"] == {}
    # Every request was answered by exactly one result, once the drain ended with nothing
    # in flight (results are counted per rank, like requests).
    assert g["in_flight_at_end"] == 0
    assert g["results_total"] == g["requests_total"] - g["in_flight_at_end"]
    # The switch saw every request (first transmissions and re-sends) and every JOIN, and
    # possibly some of the LEAVEs (sent just before its counters were read): every rank
    # joins and leaves on every shard.
    extra_in = (doc["switch_stats"]["packets_in"] - g["requests_total"]
                - g["retransmissions_total"] - g["joins_sent"])
    assert 0 <= extra_in <= workers * shards
    # The slot completes when the last rank's request arrives and goes to every rank: in and
    # out agree over the interval up to the window in flight at either edge.
    assert abs(doc["switch_datagrams_in"] - doc["switch_datagrams_out"]) <= 2 * workers * window
    assert doc["switch_cpu_percent"] > 0 and doc["generator_cpu_percent"] > 0
    assert doc["switch_cpu_us_per_datagram"] > 0


@pytest.mark.slow
def test_cli_short_run_writes_consistent_json(tmp_path, run_switchml):
    path = tmp_path / "switch.json"
    t0 = time.monotonic()
    res = run_switchml("bench", "switch", "--workers", "2", "--seconds", "1", "--json",
                       str(path), timeout=120)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    assert "datagrams/s into the switch" in res.stdout
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "switch-capacity"
    assert doc["config"]["workers"] == 2 and doc["config"]["elements_per_packet"] == 256
    assert doc["wrong_results"] == 0 and doc["consistent"] is True
    assert 0.9 < doc["interval_s"] < 2.0  # the time limit holds
    assert elapsed < 60
    _check_counts(doc, 2)
    assert doc["generator"]["gso"] == doc["switch_stats"]["gso"]


@pytest.mark.slow
def test_without_batching_one_datagram_per_call():
    r = run_switchcap(SwitchCapConfig(workers=2, elements_per_packet=358, window=16,
                                      seconds=1.0, batching=False))
    from dataclasses import asdict
    doc = asdict(r)
    _check_counts(doc, 2)
    g = r.generator
    assert not g["gso"] and not g["gro"]
    assert not r.switch_stats["gso"] and not r.switch_stats["gro"]
    assert g["recv_calls"] == g["results"]  # one datagram per receive
    assert not mp.active_children()  # the switch and the generator are gone


@pytest.mark.slow
def test_sharded_switch_every_shard_aggregates_its_lanes(tmp_path, run_switchml):
    """Two shards, one generator each: every result exact, every request answered, both
    shards carry half of the lanes, and the totals are the shards' sums."""
    path = tmp_path / "shards.json"
    res = run_switchml("bench", "switch", "--workers", "3", "--window", "32", "--shards", "2",
                       "--seconds", "1", "--json", str(path), timeout=180)
    assert res.returncode == 0, res.stderr
    assert "shard 1: datagrams/s in" in res.stdout
    doc = json.loads(path.read_text())
    assert doc["config"]["shards"] == 2 and doc["config"]["generators"] == 2
    assert doc["wrong_results"] == 0 and doc["consistent"] is True
    _check_counts(doc, 3, window=32, shards=2)
    shards = doc["shards"]
    assert [f["shard"] for f in shards] == [0, 1]
    assert sum(f["datagrams_in"] for f in shards) == doc["switch_datagrams_in"]
    for f in shards:  # self-clocked lanes of one job: the shards move at one pace
        assert f["datagrams_in"] > 0.3 * doc["switch_datagrams_in"]
        assert f["cpu_us_per_datagram"] > 0
    assert doc["switch_capacity_per_s"] == pytest.approx(
        sum(f["capacity_per_s"] for f in shards))
    assert len(doc["generator"]["per_generator"]) == 2


@pytest.mark.parametrize("argv,message", [
    (["--workers", "0"], "--workers must be in 1.."),
    (["--elements-per-packet", "20000"], "--elements-per-packet must be in 1..16366"),
    (["--window", "0"], "--window must be in 1..256"),
    (["--seconds", "-1"], "--seconds must be in (0"),
    (["--shards", "0"], "--shards must be in 1.."),
    (["--shards", "4", "--window", "2"], "--shards (4) must be at most --window (2)"),
    (["--shards", "2", "--generators", "3"], "--generators must be in 0..--shards (2)"),
])
def test_bad_arguments_say_what_is_wrong(argv, message, capsys):
    assert main(["bench", "switch", *argv]) == 2
    assert message in capsys.readouterr().err


def test_help_explains(run_switchml):
    res = run_switchml("bench", "switch", "--help")
    assert res.returncode == 0
    assert "--no-batching" in res.stdout and "bottleneck" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=["ctrl-c", "sigterm", "kill-9"])
def test_interrupt_stops_everything(sig, start_switchml, child_pids, pid_alive):
    """Ctrl-C and SIGTERM: the command stops its processes and exits 130. kill -9: the switch
    sees its pipe close and the generator sees its parent gone; both exit by themselves."""
    proc = start_switchml("bench", "switch", "--workers", "2", "--seconds", "60")
    deadline = time.monotonic() + 60
    kids: set[int] = set()
    while time.monotonic() < deadline:  # the switch, the generator (and a resource tracker)
        kids = child_pids(proc.pid)
        if len(kids) >= 2:
            break
        time.sleep(0.2)
    assert len(kids) >= 2, "the benchmark did not start its processes"
    time.sleep(2.0)  # well into the traffic
    kids |= child_pids(proc.pid)
    proc.send_signal(sig)  # to the parent only: it must stop the others
    _out, err = proc.communicate(timeout=30)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 130, err
        assert "interrupted" in err
    deadline = time.monotonic() + 10
    while any(pid_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if pid_alive(k)], "a benchmark process outlived the command"
