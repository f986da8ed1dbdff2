"""A sharded switch: S switch processes, each a plain ``SwitchDataplane`` that knows its shard
index; a worker stripes its lanes over them (lane i to shard i mod S) and joins the job on
every one. Driven on the in-memory fabric, with loss, restarts of one shard and a dead shard."""

from __future__ import annotations

import numpy as np
import pytest

from switchml.protocol.config import SwitchConfig, WorkerConfig
from switchml.protocol.errors import OperationFailed, SwitchMLError
from switchml.protocol.events import OperationCompleted
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import MessageType, unpack_header
from switchml.transport.memory import FaultModel, MemoryCluster


def sharded_cluster(n: int, shards: int, *, loss: float = 0.0, window: int = 8,
                    config: WorkerConfig | None = None, seed: int = 0) -> MemoryCluster:
    """A MemoryCluster whose switch is ``shards`` switch endpoints at ports 48864+i."""
    return MemoryCluster(num_workers=n, window=window, elements_per_packet=64, seed=seed,
                         faults=FaultModel(loss_rate=loss, latency_s=1e-4),
                         worker_config=config, shards=shards)


def _inputs(n: int, size: int) -> tuple[list[np.ndarray], np.ndarray]:
    xs = [np.random.default_rng(r).standard_normal(size).astype(np.float32) for r in range(n)]
    return xs, np.sum(np.array(xs, np.float64), 0)


@pytest.mark.parametrize("shards,loss", [(2, 0.0), (3, 0.0), (2, 0.02)])
def test_sharded_sums_are_exact_and_every_shard_aggregates(shards, loss):
    c = sharded_cluster(4, shards, loss=loss)
    xs, ref = _inputs(4, 64 * 50)
    for _ in range(2):
        for out in c.allreduce(xs):
            np.testing.assert_allclose(out, ref, atol=1e-4)
    per_shard = [sum(sw.stats()["elements_aggregated"].values()) for sw in c.shard_switches]
    # Lanes are striped: each shard aggregated its share (8 lanes over S shards).
    assert all(a > 0 for a in per_shard), per_shard
    lanes = [len(range(i, 8, shards)) for i in range(shards)]
    shares = np.array(per_shard) / sum(per_shard)
    np.testing.assert_allclose(shares, np.array(lanes) / 8, atol=0.05)


def test_each_shard_grants_its_own_slot_base_and_requests_use_it():
    c = sharded_cluster(2, 2)
    # Shard 1 has another job already, so its slot base differs from shard 0's.
    c.shard_switches[1].allocator.allocate(5)
    c.join()
    bases = c.workers[0].slot_bases
    assert bases[0] != bases[1]
    sent = []
    c.fabric.drop_filter = lambda p, src, dst: sent.append((unpack_header(p), dst)) and False
    xs, ref = _inputs(2, 64 * 8)
    np.testing.assert_allclose(c.allreduce(xs)[0], ref, atol=1e-4)
    for h, dst in sent:
        if h.type is MessageType.REQUEST:
            lane = h.chunk % 8
            shard = lane % 2
            assert dst == c.shard_addresses[shard]
            assert h.slot == bases[shard] + lane


def test_a_dead_shard_fails_the_operation_naming_the_shards():
    cfg = WorkerConfig(initial_rto_s=0.05, min_rto_s=0.05, max_rto_s=0.1, op_timeout_s=1.0)
    c = sharded_cluster(2, 2, config=cfg)
    c.join()
    c.fabric.detach(c.shard_addresses[1])  # shard 1 dies
    xs, _ = _inputs(2, 64 * 20)
    with pytest.raises((OperationFailed, SwitchMLError)) as err:
        c.allreduce(xs)
    assert "48865" in str(err.value)


def test_a_shard_that_loses_the_job_restarts_the_operation_on_every_shard():
    c = sharded_cluster(2, 2)
    xs, ref = _inputs(2, 64 * 30)
    c.allreduce(xs)
    # Shard 1 restarts (a fresh process at the same address): it has no jobs.
    fresh = SwitchDataplane(SwitchConfig(shard_index=1, shard_count=2))
    c.fabric.attach(c.shard_addresses[1], fresh)
    outs = [np.empty_like(x) for x in xs]
    c.start(xs, outs)

    def completed(a) -> int:
        return sum(isinstance(e, OperationCompleted) for e in c.fabric.events[a])

    # The operation completes under its new epoch's seq (OperationRestarted says which).
    c.fabric.run(lambda: all(completed(a) == 2 for a in c.addresses), max_time_s=60)
    for out in outs:
        np.testing.assert_allclose(out, ref, atol=1e-4)
    assert all(w.counters["operations_restarted"] == 1 for w in c.workers)
    assert sum(fresh.stats()["elements_aggregated"].values()) > 0


def test_shard_config_is_checked():
    with pytest.raises(Exception, match="shard_index"):
        SwitchConfig(shard_index=2, shard_count=2)
