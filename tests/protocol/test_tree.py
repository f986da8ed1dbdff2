"""Hierarchical aggregation (protocol/tree.py): rack switches under a spine, real endpoints on
the in-memory fabric, exact sums with crafted and random losses at both levels, failures
reported as errors."""

from __future__ import annotations

import numpy as np
import pytest

from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.errors import ConfigError, SwitchMLError
from switchml.protocol.quantize import block_exponent, error_bound
from switchml.protocol.tree import RackAggregator, TreeConfig, TreeFailed
from switchml.protocol.wire import Flags, MessageType, unpack_header
from switchml.sim.cluster import SPINE, TreeCluster, rack_address, worker_address
from switchml.transport.memory import FaultModel, MemoryFabric

K = 16
WINDOW = 4


def ints(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-(2**20), 2**20, size, dtype=np.int32) for _ in range(n)]


def floats(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    scale = 2.0 ** rng.integers(-6, 6, size)
    return [(rng.standard_normal(size) * scale).astype(np.float32) for _ in range(n)]


def tree(racks: int = 2, per_rack: int = 3, *, faults: FaultModel | None = None, seed: int = 0,
         drop=None, **kwargs) -> TreeCluster:
    fabric = MemoryFabric(faults or FaultModel(), seed, drop_filter=drop)
    return TreeCluster(fabric, racks=racks, workers_per_rack=per_rack, window=WINDOW,
                       elements_per_packet=K, **kwargs)


def assert_int_sums(outs: list[np.ndarray], xs: list[np.ndarray]) -> None:
    expect = np.sum(xs, axis=0, dtype=np.int32)
    for r, o in enumerate(outs):
        assert np.array_equal(o, expect), f"rank {r} differs"


def assert_float_sums(outs: list[np.ndarray], xs: list[np.ndarray]) -> None:
    """Every rank holds the same array, within the documented bound for n = all workers."""
    n = len(xs)
    ref = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for o in outs:
        assert np.array_equal(o, outs[0])
    for b in range(0, ref.size, K):
        emax = max(block_exponent(x[b:b + K])[0] for x in xs)
        tol = error_bound(emax, n) + np.spacing(np.float32(np.abs(ref[b:b + K]).max() + 1))
        assert np.abs(outs[0][b:b + K] - ref[b:b + K]).max() <= tol


# -- sums -------------------------------------------------------------------------------------


def test_two_racks_sum_exactly_and_every_level_sees_one_request_per_round() -> None:
    t = tree()
    xs = ints(6, 10 * K + 3, seed=1)
    assert_int_sums(t.allreduce(xs), xs)
    rounds = 11  # ceil(163 / 16) chunks of an int32 operation
    for rack in t.racks:
        assert rack.counters["upstream_sent"] == rounds
        assert rack.counters["parent_results"] == rounds
        assert rack.counters["upstream_retransmissions"] == 0
    assert t.spine.stats()["results_multicast"] == rounds


def test_float_sums_use_the_global_scale_and_max_exponent() -> None:
    """Racks with very different magnitudes: each rack's partial sum is scaled for all six
    workers and the spine's max exponent, so the global sum is within the bound of n = 6."""
    t = tree()
    xs = floats(6, 7 * K + 5, seed=2)
    xs[3] *= 1024  # rack 1 much larger than rack 0
    outs = t.allreduce(xs)
    assert_float_sums(outs, xs)
    xs2 = floats(6, 3 * K, seed=3)
    assert_float_sums(t.allreduce(xs2), xs2)  # a second operation on the same slots


def test_scale_must_cover_the_tree() -> None:
    spec = JobSpec(job_id=1, token=2, num_workers=2, window=4, elements_per_packet=K,
                   scale_workers=6)
    child = JobSpec(job_id=1, token=2, num_workers=3, window=4, elements_per_packet=K)
    with pytest.raises(ConfigError, match="same number of workers"):
        RackAggregator(parent_spec=spec, child_spec=child, rack=0, parent_address=SPINE)
    child = JobSpec(job_id=1, token=2, num_workers=3, window=8, elements_per_packet=K,
                    scale_workers=6)
    with pytest.raises(ConfigError, match="same window"):
        RackAggregator(parent_spec=spec, child_spec=child, rack=0, parent_address=SPINE)
    child = JobSpec(job_id=1, token=2, num_workers=3, window=4, elements_per_packet=K,
                    scale_workers=6)
    with pytest.raises(ConfigError, match="rack must be in 0..1"):
        RackAggregator(parent_spec=spec, child_spec=child, rack=2, parent_address=SPINE)
    with pytest.raises(ConfigError, match="parent_timeout_s"):
        TreeConfig(parent_timeout_s=0.5, max_rto_s=1.0)


# -- loss recovery ----------------------------------------------------------------------------


def _sums_with_a_lost_request(drop_once, src, chunk: int, size: int, seed: int) -> TreeCluster:
    """A tree whose fabric loses ``src``'s first REQUEST of ``chunk``; exact int sums anyway."""
    drop, state = drop_once(lambda h, s, dst: h.type is MessageType.REQUEST
                            and s == src and h.chunk == chunk)
    t = tree(drop=drop)
    xs = ints(6, size, seed=seed)
    assert_int_sums(t.allreduce(xs), xs)
    assert state["dropped"] == 1
    return t


def test_lost_upstream_request_is_resent_by_the_rack(drop_once) -> None:
    t = _sums_with_a_lost_request(drop_once, rack_address(1), chunk=5, size=10 * K, seed=4)
    assert t.racks[1].counters["upstream_retransmissions"] >= 1


def test_lost_parent_result_is_recovered_and_children_never_see_the_partial_sum(drop_once) -> None:
    """The spine's result to rack 0 is lost: the rack's children time out and re-send; the
    inner switch would answer with the rack's partial sum; the rack drops that (it has no
    global result yet) and re-sends upstream; the spine answers from its round. Every result
    a child gets carries the global sum."""
    drop, state = drop_once(lambda h, src, dst: h.type is MessageType.RESULT
                            and src == SPINE and dst == rack_address(0) and h.chunk == 3)
    child_results: list[tuple[int, bytes]] = []
    fabric_drop = drop

    def tap(payload: bytes, src, dst) -> bool:
        if src == rack_address(0):
            h = unpack_header(payload)
            if h.type is MessageType.RESULT and h.chunk == 3:
                child_results.append((h.flags, payload[40:]))
        return fabric_drop(payload, src, dst)

    cfg = WorkerConfig(min_rto_s=0.002, initial_rto_s=0.002)  # children re-send before the rack
    t = tree(drop=tap, worker_config=cfg, tree_config=TreeConfig(rto_s=0.05))
    xs = ints(6, 8 * K, seed=5)
    assert_int_sums(t.allreduce(xs), xs)
    assert state["dropped"] == 1
    r0 = t.racks[0].counters
    assert r0["resends_dropped"] >= 1  # a child's re-send found only the partial sum
    assert r0["upstream_retransmissions"] >= 1
    expect = np.sum(xs, axis=0, dtype=np.int32)[3 * K:4 * K].tobytes()
    assert child_results and all(data == expect for _, data in child_results)


def test_lost_child_result_is_answered_with_the_global_result(drop_once) -> None:
    drop, state = drop_once(lambda h, src, dst: h.type is MessageType.RESULT
                            and src == rack_address(1) and dst == worker_address(4)
                            and h.chunk == 6)
    resent: list[bytes] = []

    def tap(payload: bytes, src, dst) -> bool:
        h = unpack_header(payload)
        if dst == worker_address(4) and h.flags & Flags.RESENT:
            resent.append(payload[40:])
        return drop(payload, src, dst)

    t = tree(drop=tap)
    xs = ints(6, 8 * K, seed=6)
    assert_int_sums(t.allreduce(xs), xs)
    assert state["dropped"] == 1
    assert t.racks[1].counters["results_resent"] >= 1
    expect = np.sum(xs, axis=0, dtype=np.int32)[6 * K:7 * K].tobytes()
    assert resent and all(data == expect for data in resent)


def test_lost_child_request_is_recovered_inside_the_rack(drop_once) -> None:
    t = _sums_with_a_lost_request(drop_once, worker_address(2), chunk=2, size=6 * K, seed=7)
    assert t.workers[2].counters["retransmissions"] >= 1
    assert t.spine.stats()["results_resent"] == 0  # nothing was lost above the racks


@pytest.mark.parametrize("seed", range(3))
def test_random_loss_at_both_levels_keeps_sums_exact(seed: int) -> None:
    t = tree(racks=3, per_rack=2, faults=FaultModel(loss_rate=0.05, duplicate_rate=0.02,
                                                    reorder_rate=0.05), seed=seed)
    xs = ints(6, 12 * K + 1, seed=seed)
    assert_int_sums(t.allreduce(xs), xs)
    fs = floats(6, 9 * K, seed=seed)
    assert_float_sums(t.allreduce(fs), fs)
    assert sum(r.counters["upstream_retransmissions"] for r in t.racks) > 0


# -- failures ---------------------------------------------------------------------------------

FAST_FAIL = WorkerConfig(op_timeout_s=6.0, max_rto_s=0.5)
TREE_FAIL = TreeConfig(parent_timeout_s=2.0, max_rto_s=0.5)


def _failing_tree() -> tuple[TreeCluster, list[np.ndarray]]:
    t = tree(worker_config=FAST_FAIL, tree_config=TREE_FAIL)
    t.allreduce(ints(6, 4 * K, seed=8))
    return t, ints(6, 40 * K, seed=9)


def test_a_dead_spine_is_reported_by_the_racks() -> None:
    t, xs = _failing_tree()
    seqs = t.start(xs, [np.empty_like(x) for x in xs])
    t.net.run(lambda: t.net.now > 0.0001)
    t.net.detach(SPINE)
    t0 = t.net.now
    with pytest.raises(SwitchMLError, match="no result from the parent switch at spine:48864"):
        t.wait(seqs)
    assert t.net.now - t0 <= TREE_FAIL.parent_timeout_s + 2 * TREE_FAIL.max_rto_s
    assert any(isinstance(e, TreeFailed) for e in t.net.events[rack_address(0)])


def test_a_dead_rack_is_named_by_the_other_racks() -> None:
    t, xs = _failing_tree()
    seqs = t.start(xs, [np.empty_like(x) for x in xs])
    t.net.run(lambda: t.net.now > 0.0001)
    t.net.detach(rack_address(1))
    with pytest.raises(SwitchMLError, match=r"waits for rack\(s\) \[1\]"):
        t.wait(seqs)


def test_a_refused_parent_join_is_an_error() -> None:
    t = tree(switch_config=SwitchConfig(max_window=2))
    with pytest.raises(SwitchMLError, match="refused JOIN"):
        t.join()


def test_another_job_on_a_rack_switch_gets_its_results_and_its_resends(drop_once) -> None:
    """A rack switch serves other jobs as a plain switch: their results go to their members,
    and a member that lost one gets the switch's copy (not swallowed by the tree's relay)."""
    from switchml.protocol.session import WorkerSession
    from switchml.protocol.worker import WorkerEndpoint
    t = tree(racks=2, per_rack=2)
    t.join()
    other = JobSpec(job_id=42, token=43, num_workers=1, window=2, elements_per_packet=16)
    w = WorkerEndpoint(spec=other, rank=0, switch_address=rack_address(0),
                       config=WorkerConfig(min_rto_s=0.05, initial_rto_s=0.05))
    s = WorkerSession(w)
    addr = ("other", 9)
    t.net.attach(addr, s)
    t.net.drop_filter, state = drop_once(
        lambda h, src, dst: h.type is MessageType.RESULT and dst == addr and h.chunk == 0)
    s.join(t.net.now)
    t.net.flush(addr)
    t.net.run(lambda: s.joined)
    x = np.arange(40, dtype=np.int32)
    h = s.submit(x, now=t.net.now)
    t.net.flush(addr)
    t.net.run(h.done, max_time_s=5)
    assert state["dropped"] and np.array_equal(h.result(), x)
    assert t.racks[0].switch.stats()["results_resent"] >= 1
    assert t.racks[0].counters["resends_dropped"] == 0
