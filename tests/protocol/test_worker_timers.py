"""Worker retransmission timers, driven through :class:`MemoryFabric` with scripted drops.

Virtual time makes the schedule exact: a timer fires at its deadline, and every delivery takes
``FaultModel.latency_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.errors import LocalProtocolError, SwitchMLError
from switchml.protocol.events import Joined, JoinFailed, OperationCompleted
from switchml.protocol.wire import Flags, Header, MessageType, unpack_header
from switchml.protocol.worker import WorkerEndpoint, WorkerState
from switchml.transport.memory import FaultModel, MemoryCluster, MemoryFabric

SWITCH = MemoryCluster.SWITCH


@dataclass
class Sent:
    t: float
    src: tuple[str, int]
    dst: tuple[str, int]
    h: Header


class Script:
    """A drop_filter that records every datagram and drops the ones a rule selects.

    ``rule(h, src, dst, nth)`` gets the header and how many earlier datagrams had the same
    (type, src, dst, seq, chunk); returning True drops this one.
    """

    def __init__(self, fabric: MemoryFabric, rule=None) -> None:
        self.fabric = fabric
        self.rule = rule
        self.log: list[Sent] = []
        self.dropped: list[Sent] = []
        fabric.drop_filter = self

    def __call__(self, payload: bytes, src, dst) -> bool:
        h = unpack_header(payload)
        rec = Sent(self.fabric.now, src, dst, h)
        nth = sum(1 for s in self.log if (s.h.type, s.src, s.dst, s.h.seq, s.h.chunk)
                  == (h.type, src, dst, h.seq, h.chunk))
        self.log.append(rec)
        if self.rule is not None and self.rule(h, src, dst, nth):
            self.dropped.append(rec)
            return True
        return False

    def sends(self, mtype: MessageType, src=None, dst=None, chunk=None) -> list[Sent]:
        return [s for s in self.log if s.h.type is mtype and (src is None or s.src == src)
                and (dst is None or s.dst == dst) and (chunk is None or s.h.chunk == chunk)]


def cluster(n: int = 2, *, window: int = 1, k: int = 4, latency: float = 50e-6,
            config: WorkerConfig | None = None) -> MemoryCluster:
    c = MemoryCluster(num_workers=n, window=window, elements_per_packet=k,
                      faults=FaultModel(latency_s=latency), worker_config=config)
    c.join()
    return c


def int_inputs(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, size, dtype=np.int32) for _ in range(n)]


def int_sum(inputs: list[np.ndarray]) -> np.ndarray:
    return np.stack([x.astype(np.int64) for x in inputs]).sum(axis=0)


# -- A dropped request is retransmitted after the RTO ----------------------------------------


def test_dropped_request_is_retransmitted_after_initial_rto() -> None:
    cfg = WorkerConfig(initial_rto_s=0.2, min_rto_s=0.01, max_rto_s=1.0)
    c = cluster(config=cfg)
    a0 = c.addresses[0]
    script = Script(c.fabric, lambda h, src, dst, nth: (
        h.type is MessageType.REQUEST and src == a0 and nth == 0))
    inputs = int_inputs(2, 4)
    outs = [np.empty_like(x) for x in inputs]
    t0 = c.fabric.now
    seqs = c.start(inputs, outs)
    w0 = c.workers[0]
    assert w0.rto_s == cfg.initial_rto_s  # nothing measured yet
    assert w0.get_timer() == pytest.approx(t0 + 0.2)
    c.wait(seqs)
    sends = script.sends(MessageType.REQUEST, src=a0)
    assert [s.t for s in sends] == pytest.approx([t0, t0 + 0.2])
    assert len(script.dropped) == 1
    assert w0.counters["retransmissions"] == 1
    assert w0.counters["packets_sent"] == 2
    assert np.array_equal(outs[0], int_sum(inputs)) and np.array_equal(outs[1], outs[0])
    assert c.fabric.now == pytest.approx(t0 + 0.2 + 2 * 50e-6)
    # Karn's rule: the only result answered a retransmitted packet, so no RTT sample was taken.
    assert w0.rto_s == cfg.initial_rto_s


def test_the_first_round_trip_brings_the_first_windows_deadlines_down() -> None:
    """Chunks of a job's first window go out before anything was measured, under the 0.2 s
    initial timeout. When the first result gives a round trip, their deadlines come down to
    the measured timeout (RFC 6298 5.3 re-arms the timer with each estimate): a lost chunk
    whose NACK was lost too waits 10 ms, not 0.2 s. (The idle probe is put out of the way:
    a floor of 1 s.)"""
    cfg = WorkerConfig(initial_rto_s=0.2, min_rto_s=0.01, max_rto_s=1.0,
                       min_reorder_window_s=1.0)
    c = cluster(window=2, config=cfg)
    a0, a1 = c.addresses
    # Rank 0's chunk 1 never arrives (nor its re-sends by NACK: the switch's NACKs to it
    # are lost), so only its timer can recover it.
    script = Script(c.fabric, lambda h, src, dst, nth: (
        (h.type is MessageType.REQUEST and src == a0 and h.chunk == 1 and nth == 0)
        or (h.type is MessageType.NACK and dst == a0)))
    inputs = int_inputs(2, 8)
    outs = [np.empty_like(x) for x in inputs]
    t0 = c.fabric.now
    c.wait(c.start(inputs, outs))
    resent = script.sends(MessageType.REQUEST, src=a0, chunk=1)
    assert len(resent) == 2 and len(script.dropped) >= 1
    # Sent at t0; the first result came one round trip (100 us) later and set the timeout to
    # its 10 ms floor, so chunk 1's re-send left at t0 + 10 ms.
    assert resent[1].t == pytest.approx(t0 + 0.01)
    assert np.array_equal(outs[0], int_sum(inputs)) and np.array_equal(outs[1], outs[0])


def test_rto_adapts_to_measured_rtt_and_governs_retransmission() -> None:
    latency = 0.005  # RTT = 2 * latency = 10 ms exactly
    cfg = WorkerConfig(initial_rto_s=0.5, min_rto_s=0.001, max_rto_s=1.0)
    c = cluster(latency=latency, config=cfg)
    inputs = int_inputs(2, 4)
    c.allreduce(inputs)
    # First sample: srtt = 10 ms, rttvar = 5 ms, rto = srtt + 4 rttvar = 30 ms.
    for w in c.workers:
        assert w.rto_s == pytest.approx(0.03)
    a0 = c.addresses[0]
    script = Script(c.fabric, lambda h, src, dst, nth: (
        h.type is MessageType.REQUEST and src == a0 and nth == 0))
    outs = [np.empty_like(x) for x in inputs]
    t0 = c.fabric.now
    c.wait(c.start(inputs, outs))
    sends = script.sends(MessageType.REQUEST, src=a0)
    # The operation's only chunk: no later chunk of ours can show the loss (no NACK, no
    # tail-loss probe), so the 30 ms timeout re-sends it.
    assert [s.t for s in sends] == pytest.approx([t0, t0 + 0.03])
    assert c.workers[0].counters["retransmissions"] == 1
    assert np.array_equal(outs[0], int_sum(inputs))


@pytest.mark.parametrize("srtts,low,high", [(3.0, 0.0299, 0.0301), (1.0, 0.010, 0.0125)])
def test_steady_round_trips_keep_the_timeout_at_min_rto_srtts(srtts, low, high) -> None:
    """With steady 10 ms round trips rttvar decays and srtt + 4 rttvar falls towards srtt; the
    floor of ``min_rto_srtts`` round trips keeps the timeout above the time another rank's NACK
    recovery takes (1: plain RFC 6298)."""
    cfg = WorkerConfig(initial_rto_s=0.5, min_rto_s=0.001, max_rto_s=1.0, min_rto_srtts=srtts)
    c = cluster(latency=0.005, config=cfg)
    inputs = int_inputs(2, 4)
    for _ in range(30):
        c.allreduce(inputs)
    for w in c.workers:
        assert low <= w.rto_s <= high


def test_min_rto_srtts_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="min_rto_srtts must be >= 1"):
        WorkerConfig(min_rto_srtts=0.5)


def test_rto_is_clamped_to_min_rto() -> None:
    cfg = WorkerConfig(initial_rto_s=0.2, min_rto_s=0.05, max_rto_s=1.0)
    c = cluster(config=cfg)  # RTT 100 us -> srtt + 4 rttvar = 300 us, below the clamp
    c.allreduce(int_inputs(2, 4))
    assert c.workers[0].rto_s == pytest.approx(0.05)


def test_backoff_doubles_up_to_max_rto() -> None:
    cfg = WorkerConfig(initial_rto_s=0.1, min_rto_s=0.01, max_rto_s=0.5, op_timeout_s=20.0)
    c = cluster(config=cfg)
    a0 = c.addresses[0]
    losses = 6
    script = Script(c.fabric, lambda h, src, dst, nth: (
        h.type is MessageType.REQUEST and src == a0 and nth < losses))
    inputs = int_inputs(2, 4)
    outs = [np.empty_like(x) for x in inputs]
    t0 = c.fabric.now
    c.wait(c.start(inputs, outs))
    times = [s.t for s in script.sends(MessageType.REQUEST, src=a0)]
    assert len(times) == losses + 1
    assert times[0] == t0
    assert list(np.diff(times)) == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5, 0.5])
    w0 = c.workers[0]
    assert w0.counters["retransmissions"] == losses
    assert np.array_equal(outs[0], int_sum(inputs)) and np.array_equal(outs[1], outs[0])
    # rank 1's chunk was in but had no result: its retransmissions got WAITING naming rank 0.
    w1 = c.workers[1]
    # (rank 1 backs off on the same schedule, so its last retry may meet the completed round.)
    assert w1.counters["waiting_received"] >= losses - 1
    assert c.switch.waiting_sent == w1.counters["waiting_received"]


def test_backoff_restarts_for_the_next_chunk() -> None:
    cfg = WorkerConfig(initial_rto_s=0.1, min_rto_s=0.01, max_rto_s=0.5)
    c = cluster(config=cfg)
    a0 = c.addresses[0]
    # chunk 0 of rank 0 is lost twice; chunk 1 once.
    script = Script(c.fabric, lambda h, src, dst, nth: (
        h.type is MessageType.REQUEST and src == a0 and nth < (2 if h.chunk == 0 else 1)))
    inputs = int_inputs(2, 8)  # k=4, window=1: chunks 0 and 1 on the same lane
    outs = [np.empty_like(x) for x in inputs]
    c.wait(c.start(inputs, outs))
    t1 = [s.t for s in script.sends(MessageType.REQUEST, src=a0, chunk=1)]
    assert len(t1) == 2
    # Chunk 1's first send got a fresh tries count: retransmitted after the base RTO (still the
    # initial one: chunk 0's only result answered a retransmission), not after 4 * RTO.
    assert t1[1] - t1[0] == pytest.approx(0.1)
    assert np.array_equal(outs[0], int_sum(inputs))


def test_timer_is_the_earliest_of_retransmission_and_op_timeout() -> None:
    cfg = WorkerConfig(initial_rto_s=0.2, min_rto_s=0.01, max_rto_s=0.3, op_timeout_s=0.5)
    c = cluster(config=cfg)
    w0 = c.workers[0]
    inputs = int_inputs(2, 4)
    t0 = c.fabric.now
    c.start(inputs[:1], [np.empty_like(inputs[0])], ranks=[0])  # rank 1 never starts
    assert w0.get_timer() == pytest.approx(t0 + 0.2)
    c.fabric.run(lambda: w0.counters["retransmissions"] == 1)
    assert c.fabric.now == pytest.approx(t0 + 0.2)
    # next retransmission at t0 + 0.2 + min(0.4, 0.3) = t0 + 0.5 == the op timeout
    assert w0.get_timer() == pytest.approx(t0 + 0.5)
    c.fabric.run(lambda: w0.state is WorkerState.ERROR)
    assert c.fabric.now == pytest.approx(t0 + 0.5)
    assert "rank(s) [1]" in (w0.error or "")


# -- A dropped result is recovered from the switch's shadow copy ------------------------------


@pytest.mark.parametrize("chunk", [0, 3], ids=["exponent-only", "data"])
def test_dropped_result_is_resent_from_the_shadow_copy(chunk: int) -> None:
    n, window, k, size = 3, 2, 8, 8 * 8  # float32: L=8, E=2, T=10; lane 1 carries 1, 3, 5, ...
    cfg = WorkerConfig(initial_rto_s=0.05, min_rto_s=0.05, max_rto_s=0.5)
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    expected = MemoryCluster(num_workers=n, window=window, elements_per_packet=k).allreduce(inputs)

    c = cluster(n, window=window, k=k, config=cfg)
    a1 = c.addresses[1]
    script = Script(c.fabric, lambda h, src, dst, nth: (
        h.type is MessageType.RESULT and dst == a1 and h.chunk == chunk and nth == 0))
    outs = c.allreduce(inputs)
    for o in outs:
        assert np.array_equal(o, expected[0])
    assert len(script.dropped) == 1
    assert c.workers[1].counters["retransmissions"] == 1
    resent = [s for s in script.sends(MessageType.RESULT, dst=a1, chunk=chunk)
              if s.h.flags & Flags.RESENT]
    assert len(resent) == 1
    # (Ranks 0 and 2, blocked meanwhile, may also retry into the round rank 1 then completes
    # and get copies of their own; every copy is counted.)
    all_resent = [s for s in script.sends(MessageType.RESULT) if s.h.flags & Flags.RESENT]
    assert c.switch.results_resent == len(all_resent) >= 1
    original = script.dropped[0].h
    assert (resent[0].h.seq, resent[0].h.slot, resent[0].h.set_bit, resent[0].h.exp_data,
            resent[0].h.exp_next, resent[0].h.count) == (
        original.seq, original.slot, original.set_bit, original.exp_data, original.exp_next,
        original.count)
    # The other ranks had moved on to the next round on that slot (the other set) before
    # rank 1 asked again: the copy came from the shadow set, not from an open round.
    retrans_t = script.sends(MessageType.REQUEST, src=a1, chunk=chunk)[-1].t
    for r in (0, 2):
        nxt = script.sends(MessageType.REQUEST, src=c.addresses[r], chunk=chunk + window)
        assert nxt and nxt[0].t < retrans_t
        assert nxt[0].h.set_bit != original.set_bit
    for w in c.workers:
        assert w.counters["operations_completed"] == 1


# -- Control-plane timers ---------------------------------------------------------------------


def test_join_without_a_switch_fails_after_join_timeout() -> None:
    fabric = MemoryFabric()
    script = Script(fabric)
    spec = JobSpec(job_id=3, token=99, num_workers=2, window=2, elements_per_packet=4)
    cfg = WorkerConfig(join_timeout_s=3.0)
    w = WorkerEndpoint(spec=spec, rank=0, switch_address=("nowhere", 1), config=cfg)
    addr = ("w0", 4000)
    fabric.attach(addr, w)
    w.join(fabric.now)
    fabric.flush(addr)
    fabric.run(lambda: any(isinstance(e, JoinFailed) for e in fabric.events[addr]))
    assert fabric.now == pytest.approx(3.0)
    (ev,) = [e for e in fabric.events[addr] if isinstance(e, JoinFailed)]
    assert "nowhere:1" in ev.reason and "did not answer JOIN" in ev.reason
    assert "3 s" in ev.reason
    joins = [s.t for s in script.sends(MessageType.JOIN)]
    assert joins == pytest.approx([0.0, 0.2, 0.6, 1.4])  # retried with doubling backoff
    assert w.state is WorkerState.ERROR
    assert w.get_timer() is None
    x = np.ones(4, np.float32)
    with pytest.raises(LocalProtocolError, match="did not answer JOIN"):
        w.start_allreduce(x, x.copy(), fabric.now)


def test_cluster_join_with_detached_switch_raises() -> None:
    c = MemoryCluster(num_workers=2, worker_config=WorkerConfig(join_timeout_s=1.5))
    c.fabric.detach(SWITCH)
    with pytest.raises(SwitchMLError, match="did not answer JOIN"):
        c.join()
    assert c.fabric.now == pytest.approx(1.5)


def test_lost_joined_reply_is_recovered_by_retry() -> None:
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=4)
    a0 = c.addresses[0]
    script = Script(c.fabric, lambda h, src, dst, nth: (
        h.type is MessageType.JOINED and dst == a0 and nth == 0))
    c.join()
    assert len(script.dropped) == 1
    # The JOIN asking for a challenge, and the proven one a round trip (2 x 50 us) later;
    # the JOINED of that was lost, so the same again at the retry 0.2 s on.
    assert [s.t for s in script.sends(MessageType.JOIN, src=a0)] == pytest.approx(
        [0.0, 0.0001, 0.2, 0.2001])
    assert any(isinstance(e, Joined) for e in c.fabric.events[a0])
    inputs = int_inputs(2, 9)
    outs = c.allreduce(inputs)
    assert np.array_equal(outs[0], int_sum(inputs))
    assert any(isinstance(e, OperationCompleted) for e in c.fabric.events[a0])
