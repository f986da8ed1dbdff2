"""The simulator: timing mode against exact mode (the real endpoints) on the same links, the
link and host models, failures, and the ``switchml sim`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from switchml.protocol.errors import ConfigError
from switchml.protocol.quantize import error_bound
from switchml.protocol.wire import HEADER_SIZE
from switchml.sim.config import IP_UDP_BYTES, LinkFailure, SimConfig, SimLink, Stragglers
from switchml.sim.exact import run_exact
from switchml.sim.run import parse_failure
from switchml.sim.timing import run_timing

MIB = 1 << 20


def wire_bound(c: SimConfig) -> float:
    """ATE/s of a link carrying nothing but full data frames: B/32 x payload / frame bytes."""
    k = c.elements_per_packet
    frame = IP_UDP_BYTES + HEADER_SIZE + 4 * k + 14
    return c.access.rate_bps / 8 / frame * k


# -- timing mode against the real endpoints ------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"workers": 4},
    {"workers": 3, "access": SimLink(rate_bps=4e8)},
    {"workers": 8, "racks": 2},
    {"workers": 4, "stragglers": Stragglers(1, 2.0, 0.002)},
    {"workers": 4, "access": SimLink(delay_s=200e-6), "host_cost_s": 0.0},
    {"workers": 4, "mtu": 9000},
], ids=["star", "400mbit", "tree", "straggler", "delay", "mtu9000"])
def test_timing_mode_matches_the_real_endpoints(kwargs: dict) -> None:
    c = SimConfig(size_bytes=2 * MIB, **kwargs)
    timing, exact = run_timing(c), run_exact(c)
    assert timing.ok and exact.ok, (timing.error, exact.error)
    assert exact.results_checked == c.workers
    assert timing.elapsed_s == pytest.approx(exact.elapsed_s, rel=0.03)


def test_timing_mode_matches_the_real_endpoints_under_loss_with_nacks() -> None:
    """At n = 4 every loss is recovered by a NACK (or the tail probe) in both; at larger n
    timing mode is optimistic (docs/simulator.md: spurious timeouts are not modelled)."""
    c = SimConfig(workers=4, size_bytes=4 * MIB, access=SimLink(loss_rate=0.001), seed=1)
    timing, exact = run_timing(c), run_exact(c)
    assert timing.ok and exact.ok
    assert timing.extra["nacks"] > 0
    assert timing.elapsed_s == pytest.approx(exact.elapsed_s, rel=0.05)


def test_a_rack_switch_nacks_in_the_order_its_workers_get_results() -> None:
    """A rack switch multicasts its rounds when the spine answers, not when they complete in
    the rack; its NACK log must follow that order, or every NACK for a chunk released out of
    completion order is needless (a quarter of them were, and the gap widened to its cap)."""
    c = SimConfig(workers=8, racks=2, size_bytes=MIB, access=SimLink(loss_rate=0.01), seed=0)
    r = run_exact(c)
    assert r.ok, r.error
    assert r.extra["nacks"] > 50
    assert r.extra["nacks_needless"] == 0
    assert r.extra["recovery"]["nack_retransmissions"] > 50


def test_nacks_make_loss_cheaper_than_timeouts() -> None:
    lossy = SimLink(loss_rate=0.001)
    with_nacks = run_timing(SimConfig(workers=16, size_bytes=MIB, access=lossy, seed=1))
    timeouts = run_timing(SimConfig(workers=16, size_bytes=MIB, access=lossy, seed=1,
                                    nack_gap=0))
    assert with_nacks.extra["nacks"] > 0 and timeouts.extra["nacks"] == 0
    assert with_nacks.elapsed_s < timeouts.elapsed_s / 2


def test_exact_mode_checks_every_sum_within_the_bound() -> None:
    c = SimConfig(workers=6, racks=3, size_bytes=MIB // 4)
    r = run_exact(c)
    assert r.ok and r.results_checked == 6
    # standard normal inputs: every block max is below 2^3 and every sum below 32 in
    # magnitude: quantisation error plus the float32 rounding of the result
    assert 0 < r.max_abs_error <= error_bound(3, 6) + float(np.spacing(np.float32(32)))


# -- the model's figures ------------------------------------------------------------------------


def test_link_bound_is_reached_when_hosts_are_free() -> None:
    c = SimConfig(workers=4, size_bytes=16 * MIB, host_cost_s=0.0)
    r = run_timing(c)
    assert r.ok
    assert r.ate_per_s <= c.line_bound_ate
    assert r.ate_per_s == pytest.approx(wire_bound(c), rel=0.01)
    assert r.links[0].utilisation(r.elapsed_s)["max"] <= 1.0 + 1e-9


def test_host_cost_bounds_the_rate() -> None:
    c = SimConfig(workers=4, size_bytes=16 * MIB, host_cost_s=20e-6)
    r = run_timing(c)
    # each result and the request it releases cost 2 x 20 us: 25,000 chunks/s at most
    assert r.ate_per_s == pytest.approx(25_000 * c.elements_per_packet, rel=0.02)


def test_in_network_rate_does_not_depend_on_n_and_the_tree_keeps_it() -> None:
    base = SimConfig(workers=2, size_bytes=4 * MIB)
    rates = [run_timing(SimConfig(workers=n, racks=r, size_bytes=4 * MIB)).ate_per_s
             for n, r in ((2, 1), (64, 1), (64, 8))]
    assert max(rates) / min(rates) < 1.01
    assert rates[0] > base.ring_bound_ate * 0.8


def test_loss_costs_retransmissions_and_time() -> None:
    clean = run_timing(SimConfig(workers=4, size_bytes=4 * MIB))
    lossy = run_timing(SimConfig(workers=4, size_bytes=4 * MIB,
                                 access=SimLink(loss_rate=0.01), seed=3))
    assert lossy.ok and lossy.elapsed_s > clean.elapsed_s
    packets = 4 * lossy.extra["packets_per_worker"]
    # about 1% of requests and 1% of results are lost, each answered by one re-send
    assert 0.01 * packets < lossy.retransmissions < 0.04 * packets
    assert sum(s.losses for s in lossy.links) > 0


def test_same_seed_same_run() -> None:
    c = SimConfig(workers=8, racks=2, size_bytes=MIB, access=SimLink(loss_rate=0.02), seed=5)
    a, b = run_timing(c), run_timing(c)
    assert a.elapsed_s == b.elapsed_s and a.retransmissions == b.retransmissions


def test_a_slow_spine_link_fills_its_queue_and_drops() -> None:
    c = SimConfig(workers=8, racks=2, size_bytes=MIB, spine=SimLink(rate_bps=1e8,
                                                                    queue_bytes=20_000))
    r = run_timing(c)
    assert r.ok
    rack_up = next(s for s in r.links if s.name == "rack_up")
    assert rack_up.queue_drops > 0 and r.rack_retransmissions > 0
    assert r.ate_per_s < 1e8 / 32


@pytest.mark.parametrize("run", [run_timing, run_exact], ids=["timing", "exact"])
def test_a_failed_link_fails_the_operation_after_its_timeout(run) -> None:
    c = SimConfig(workers=4, size_bytes=MIB, failures=(LinkFailure("worker", 2, 0.002),),
                  op_timeout_s=3.0, max_rto_s=0.5)
    r = run(c)
    assert not r.ok
    assert "rank" in r.error
    assert 3.0 <= r.elapsed_s <= 3.0 + 0.5 + 0.1


def test_a_failed_rack_link_is_reported() -> None:
    c = SimConfig(workers=8, racks=2, size_bytes=MIB, failures=(LinkFailure("rack", 1, 0.002),),
                  op_timeout_s=3.0, max_rto_s=0.5)
    r = run_timing(c)
    assert not r.ok and "rack 1" in r.error


def test_1024_workers_fit_in_a_two_level_tree_cheaply() -> None:
    """Memory and time per event do not grow with n: 1024 workers x 1 MiB in seconds."""
    r = run_timing(SimConfig(workers=1024, racks=32, size_bytes=MIB))
    assert r.ok and r.fraction_of_line_rate > 0.75
    assert r.wall_s < 60


# -- configuration errors -------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"workers": 10, "racks": 3}, "multiple of racks"),
    ({"workers": 4, "size_bytes": 6}, "multiple of 4"),
    ({"workers": 4, "failures": (LinkFailure("rack", 0, 0.1),)}, "only with racks > 1"),
    ({"workers": 4, "failures": (LinkFailure("worker", 4, 0.1),)}, "does not exist"),
    ({"workers": 4, "stragglers": Stragglers(5)}, "exceed workers"),
    ({"workers": 4, "mtu": 50}, "mtu must be in"),
])
def test_bad_configurations_say_what_is_wrong(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SimConfig(**kwargs)


def test_failure_syntax() -> None:
    assert parse_failure("worker:3@0.05") == LinkFailure("worker", 3, 0.05)
    for bad in ("worker3@1", "worker:x@1", "worker:1@soon", "switch:1@1"):
        with pytest.raises(ConfigError):
            parse_failure(bad)


# -- the command ----------------------------------------------------------------------------------


@pytest.fixture
def sim(run_switchml):
    """``switchml sim ARGS`` to the end, output captured."""
    return lambda *args: run_switchml("sim", *args, timeout=300)


def test_cli_sweep_writes_json_and_plots(tmp_path, sim) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "ate.png"
    p = sim("-n", "2", "-n", "8", "--rack-size", "4", "--loss", "0", "--loss", "0.01",
             "--size", "1MiB", "--json", str(out), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["workers"], r["racks"], r["loss_rate"]) for r in rows] == [
        (2, 1, 0.0), (2, 1, 0.01), (8, 2, 0.0), (8, 2, 0.01)]
    assert all(r["ok"] and r["ate_per_s"] > 0 for r in rows)
    assert (tmp_path / "ate-vs-n.png").stat().st_size > 0
    assert (tmp_path / "ate-vs-loss.png").stat().st_size > 0
    assert "of results" in p.stderr or p.stderr == ""  # progress goes to stderr


def test_cli_exact_mode_and_a_failed_link(tmp_path, sim) -> None:
    p = sim("-n", "2", "--size", "256KiB", "--mode", "exact", "--quiet")
    assert p.returncode == 0, p.stderr
    assert "max |error|" in p.stdout
    p = sim("-n", "2", "--size", "256KiB", "--fail-link", "worker:1@0.0005", "--quiet")
    assert p.returncode == 1
    assert "FAILED" in p.stdout


def test_cli_rejects_bad_arguments(sim) -> None:
    p = sim("-n", "6", "--racks", "4")
    assert p.returncode == 2 and "multiple of racks" in p.stderr
    p = sim("--fail-link", "disk:1@2")
    assert p.returncode == 2
    assert "link kind must be 'worker' or 'rack', got 'disk'" in p.stderr


def test_compare_with_testbed_rows(tmp_path, sim) -> None:
    testbed = {"results": [
        {"system": "switchml", "workers": 2, "size_bytes": 4 * MIB, "rate_bps": 4e8,
         "mtu": 1500, "loss_rate": 0.0, "ate_per_s": 1.18e7},
        {"system": "gloo", "workers": 2, "size_bytes": 4 * MIB, "rate_bps": 4e8,
         "mtu": 1500, "loss_rate": 0.0, "ate_per_s": 1.0e7}]}
    path = tmp_path / "tb.json"
    path.write_text(json.dumps(testbed))
    p = sim("--compare", str(path), "--json", str(tmp_path / "cmp.json"))
    assert p.returncode == 0, p.stderr
    rows = json.loads((tmp_path / "cmp.json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["switchml", "gloo"] and rows[0]["workers"] == 2
    assert 0.8 < rows[0]["ratio"] < 1.2
    assert np.isfinite(rows[0]["sim_ate_per_s"])
    # gloo, by hand: a ring of 2 moves 2 (n - 1) / n = 1x the 4 MiB each way, in TCP segments
    # of 1448 bytes that cost the wire 1448 + 52 + 38 each, at 400 Mbit/s, plus 2 (n - 1)
    # ring steps of 100 us; its CPU (a few ms) does not bind
    wire_s = 4 * MIB * (1448 + 52 + 38) / 1448 * 8 / 4e8 + 2 * 100e-6
    assert rows[1]["predicted_ate_per_s"] == pytest.approx(MIB / wire_s, rel=1e-6)
    assert rows[1]["ratio"] == pytest.approx(MIB / wire_s / 1.0e7, rel=1e-6)
    assert "gloo" in p.stdout and "predicted/testbed" in p.stdout
    p = sim("--compare", str(tmp_path / "cmp.json"))  # its own output: not a testbed run
    assert p.returncode == 2 and "has no list of results" in p.stderr, p.stderr


def test_compare_says_what_cpu_the_model_spends_and_where_the_cores_run_out(tmp_path) -> None:
    """Each compared row carries the CPU the model's processes spend at its predicted rate
    (gloo's by hand: n ranks, each 2 (n - 1) / n x 4 bytes out and in per element at the
    calibrated cost, the emulated links' TCP segments included), and a switchml row is marked
    where that is more than the machine's cores: there the testbed's processes shared them."""
    from switchml.costs import Costs
    from switchml.sim.run import compare_with_testbed
    costs = Costs(worker_datagram_s=5e-8, worker_element_s=1e-9, switch_request_s=2e-7,
                  switch_element_s=1.5e-9, gloo_element_s=2.5e-9, link_byte_s=5e-10)
    rows = [{"system": s, "workers": 4, "size_bytes": 4 * MIB, "rate_bps": 1e10, "mtu": 9000,
             "loss_rate": 0.0, "bits": 32, "ate_per_s": 1e8} for s in ("gloo", "switchml")]
    path = tmp_path / "tb.json"
    path.write_text(json.dumps({"benchmark": "allreduce-testbed", "results": rows}))
    base = SimConfig(workers=4, size_bytes=4 * MIB, access=SimLink(rate_bps=1e10), mtu=9000)
    wide = compare_with_testbed([str(path)], base, "timing", gloo_costs=costs, cores=64)
    narrow = compare_with_testbed([str(path)], base, "timing", gloo_costs=costs, cores=1)
    gloo = wide[0]
    mss = 9000 - 52
    per_element = 2.5e-9 + 8 * (mss + 52 + 14) / mss * 5e-10  # gloo's, with the link's bytes
    busy = 4 * (MIB * 2 * 3 / 4 * per_element)  # 4 ranks, each 2 (n - 1) / n x N elements
    assert gloo["cores_needed"] == pytest.approx(
        busy / (MIB / gloo["predicted_ate_per_s"]), rel=1e-9)
    assert [r["cpu_shared"] for r in wide] == [False, False]
    # on one core: the simulated switchml row needs more than it; gloo's prediction shares
    # the one core among its ranks already, so it needs no more than that
    assert narrow[1]["cores_needed"] > 1 and narrow[1]["cpu_shared"]
    assert narrow[0]["cores_needed"] <= 1 + 1e-6 and not narrow[0]["cpu_shared"]


def test_compare_simulates_each_switchml_row_at_its_threads(tmp_path) -> None:
    from switchml.sim.run import compare_with_testbed
    row = {"system": "switchml", "workers": 2, "size_bytes": MIB, "rate_bps": 1e10,
           "mtu": 9000, "loss_rate": 0.0, "bits": 32, "ate_per_s": 1e8}
    path = tmp_path / "tb.json"
    path.write_text(json.dumps({"benchmark": "allreduce-testbed",
                                "results": [{**row, "threads": 2}, row]}))
    seen = []

    def run(cfg, mode):
        seen.append(cfg.threads)
        return run_timing(cfg)
    base = SimConfig(workers=2, size_bytes=MIB, access=SimLink(rate_bps=1e10), mtu=9000,
                     threads=3)
    compare_with_testbed([str(path)], base, "timing", run=run)
    assert seen == [2, 3]  # the row's, else the command's


def test_compare_refuses_a_loopback_run_and_a_file_with_nothing_to_compare(tmp_path, sim
                                                                           ) -> None:
    # a loopback run's rows (`bench allreduce` without --testbed: no link rate) are not
    # predicted, and say so rather than printing an empty table
    loopback = {"benchmark": "allreduce", "results": [
        {"system": "switchml", "workers": 4, "size_bytes": 64 * MIB, "ate_per_s": 1.5e8}]}
    path = tmp_path / "lo.json"
    path.write_text(json.dumps(loopback))
    p = sim("--compare", str(path))
    assert p.returncode == 2 and "is a loopback run" in p.stderr, p.stderr
    assert "share this machine's cores" in p.stderr
    # a testbed file whose rows the model does not predict: 16 bits (as `bench allreduce
    # --testbed --bits 16` writes it, and through torch), and loss
    row = {"system": "switchml", "workers": 2, "size_bytes": 4 * MIB, "rate_bps": 4e8,
           "mtu": 1500, "loss_rate": 0.0, "ate_per_s": 2e7}
    testbed = {"benchmark": "allreduce-testbed", "results": [
        {**row, "bits": 16}, {**row, "wire_bits": 16, "through_torch": True},
        {**row, "loss_rate": 0.01, "bits": 32}]}
    path = tmp_path / "tb16.json"
    path.write_text(json.dumps(testbed))
    p = sim("--compare", str(path))
    assert p.returncode == 2 and "no row to compare" in p.stderr, p.stderr
    # beside a file with a row to compare, it is named and the other's row printed
    good = tmp_path / "tb32.json"
    good.write_text(json.dumps({"benchmark": "allreduce-testbed", "results": [
        {**row, "bits": 32}]}))
    p = sim("--compare", str(path), str(good), "--json", str(tmp_path / "cmp.json"))
    assert p.returncode == 0, p.stderr
    assert f"{path}: no row to compare" in p.stderr
    rows = json.loads((tmp_path / "cmp.json").read_text())["rows"]
    assert [r["file"] for r in rows] == [str(good)]
