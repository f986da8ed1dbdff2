"""RACK-style fast retransmission (RFC 8985) in the worker, on the virtual-time fabric."""

from __future__ import annotations

import numpy as np
import pytest

from switchml.protocol.config import SwitchConfig, WorkerConfig
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import MessageType
from switchml.transport.memory import FaultModel, MemoryCluster, MemoryFabric

N, K, WINDOW = 3, 64, 4
SIZE = 200 * K  # 200 chunks: 50 rounds on each of the 4 lanes
CONFIG = dict(initial_rto_s=0.2, min_rto_s=0.05, max_rto_s=0.5, op_timeout_s=5.0)


def _lost(rank: int, chunk: int, mtype: MessageType = MessageType.REQUEST):
    """Matches the REQUEST of ``rank`` (or the RESULT to ``rank``) for ``chunk``."""
    return lambda h, src, dst: h.type is mtype and h.chunk == chunk and (
        (mtype is MessageType.REQUEST and h.rank == rank)
        or (mtype is MessageType.RESULT and dst[1] == 4000 + rank))


def _run(fast: bool, drop=None, faults: FaultModel | None = None, seed: int = 0):
    fabric = MemoryFabric(faults or FaultModel(latency_s=0.001), seed, drop_filter=drop)
    # The switch's NACKs off: RACK is compared with timeouts alone (test_nack.py has NACKs).
    c = MemoryCluster(num_workers=N, window=WINDOW, elements_per_packet=K, fabric=fabric,
                      worker_config=WorkerConfig(fast_retransmit=fast, **CONFIG),
                      switch=SwitchDataplane(SwitchConfig(nack_gap=0)))
    c.join()
    rng = np.random.default_rng(1)
    xs = [rng.integers(-2**20, 2**20, SIZE, dtype=np.int32) for _ in range(N)]
    t0 = fabric.now
    outs = c.allreduce(xs)
    expect = np.sum(xs, axis=0, dtype=np.int32)
    for out in outs:
        assert np.array_equal(out, expect)
    counters = [w.counters for w in c.workers]
    return fabric.now - t0, counters


@pytest.mark.parametrize("what", ["request", "result"])
def test_a_lost_chunk_is_resent_long_before_its_timeout(what, drop_once):
    mtype = MessageType.REQUEST if what == "request" else MessageType.RESULT
    drop, state = drop_once(_lost(rank=1, chunk=41, mtype=mtype))
    slow, c_slow = _run(False, drop)
    assert state["dropped"] == 1
    drop, state = drop_once(_lost(rank=1, chunk=41, mtype=mtype))
    fast, c_fast = _run(True, drop)
    assert state["dropped"] == 1
    lossless, _ = _run(True)
    # Without fast retransmission the lost chunk waits for its timeout (>= min_rto 50 ms).
    assert slow - lossless >= CONFIG["min_rto_s"] - 1e-9
    assert c_slow[1]["retransmissions"] >= 1 and c_slow[1]["fast_retransmissions"] == 0
    # With it, the loss costs a few round trips (2 ms each).
    assert fast - lossless < 0.015, (fast, lossless)
    # The stalled slot looks the same to every rank (it waits for that slot, or for rank 1's
    # next chunk there), so each re-sends once; the others get WAITING or the shadow copy.
    assert [c["fast_retransmissions"] for c in c_fast] == [1] * N


def test_no_spurious_fast_retransmissions_without_loss_within_the_reorder_window():
    # Up to 0.5 ms of jitter per hop: reordering smaller than the 1 ms reorder window.
    _, counters = _run(True, faults=FaultModel(latency_s=0.001, jitter_s=0.0005), seed=3)
    assert sum(c["fast_retransmissions"] for c in counters) == 0
    assert sum(c["retransmissions"] for c in counters) == 0


@pytest.mark.parametrize("seed", range(4))
def test_fast_retransmission_under_random_loss_and_reordering_stays_exact(seed):
    faults = FaultModel(latency_s=0.001, jitter_s=0.002, loss_rate=0.03, duplicate_rate=0.02,
                        reorder_rate=0.05, reorder_delay_s=0.004)
    _, counters = _run(True, faults=faults, seed=seed)  # _run checks the sums bit for bit
    assert sum(c["fast_retransmissions"] for c in counters) > 0


def test_config_rejects_a_negative_reorder_window():
    with pytest.raises(ValueError, match="min_reorder_window_s"):
        WorkerConfig(min_reorder_window_s=-1.0)


def test_spurious_re_sends_widen_the_reorder_window():
    """Reordering far beyond the 1 ms window (up to 6 ms of jitter per hop), no loss: the first
    re-sends are spurious, the switch answers them with WAITING, the window widens and later
    operations re-send far less; every sum stays exact."""
    fabric = MemoryFabric(FaultModel(latency_s=0.001, jitter_s=0.006), seed=11)
    c = MemoryCluster(num_workers=N, window=WINDOW, elements_per_packet=K, fabric=fabric,
                      worker_config=WorkerConfig(fast_retransmit=True, **CONFIG))
    c.join()
    rng = np.random.default_rng(2)
    per_op = []
    for _ in range(4):
        xs = [rng.integers(-2**20, 2**20, SIZE, dtype=np.int32) for _ in range(N)]
        before = sum(w.counters["fast_retransmissions"] for w in c.workers)
        for out in c.allreduce(xs):
            assert np.array_equal(out, np.sum(xs, axis=0, dtype=np.int32))
        per_op.append(sum(w.counters["fast_retransmissions"] for w in c.workers) - before)
    assert sum(w.counters["spurious_fast_retransmissions"] for w in c.workers) > 0
    assert per_op[0] > 0 and per_op[-1] < per_op[0] / 2, per_op


def test_without_fast_retransmission_no_transmission_log_is_kept():
    """RACK's log of transmissions is only kept when RACK is on (it grew with the operation)."""
    fabric = MemoryFabric(FaultModel(latency_s=0.001), 0)
    c = MemoryCluster(num_workers=N, window=WINDOW, elements_per_packet=K, fabric=fabric,
                      worker_config=WorkerConfig(fast_retransmit=False, **CONFIG))
    c.join()
    xs = [np.ones(SIZE, np.int32) for _ in range(N)]
    c.start(xs, [np.empty_like(x) for x in xs])
    fabric.run(lambda: c.workers[0].counters["results_received"] >= 150)
    op = c.workers[0]._op  # mid-operation, 150 of 200 chunks answered
    assert op is not None and len(op.xmit_order) == 0
