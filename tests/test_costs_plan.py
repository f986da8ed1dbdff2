"""The calibrated CPU model: costs (costs.py), the simulator's CPU queues, plan (plan.py),
and the calibration's arithmetic (calibrate.py)."""

from __future__ import annotations

import json
import math

import pytest

from switchml import predict as P
from switchml.calibrate import _solve
from switchml.costs import REFERENCE, Costs, load
from switchml.plan import plan
from switchml.protocol.errors import ConfigError
from switchml.sim.config import SimConfig, SimLink
from switchml.sim.timing import run_timing

FREE = Costs(worker_datagram_s=0, worker_element_s=0, switch_request_s=0, switch_element_s=0,
             gloo_element_s=0)


def test_costs_arithmetic_by_hand():
    c = Costs(worker_datagram_s=1e-6, worker_element_s=2e-9, switch_request_s=3e-7,
              switch_element_s=1e-9, gloo_element_s=4e-9)
    # 10 datagrams of 100 elements each way: 2 x (10 us + 2 us), over 2 threads
    assert c.worker_s(10, 1000, threads=2) == pytest.approx(2 * (10e-6 + 2e-6) / 2)
    # 40 requests of 100 elements: 12 us + 4 us, over 4 shards
    assert c.switch_s(40, 4000, shards=4) == pytest.approx((12e-6 + 4e-6) / 4)
    # a ring of 4 moves 2 x 3/4 of the elements: 1.5 x 1000 x 4 ns
    assert c.gloo_s(1000, 4) == pytest.approx(6e-6)
    assert c.gloo_s(1000, 1) == 0.0
    with pytest.raises(ValueError, match="switch_request_s must be a number >= 0"):
        Costs(worker_datagram_s=0, worker_element_s=0, switch_request_s=-1,
              switch_element_s=0, gloo_element_s=0)


def test_a_calibration_file_round_trips_and_a_missing_one_is_said(tmp_path):
    path = tmp_path / "c.json"
    Costs(1e-8, 2e-9, 3e-7, 4e-9, 5e-9, source="measured here").save(path)
    c = load(path)
    assert (c.worker_datagram_s, c.switch_request_s, c.gloo_element_s) == (1e-8, 3e-7, 5e-9)
    assert "measured here" in c.source and str(path) in c.source
    with pytest.raises(ValueError, match="no calibration at .*switchml calibrate"):
        load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text(json.dumps({"worker_datagram_s": "fast"}))
    with pytest.raises(ValueError, match="is not a switchml calibration"):
        load(tmp_path / "bad.json")


def test_emulated_links_add_their_bytes_kernel_cost_by_hand(tmp_path):
    c = Costs(1e-8, 2e-9, 3e-7, 4e-9, 5e-9, link_byte_s=1e-9)
    on = c.on_emulated_links(1500)
    # a switchml datagram is a 1514-byte frame each way, each paid by its sender: the worker
    # its request (worker_s charges a datagram's cost each way: half a frame each), the
    # switch its result (per request); a gloo element moved is 4 bytes out and 4 in, in
    # 1448-byte segments of 1514-byte frames
    assert on.worker_datagram_s == pytest.approx(1e-8 + 1514e-9 / 2)
    assert on.switch_request_s == pytest.approx(3e-7 + 1514e-9)
    assert on.worker_s(1, 0) + on.switch_s(1, 0) == pytest.approx(
        c.worker_s(1, 0) + c.switch_s(1, 0) + 2 * 1514e-9)  # both frames, once each
    assert on.gloo_element_s == pytest.approx(5e-9 + 8 * 1514 / 1448 * 1e-9)
    assert (on.worker_element_s, on.switch_element_s, on.link_byte_s) == (2e-9, 4e-9, 0.0)
    assert Costs(1e-8, 2e-9, 3e-7, 4e-9, 5e-9).on_emulated_links(1500).worker_datagram_s == 1e-8
    # the per-all-reduce cost: charged to each worker's all-reduce on the testbed only
    op = Costs(1e-8, 2e-9, 3e-7, 4e-9, 5e-9, link_op_s=2e-3)
    assert op.worker_op_s == 0.0 and op.on_emulated_links(1500).worker_op_s == 2e-3
    free = P.Resources(FREE)
    on = P.Resources(Costs(0, 0, 0, 0, 0, link_op_s=2e-3).on_emulated_links(1500))
    kw = dict(workers=4, rate_bps=1e9, mtu=1500)
    assert P.switchml_allreduce_s(1000, res=on, **kw) == pytest.approx(
        P.switchml_allreduce_s(1000, res=free, **kw) + 2e-3)
    assert P.switchml_resources_s(1000, res=on, **kw)["worker CPU"] == pytest.approx(2e-3)
    # a calibration written before the links were measured loads with none
    path = tmp_path / "old.json"
    path.write_text(json.dumps({k: v for k, v in c.to_dict().items() if k != "link_byte_s"}))
    assert load(path).link_byte_s == 0.0
    with pytest.raises(ValueError, match="link_byte_s must be a number >= 0"):
        Costs(0, 0, 0, 0, 0, link_byte_s=-1)


def test_without_a_calibration_the_reference_is_used_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load() is REFERENCE and "switchml calibrate" in REFERENCE.source


def test_the_calibration_solve_recovers_known_costs():
    # cpu = d a + e b with a = 1 us, b = 2 ns, at two datagram sizes
    d, e = [1000.0, 160.0], [358_000.0, 357_280.0]
    cpu = [di * 1e-6 + ei * 2e-9 for di, ei in zip(d, e)]
    a, b = _solve(d, e, cpu)
    assert a == pytest.approx(1e-6) and b == pytest.approx(2e-9)
    # noise that would make a cost negative puts it all on the other
    a, b = _solve(d, e, [0.0001, 0.0009])
    assert a == 0.0 and b > 0


def _sim(**kw):
    base = dict(workers=4, size_bytes=4 * 358 * 2000, access=SimLink(rate_bps=10e9), mtu=1500,
                host_cost_s=0.0)
    report = run_timing(SimConfig(**(base | kw)))
    assert report.ok, report.error
    return report.elapsed_s


def test_a_switch_cpu_that_binds_sets_the_pace_and_shards_share_it():
    # 2000 blocks (+ 128 exponent packets) from each of 4 workers at 5 us a request:
    # 4 x 2128 x 5 us = 42.6 ms of switch CPU, far above the wire's ~2.4 ms
    busy = 4 * (2000 + 128) * 5e-6
    one = _sim(switch_request_cost_s=5e-6)
    assert busy <= one < busy * 1.05
    four = _sim(switch_request_cost_s=5e-6, shards=4)
    assert busy / 4 <= four < busy / 4 * 1.1
    assert _sim() < busy / 10  # a switch at line rate


def test_a_worker_cpu_that_binds_sets_the_pace_and_threads_share_it():
    # each worker: (2000 x 358) elements at 20 ns, each way = 28.6 ms
    busy = 2 * 2000 * 358 * 20e-9
    one = _sim(host_element_cost_s=20e-9)
    assert busy <= one < busy * 1.05
    two = _sim(host_element_cost_s=20e-9, threads=2)
    assert busy / 2 <= two < busy / 2 * 1.1


def test_gloo_is_charged_its_cpu_where_it_binds():
    c = Costs(0, 0, 0, 0, gloo_element_s=10e-9)
    # 1M elements, n = 4: CPU 1.5 x 1M x 10 ns = 15 ms; wire at 100 Gbit/s about 0.5 ms
    t = P.gloo_allreduce_s(1_000_000, workers=4, rate_bps=100e9, mtu=1500, costs=c)
    assert t == pytest.approx(15e-3 + 6 * P.GLOO_HOP_S)
    assert P.gloo_allreduce_s(1_000_000, workers=4, rate_bps=100e9, mtu=1500,
                              costs=FREE) < 1e-3 + 6 * P.GLOO_HOP_S


def test_plan_sizes_threads_and_shards_from_the_costs():
    # Per element at MTU 1500 on 10 Gbit/s the wire takes about 3.3 ns; a worker thread
    # spends 2 x 6 ns = 12 ns and the switch 8 x 4 ns = 32 ns per worker element: at 90% of
    # line rate, about 0.9 x 12 / 3.3 = 4 threads and 0.9 x 32 / 3.3 = 9 shards at least.
    c = Costs(0, 6e-9, 0, 4e-9, 0, source="hand")
    p = plan(workers=8, rate_bps=10e9, share=0.9, size_bytes=16 << 20, costs=c)
    wire = P.switchml_wire_bytes(4 << 20, mtu=1500) * 8 / 10e9 / (4 << 20)
    assert p.threads >= math.ceil(0.9 * 12e-9 / wire)
    assert p.shards >= math.ceil(0.9 * 32e-9 / wire)
    assert p.share >= 0.9 and p.switch_hosts == -(-p.shards // 16)
    assert p.ring_ceiling == pytest.approx(1.75)
    free = plan(workers=8, rate_bps=10e9, size_bytes=16 << 20, costs=FREE)
    assert (free.threads, free.shards, free.bound_by) == (1, 1, "wire")
    # the ring's ceiling, and a little more: gloo's TCP headers and 14 ring steps of 100 us
    assert 1.75 <= free.speedup < 1.75 * 1.15
    with pytest.raises(ConfigError, match="0 < share <= 1"):
        plan(workers=8, rate_bps=1e9, share=1.5, costs=FREE)


def test_predict_names_what_binds_each_system():
    prof = P.Profile(model="m", params=4 << 20, batch=1, forward_s=0.01, backward_s=0.02,
                     optimizer_s=0.001, buckets=[P.Bucket(numel=4 << 20, ready_s=0.02)])
    slow_switch = Costs(0, 0, 1e-6, 0, 0)
    preds = {p.system: p for p in P.predict(prof, workers=8, rate_bps=10e9,
                                           systems=("gloo", "switchml"),
                                           res=P.Resources(slow_switch))}
    assert preds["switchml"].bound_by == "switch CPU" and preds["gloo"].bound_by == "wire"
    fast = {p.system: p for p in P.predict(prof, workers=8, rate_bps=10e9,
                                          systems=("gloo", "switchml"),
                                          res=P.Resources(slow_switch, shards=64))}
    assert fast["switchml"].bound_by == "wire"
    assert fast["switchml"].step_s < preds["switchml"].step_s
