"""Hierarchical aggregation over UDP: a spine switch, rack switches (``SwitchServer`` hosting a
``RackAggregator``, as ``switchml switch --upstream`` runs them) and workers that talk only to
their rack. Exact sums, also with injected loss on every worker's link; a dead spine is an
error, not a hang."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from switchml.control import new_job_spec
from switchml.protocol.config import WorkerConfig
from switchml.protocol.errors import OperationFailed
from switchml.protocol.tree import RackAggregator, TreeConfig, tree_specs
from switchml.transport.faults import LossyEndpoint
from switchml.transport.udp import SwitchServer, WorkerClient


def _tree(racks: int, per_rack: int):
    spine = SwitchServer(host="127.0.0.1", port=0).start()
    spec = new_job_spec(racks * per_rack, window=8, elements_per_packet=256)
    parent, child = tree_specs(spec, racks)
    servers = []
    for r in range(racks):
        rack = RackAggregator(parent_spec=parent, child_spec=child, rack=r,
                              parent_address=spine.address,
                              config=TreeConfig(parent_timeout_s=3.0))
        srv = SwitchServer(host="127.0.0.1", port=0, dataplane=rack).start()
        srv.run_command(rack.join)
        servers.append(srv)
    return spine, servers, child


def _run(run_threads, servers, child, per_rack: int, xs, loss: float = 0.0,
         config=None) -> list:
    out: list = [None] * len(xs)

    def run(g: int) -> None:
        rack, local = divmod(g, per_rack)
        try:
            with WorkerClient(servers[rack].address, child, local, config,
                              wrap=lambda s: LossyEndpoint(s, loss, g)) as w:
                out[g] = [w.allreduce(xs[g]) for _ in range(2)]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[g] = exc

    run_threads(run, len(xs), 90)
    return out


@pytest.mark.parametrize("loss", [0.0, 0.02])
def test_two_racks_under_a_spine_sum_exactly(run_threads, loss):
    xs = [np.random.default_rng(g).standard_normal(50_000).astype(np.float32)
          for g in range(4)]
    ref = np.sum(np.array(xs, np.float64), 0)
    ints = [np.arange(30_000, dtype=np.int32) * (g + 1) for g in range(4)]
    for inputs in (xs, ints):  # a rack server hosts one job: a fresh tree per job
        spine, servers, child = _tree(2, 2)
        try:
            out = _run(run_threads, servers, child, 2, inputs, loss)
            for o in out:
                assert not isinstance(o, Exception), o
                for y in o:
                    if y.dtype == np.int32:  # exact
                        assert np.array_equal(y, np.arange(30_000, dtype=np.int32) * 10)
                    else:
                        np.testing.assert_allclose(y, ref, atol=1e-4)
            assert spine.stats()["results_multicast"] > 0
            assert all(s.stats()["tree"]["upstream_sent"] > 0 for s in servers)
        finally:
            for s in (spine, *servers):
                s.stop()


@pytest.mark.slow
def test_a_dead_spine_fails_the_racks_operations_in_bounded_time(run_threads):
    spine, servers, child = _tree(2, 1)
    spine.stop()
    cfg = WorkerConfig(op_timeout_s=5.0)
    try:
        out = _run(run_threads, servers, child, 1, [np.ones(10_000, np.float32)] * 2,
                   config=cfg)
        for o in out:
            assert isinstance(o, OperationFailed), o
    finally:
        for s in servers:
            s.stop()


def test_switch_command_runs_a_rack_under_a_spine(start_switchml, run_threads):
    from switchml.control import decode_job_spec, encode_job_spec
    spec = new_job_spec(2, window=8, elements_per_packet=256)
    spine = start_switchml("switch", "--port", "0", "--metrics-port", "0",
                           stderr=subprocess.DEVNULL)
    spine_port = int(spine.stdout.readline().rsplit(":", 1)[1])
    rack_ports, child_text = [], None
    for r in range(2):
        p = start_switchml("switch", "--port", "0", "--metrics-port", "0", "--upstream",
                           f"127.0.0.1:{spine_port}", "--rack", f"{r}/2", "--job",
                           encode_job_spec(spec), stderr=subprocess.DEVNULL)
        line = p.stdout.readline()
        assert "SWITCHML_JOB=" in line, line
        child_text = line.split("SWITCHML_JOB=")[1].split()[0]
        rack_ports.append(int(p.stdout.readline().rsplit(":", 1)[1]))
    child = decode_job_spec(child_text)
    assert (child.num_workers, child.scale_workers) == (1, 2)
    out: list = [None, None]

    def run(r: int) -> None:
        with WorkerClient(("127.0.0.1", rack_ports[r]), child, 0) as w:
            out[r] = w.allreduce(np.full(5000, r + 1.0, np.float32))

    run_threads(run, 2, 60)
    for o in out:
        assert o is not None and np.all(o == 3.0)
