"""Switch-driven loss recovery (NACKs): crafted requests to the switch, then whole operations
on the in-memory fabric with scripted drops and timeouts far too long to be what recovers.

A worker sends chunk p on slot ``p mod E``; the first window (chunks 0 .. E-1) at once, and
every later chunk when the result of the chunk E before it (its release) arrives. When a
rank's chunk arrives whose release completed after the release of a chunk the switch still
lacks from it, the switch sends that rank a NACK naming the missing chunk.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_switch import join

from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.endpoint import Batch
from switchml.protocol.kernels import R
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import (
    EXP_ZERO,
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    pack_header,
    unpack_header,
    unpack_joined,
)
from switchml.protocol.worker import WorkerEndpoint
from switchml.transport.memory import FaultModel, MemoryCluster

JOB, TOKEN, N, W, K = 9, 0xABCDEF, 2, 4, 4
ADDRS = [("w0", 1000), ("w1", 1001)]


def _deliver(sw: SwitchDataplane, data: bytes, addr) -> list[tuple[Header, tuple]]:
    sw.receive_datagram(data, addr, now=0.0)
    return [(unpack_header(bytes(d)), a) for d, a in sw.datagrams_to_send(now=0.0)]


def _joined_switch(gap: int, calm: int = 64) -> tuple[SwitchDataplane, int]:
    sw = SwitchDataplane(SwitchConfig(nack_gap=gap, nack_calm=calm))
    bases = set()
    for r, addr in enumerate(ADDRS):
        (o,) = join(sw, JOB, TOKEN, r, ControlInfo(N, W, K), addr)
        assert o.header.type is MessageType.JOINED
        bases.add(unpack_joined(o.payload)[0].slot_base)
    (base,) = bases
    return sw, base


def _chunk(base: int, rank: int, p: int, *, E: int = W, L: int = 100,
           flags: int = 0) -> bytes:
    """Float-style request for chunk ``p`` of operation 0 as a worker builds it: slot
    ``p mod E``, set ``(p // E) % 2``, exponent of block p (p < L), data of block p - E."""
    has_data = p >= E
    f = (Flags.HAS_EXP if p < L else 0) | (Flags.HAS_DATA if has_data else 0) | flags
    payload = np.full(K if has_data else 0, rank + 1, "<i4").tobytes()
    h = Header(MessageType.REQUEST, JOB, rank=rank, token=TOKEN, seq=0, chunk=p,
               slot=base + p % E, set_bit=(p // E) % 2, count=len(payload) // 4,
               elem=ElementType.INT32, flags=int(f), exp_data=0 if has_data else EXP_ZERO,
               exp_next=3 if p < L else EXP_ZERO)
    return pack_header(h) + payload


def _nacks(out) -> list[tuple[int, int, int, tuple]]:
    return [(h.rank, h.chunk, h.slot, a) for h, a in out if h.type is MessageType.NACK]


def test_lost_request_in_first_window_is_nacked_when_a_later_chunk_arrives():
    sw, base = _joined_switch(gap=1)
    for p in range(W):
        assert _nacks(_deliver(sw, _chunk(base, 0, p), ADDRS[0])) == []
    # Rank 1's chunk 1 is lost: its chunk 2 shows it (the first window goes out in order).
    assert _nacks(_deliver(sw, _chunk(base, 1, 0), ADDRS[1])) == []
    out = _deliver(sw, _chunk(base, 1, 2), ADDRS[1])
    assert _nacks(out) == [(1, 1, base + 1, ADDRS[1])]
    assert sw.stats()["nacks_sent"] == 1
    # Once it arrives, later chunks raise no more NACKs for it.
    assert _nacks(_deliver(sw, _chunk(base, 1, 1), ADDRS[1])) == []
    assert _nacks(_deliver(sw, _chunk(base, 1, 3), ADDRS[1])) == []


def test_lost_result_is_nacked_once_later_releases_show_it():
    sw, base = _joined_switch(gap=1)
    for p in range(W):  # rounds 0..3 complete, in order
        for r in range(N):
            _deliver(sw, _chunk(base, r, p), ADDRS[r])
    for p in range(W, 2 * W):  # rank 0 got every result and sent chunks 4..7
        assert _nacks(_deliver(sw, _chunk(base, 0, p), ADDRS[0])) == []
    # Rank 1 lost the result of round 0, so it never sent chunk 4. Its chunk 5 arrives,
    # released by round 1, which completed after round 0 (the release of chunk 4).
    out = _deliver(sw, _chunk(base, 1, 5), ADDRS[1])
    assert _nacks(out) == [(1, 4, base + 0, ADDRS[1])]
    assert _nacks(_deliver(sw, _chunk(base, 1, 6), ADDRS[1])) == []  # told once
    # Rank 1 re-sends what it has outstanding on that lane (chunk 0): the switch answers
    # from the completed round with a copy of its result.
    out = _deliver(sw, _chunk(base, 1, 0), ADDRS[1])
    assert [(h.type, h.chunk, bool(h.flags & Flags.RESENT)) for h, _ in out] == [
        (MessageType.RESULT, 0, True)]


def test_in_order_traffic_raises_no_nack_and_gap_zero_turns_them_off():
    for gap, lost in ((1, False), (0, True)):
        sw, base = _joined_switch(gap=gap)
        for p in range(3 * W):
            for r in range(N):
                if lost and r == 1 and p == 1:
                    continue
                assert _nacks(_deliver(sw, _chunk(base, r, p), ADDRS[r])) == []
        assert sw.stats()["nacks_sent"] == 0


def test_a_needless_nack_resend_is_counted():
    sw, base = _joined_switch(gap=1)
    _deliver(sw, _chunk(base, 0, 0), ADDRS[0])
    _deliver(sw, _chunk(base, 1, 0), ADDRS[1])
    _deliver(sw, _chunk(base, 0, 1), ADDRS[0])
    # Rank 0 re-sends chunk 1 as a NACK's answer, but the switch had it: reordered, not lost.
    out = _deliver(sw, _chunk(base, 0, 1, flags=Flags.RESENT), ADDRS[0])
    assert [h.type for h, _ in out] == [MessageType.WAITING]
    assert sw.stats()["nacks_needless"] == 1


def test_a_widened_gap_halves_back_after_calm_rounds():
    """A needless NACK doubles the job's gap; nack_calm completed rounds without another
    halve it again, whether or not any NACK was sent meanwhile (a gap widened far enough sends
    none, so counting needed NACKs would never bring it back)."""
    sw, base = _joined_switch(gap=1, calm=3)
    gaps = lambda: sw.stats()["nack_gaps"][JOB]  # noqa: E731
    _deliver(sw, _chunk(base, 0, 0), ADDRS[0])
    _deliver(sw, _chunk(base, 1, 0), ADDRS[1])  # round 0 completes
    _deliver(sw, _chunk(base, 0, 1), ADDRS[0])
    _deliver(sw, _chunk(base, 0, 1, flags=Flags.RESENT), ADDRS[0])  # needless
    assert gaps() == 2
    for p, r in [(1, 1), (2, 0), (2, 1)]:  # rounds 1 and 2: two calm completions
        _deliver(sw, _chunk(base, r, p), ADDRS[r])
    assert gaps() == 2
    _deliver(sw, _chunk(base, 0, 3), ADDRS[0])
    _deliver(sw, _chunk(base, 1, 3), ADDRS[1])  # the third: halved back
    assert gaps() == 1
    assert sw.stats()["nacks_needless"] == 1


def test_needless_nacks_of_one_window_widen_the_gap_once():
    """NACKs sent before the gap widened come back needless together: one doubling per
    window of completions, not one per re-send (which would reach the cap at once)."""
    sw, base = _joined_switch(gap=1, calm=1000)
    gaps = lambda: sw.stats()["nack_gaps"][JOB]  # noqa: E731
    for r in range(N):
        _deliver(sw, _chunk(base, r, 0), ADDRS[r])  # round 0 completes
    for p in (1, 2):
        _deliver(sw, _chunk(base, 0, p), ADDRS[0])
    for p in (1, 2):  # two needless re-sends, no completion between them
        _deliver(sw, _chunk(base, 0, p, flags=Flags.RESENT), ADDRS[0])
    assert sw.stats()["nacks_needless"] == 2 and gaps() == 2
    for p in range(1, 2 * W):  # a window of completions later, a needless one widens again
        for r in range(N):
            if (r, p) not in ((0, 1), (0, 2)):
                _deliver(sw, _chunk(base, r, p), ADDRS[r])
    _deliver(sw, _chunk(base, 0, 2 * W - 1, flags=Flags.RESENT), ADDRS[0])
    assert sw.stats()["nacks_needless"] == 3 and gaps() == 4


def _one_op(drop_once, gap: int,
            drop) -> tuple[MemoryCluster, float, list[np.ndarray], np.ndarray]:
    # Timeouts of 2 s: anything that recovers sooner than that was not a timeout.
    cfg = WorkerConfig(initial_rto_s=2.0, min_rto_s=2.0, max_rto_s=4.0, op_timeout_s=30.0)
    c = MemoryCluster(num_workers=3, window=8, elements_per_packet=64, worker_config=cfg,
                      faults=FaultModel(latency_s=1e-4),
                      switch=SwitchDataplane(SwitchConfig(nack_gap=gap)))
    xs = [np.random.default_rng(r).standard_normal(64 * 40).astype(np.float32)
          for r in range(3)]
    c.fabric.drop_filter, state = drop_once(drop)
    t0 = c.fabric.now
    outs = c.allreduce(xs)
    assert state["dropped"], "the scripted drop never matched"
    return c, c.fabric.now - t0, outs, np.sum(np.array(xs, np.float64), 0)


@pytest.mark.parametrize("what", ["request", "result"])
def test_a_lost_datagram_is_recovered_by_nack_not_timeout(what, drop_once):
    def drop(h: Header, src, dst) -> bool:
        if what == "request":
            return h.type is MessageType.REQUEST and h.rank == 1 and h.chunk == 12
        return h.type is MessageType.RESULT and h.chunk == 12 and dst[1] == 4002

    c, elapsed, outs, ref = _one_op(drop_once, 4, drop)
    for out in outs:
        np.testing.assert_allclose(out, ref, atol=1e-4)
    assert elapsed < 0.5, f"took {elapsed:.3f} s of virtual time: a timeout, not a NACK"
    assert c.switch.stats()["nacks_sent"] >= 1
    assert sum(w.counters["nack_retransmissions"] for w in c.workers) >= 1
    # Each chunk's payload is counted once as sent; re-sends are counted apart.
    assert [w.counters["payload_bytes_sent"] for w in c.workers] == [64 * 40 * 4] * 3
    assert sum(w.counters["payload_bytes_resent"] for w in c.workers) > 0
    # Without NACKs the same loss waits until every other lane is done and the results stop:
    # then the idle probe recovers it (not the 2 s timeout), later than the NACK did.
    nacked = elapsed
    c, elapsed, outs, ref = _one_op(drop_once, 0, drop)
    np.testing.assert_allclose(outs[0], ref, atol=1e-4)
    assert nacked < elapsed < 0.5
    assert sum(w.counters["idle_probes"] for w in c.workers) >= 1
    assert sum(w.counters["timer_retransmissions"] for w in c.workers) == 0


def test_nacks_keep_sums_exact_under_random_loss_and_reordering():
    for jitter in (0.0, 2e-4):
        c = MemoryCluster(num_workers=4, window=16, elements_per_packet=128, seed=5,
                          faults=FaultModel(loss_rate=0.02, latency_s=1e-4, jitter_s=jitter))
        xs = [np.random.default_rng(r).standard_normal(128 * 70).astype(np.float32)
              for r in range(4)]
        ref = np.sum(np.array(xs, np.float64), 0)
        for _ in range(3):
            for out in c.allreduce(xs):
                np.testing.assert_allclose(out, ref, atol=1e-4)
        assert c.switch.stats()["nacks_sent"] > 0


class _Pair:
    """Two workers (float operation of 2 blocks on 2 lanes: chunks 0..3, 2 and 3 are the
    lanes' last) and a switch, pumped by hand so that every delivery's time is chosen."""

    def __init__(self) -> None:
        spec = JobSpec(job_id=JOB, token=TOKEN, num_workers=2, window=2, elements_per_packet=4)
        cfg = WorkerConfig(initial_rto_s=0.05, min_rto_s=0.05, max_rto_s=1.0)
        self.sw = SwitchDataplane(SwitchConfig(nack_gap=0))  # timeouts or probes only
        self.sa = ("switch", 1)
        self.pending: list[tuple[bytes, int]] = []
        self.w = [WorkerEndpoint(spec=spec, rank=r, switch_address=self.sa, config=cfg)
                  for r in range(2)]
        for r, w in enumerate(self.w):
            w.join(0.0)
            self.up(r, 0.0)
            self.down(0.0)  # CHALLENGE
            self.up(r, 0.0)
        self.down(0.0)

    def up(self, r: int, now: float, keep=lambda h: True) -> None:
        """Rank r's datagrams reach the switch (those ``keep`` accepts)."""
        for d, _ in self.w[r].datagrams_to_send(now):
            if keep(unpack_header(bytes(d))):
                self.sw.receive_datagram(bytes(d), ADDRS[r], now)

    def down(self, now: float, keep=lambda h, r: True) -> None:
        """The switch's datagrams reach the ranks (those ``keep`` accepts; the others stay on
        their way for a later ``down``)."""
        self.pending += [(bytes(d), ADDRS.index(a)) for d, a in self.sw.datagrams_to_send(now)]
        later = []
        for d, r in self.pending:
            if keep(unpack_header(d), r):
                self.w[r].receive_datagram(d, self.sa, now)
            else:
                later.append((d, r))
        self.pending = later

    def start_and_send_last_chunks(self) -> None:
        """Both ranks start; the first window's results reach them 1 ms apart per lane, so
        each rank sends chunk 2 at 1 ms and chunk 3 at 1.5 ms (RTT samples of ~1 ms)."""
        x = np.arange(8, dtype=np.float32)
        for r, w in enumerate(self.w):
            w.start_allreduce(x, np.empty_like(x), 0.0)
            self.up(r, 0.0)
        self.down(0.001, keep=lambda h, r: h.chunk == 0)
        self.down(0.0015, keep=lambda h, r: h.chunk == 1)


def test_a_lost_last_chunk_is_probed_when_a_later_chunk_has_its_result():
    p = _Pair()
    p.start_and_send_last_chunks()
    p.up(0, 0.0015)
    p.up(1, 0.0015, keep=lambda h: h.chunk != 2)  # rank 1's chunk 2 is lost
    a = p.w[0]
    assert a.get_timer() > 0.0025  # nothing says anything is lost yet
    # Round 3 completes: rank 0 gets the result of chunk 3, which it sent after chunk 2.
    p.down(0.0025, keep=lambda h, r: h.chunk == 3)
    # Chunk 2 is probed after a reorder window (1 ms, the default min_reorder_window_s).
    assert a.get_timer() == pytest.approx(0.0035)
    a.handle_timer(0.0035)
    assert [unpack_header(bytes(d)).chunk for d, _ in a.datagrams_to_send(0.0035)] == [2]
    assert a.counters["retransmissions"] == 1


def test_a_late_rank_causes_no_tail_probe_and_idle_probes_back_off():
    p = _Pair()
    p.start_and_send_last_chunks()
    p.up(0, 0.0015)  # rank 1 is slow: neither of its last chunks has arrived
    a = p.w[0]
    srtt = float(a.recovery.rtt[R.SRTT])
    assert 0.0009 < srtt < 0.0016
    # No result of a later chunk came: no tail probe. Only the idle probe, two round trips
    # after the last result (1.5 ms), re-sends both outstanding chunks; WAITING answers them
    # (rank 1 is missing), and each probe without a result doubles the wait for the next.
    probes = []
    while (t := a.get_timer()) < 0.030:
        a.handle_timer(t)
        probes.append((t, sorted(unpack_header(bytes(d)).chunk
                                 for d, _ in a.datagrams_to_send(t))))
    pto = 2 * srtt
    assert [t for t, _ in probes] == pytest.approx(
        [0.0015 + pto, 0.0015 + 3 * pto, 0.0015 + 7 * pto, 0.0015 + 15 * pto][:len(probes)])
    assert len(probes) == 3 and all(chunks == [2, 3] for _, chunks in probes)
    assert a.counters["tail_probes"] == 0 and a.counters["timer_retransmissions"] == 0
    p.up(1, 0.030)  # rank 1 catches up; both rounds complete, in order
    p.down(0.031)
    assert a.state.value == "ready" and a.counters["retransmissions"] == 6


def test_no_idle_probe_before_the_operations_last_window():
    """Mid-operation (chunks still to send after the outstanding ones) a silence says a peer
    stalls, and a lane held up by a loss only falls behind: no idle probe, the lanes'
    timeouts stand (50 ms here). In the last window it is armed again."""
    p = _Pair()
    x = np.arange(40, dtype=np.float32)  # 10 blocks on 2 lanes: 12 packets
    for r, w in enumerate(p.w):
        w.start_allreduce(x, np.empty_like(x), 0.0)
        p.up(r, 0.0)
    p.down(0.001)  # the first window's results: chunks 2 and 3 go out at 1 ms
    p.up(0, 0.001)  # rank 1 stalls: its chunks 2 and 3 do not arrive
    a = p.w[0]
    assert a.get_timer() == pytest.approx(0.001 + 0.05)  # the timeout, not 2 srtt
    a.handle_timer(0.001 + 0.05)
    assert a.counters["idle_probes"] == 0 and a.counters["timer_retransmissions"] == 2


def test_a_lost_result_of_the_last_chunks_is_recovered_by_the_idle_probe():
    """The end of an operation: both ranks' last chunks arrive, but the results to rank 0
    are lost. No later chunk shows the switch anything (NACKs) and no later result shows
    rank 0 anything (tail probes); the idle probe re-sends two round trips after the last
    result, and the switch answers from the completed rounds: long before the 50 ms
    timeout."""
    p = _Pair()
    p.start_and_send_last_chunks()
    p.up(0, 0.0015)
    p.up(1, 0.0015)
    p.down(0.002, keep=lambda h, r: r == 1)  # rank 0's results of chunks 2 and 3 are lost
    p.pending.clear()
    a, b = p.w
    assert b.state.value == "ready" and a.state.value == "busy"
    srtt = float(a.recovery.rtt[R.SRTT])
    t = a.get_timer()
    assert t == pytest.approx(0.0015 + 2 * srtt)  # the last result came at 1.5 ms
    a.handle_timer(t)
    p.up(0, t)
    p.down(t + 0.0005)
    assert a.state.value == "ready" and a.counters["idle_probes"] == 2
    assert a.counters["timer_retransmissions"] == 0


def _nack_to(p: _Pair, r: int, chunk: int, now: float) -> list[Header]:
    """A crafted NACK for ``chunk`` to rank r; the datagrams it answers with."""
    slot = p.w[r].slot_base + chunk % 2
    h = Header(MessageType.NACK, JOB, rank=r, token=TOKEN, seq=p.seq, chunk=chunk, slot=slot,
               elem=ElementType.BYTES)
    p.w[r].receive_datagram(pack_header(h), p.sa, now)
    return [unpack_header(bytes(d)) for d, _ in p.w[r].datagrams_to_send(now)]


def test_a_nack_resend_after_a_timeout_resend_is_not_marked_as_its_answer():
    """The switch widens its NACK gap when a re-send marked as a NACK's answer (RESENT) finds
    the chunk already in: then the original was only late. A re-send after the chunk was
    already re-sent by a timeout says nothing of the kind (the timeout's copy got in first),
    so it is not marked; otherwise timeouts racing NACKs would widen the gap and turn NACKs
    off for the rest of the job."""
    p = _Pair()
    p.start_and_send_last_chunks()
    sent = [unpack_header(bytes(d)) for d, _ in p.w[1].datagrams_to_send(0.0015)]
    p.seq = sent[0].seq
    # Rank 1's chunk 2 (sent first) was lost; its timer (the idle probe, two round trips
    # after the last result) re-sends it and chunk 3, unmarked.
    b = p.w[1]
    t = b.get_timer()
    b.handle_timer(t)
    resent = [unpack_header(bytes(d)) for d, _ in b.datagrams_to_send(t)]
    assert [h.chunk for h in resent] == [2, 3]
    assert not any(h.flags & Flags.RESENT for h in resent)
    # A NACK for chunk 2 comes after the timeout's re-send: re-sent again, unmarked.
    (again,) = _nack_to(p, 1, 2, t + 0.01)
    assert again.chunk == 2 and not again.flags & Flags.RESENT
    assert b.counters["nack_retransmissions"] == 1


@pytest.mark.parametrize("rack", [False, True])
def test_the_results_kernel_answers_a_nack_in_a_batch_and_goes_on(rack, monkeypatch):
    """A NACK amid results (one receive call): the results kernel re-sends the lane's chunk
    itself and takes the result after it, without a turn through Python (the compiled loop
    keeps running under loss). With RACK on, NACKs go to Python, which logs the re-send; the
    outcome is the same."""
    p = _Pair()
    for w in p.w:
        w.recovery.fast_retransmit = rack
    p.start_and_send_last_chunks()
    p.up(0, 0.0016)
    p.up(1, 0.0016, keep=lambda h: h.chunk != 2)  # rank 1's chunk 2 is lost; 3 arrives
    to_b = [bytes(d) for d, a in p.sw.datagrams_to_send(0.0016) if a == ADDRS[1]]
    (result,) = [d for d in to_b if unpack_header(d).type is MessageType.RESULT]
    assert unpack_header(result).chunk == 3
    b = p.w[1]
    in_python = []
    real = b._handlers[MessageType.NACK]
    monkeypatch.setitem(b._handlers, MessageType.NACK,
                        lambda *a: (in_python.append(1), real(*a)))
    nack = pack_header(Header(MessageType.NACK, JOB, rank=1, token=TOKEN,
                              seq=unpack_header(result).seq, chunk=2, slot=b.slot_base,
                              elem=ElementType.BYTES))
    before = b.counters["results_received"]
    b.receive_many(Batch.of_pairs([(p.sa, nack), (p.sa, result)]), 0.002)
    out = [unpack_header(bytes(d)) for d, _ in b.datagrams_to_send(0.002)]
    assert [h.chunk for h in out] == [2] and out[0].flags & Flags.RESENT
    assert b.counters["nack_retransmissions"] == 1
    assert b.counters["results_received"] == before + 1  # the result after the NACK
    assert in_python == ([1] if rack else [])


def test_a_nack_answered_by_a_first_resend_is_marked():
    p = _Pair()
    p.start_and_send_last_chunks()
    sent = [unpack_header(bytes(d)) for d, _ in p.w[1].datagrams_to_send(0.0015)]
    p.seq = sent[0].seq
    (first,) = _nack_to(p, 1, 2, 0.004)  # before any timeout: the chunk's first re-send
    assert first.chunk == 2 and first.flags & Flags.RESENT


def test_a_nack_soon_after_a_first_transmission_is_answered_but_one_after_a_resend_waits():
    """The switch NACKs a chunk only once a later chunk of the rank arrived, so a first
    transmission it names was lost even if it left less than a round trip ago; a chunk
    re-sent less than a round trip ago may have its answer on the way (ignored)."""
    p = _Pair()
    p.start_and_send_last_chunks()  # rank 1 sent chunk 3 at 1.5 ms; round trips of ~1 ms
    sent = [unpack_header(bytes(d)) for d, _ in p.w[1].datagrams_to_send(0.0015)]
    p.seq = sent[0].seq
    (resent,) = _nack_to(p, 1, 3, 0.0016)
    assert resent.chunk == 3 and resent.flags & Flags.RESENT
    assert _nack_to(p, 1, 3, 0.0017) == []  # its re-send left 0.1 ms ago
    assert p.w[1].counters["nacks_ignored"] == 1
    assert p.w[1].counters["nack_retransmissions"] == 1
