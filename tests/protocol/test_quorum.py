"""Quorum rounds on the switch (``JobSpec.quorum``), with crafted packets.

A quorum job's round completes when ``k`` of its ``n`` ranks have contributed; the result
says which (a bitmap after the payload, flag ``CONTRIBUTORS``); a rank whose chunk comes after
that gets the stored result and is not added. Every expected sum here is written out by hand.
A job without a quorum is the rest of the suite (unchanged).
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchml.protocol import wire
from switchml.protocol.config import JobSpec
from switchml.protocol.endpoint import exchange
from switchml.protocol.lifecycle import WorkerState
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import Flags, MessageType, unpack_header
from switchml.protocol.worker import WorkerEndpoint

SW = ("127.0.0.1", 2)


def _addr(rank: int) -> tuple[str, int]:
    return ("127.0.0.1", 10 + rank)


def _job(n: int = 3, quorum: int | None = 2):
    """A switch with a job of ``n`` joined ranks, and each rank's REQUEST of a 3-element int32
    sum (rank r sends ``[1, 2, 3] * 10**r``), as the worker library makes it."""
    spec = JobSpec(job_id=9, token=0x0BAD_F00D_1234, num_workers=n, window=4,
                   elements_per_packet=16, quorum=quorum)
    sw = SwitchDataplane()
    requests = []
    for r in range(n):
        w = WorkerEndpoint(spec=spec, rank=r, switch_address=SW)
        w.join(0.0)
        exchange({_addr(r): w, SW: sw}, 0.0)
        x = np.array([1, 2, 3], np.int32) * 10 ** r
        w.start_allreduce(x, np.empty_like(x), 0.0)
        (d, _), = w.datagrams_to_send(0.0)
        requests.append(bytes(d))
    sw.datagrams_to_send(0.0)  # (nothing: JOINED went out in exchange)
    return sw, requests


def _send(sw, rank: int, data: bytes, now: float = 1.0):
    sw.receive_datagram(data, _addr(rank), now)
    return [(bytes(d), a) for d, a in sw.datagrams_to_send(now)]


def _result(d: bytes):
    """(header, int32 payload, contributor bitmap or None) of a RESULT."""
    h = unpack_header(d)
    assert h.type is MessageType.RESULT
    payload = list(struct.unpack_from(f"<{h.count}i", d, wire.HEADER_SIZE))
    return h, payload, wire.contributors(d, h)


def test_a_quorum_round_completes_with_k_ranks_and_says_which():
    sw, req = _job(n=3, quorum=2)
    assert _send(sw, 0, req[0]) == []
    out = _send(sw, 2, req[2])
    assert sorted(a for _, a in out) == [_addr(0), _addr(1), _addr(2)]  # multicast to all 3
    for d, _ in out:
        h, payload, ranks = _result(d)
        assert payload == [101, 202, 303]  # ranks 0 and 2: [1, 2, 3] + [100, 200, 300]
        assert ranks == 0b101 and h.flags & Flags.CONTRIBUTORS
        assert not h.flags & Flags.RESENT
        assert len(d) == wire.HEADER_SIZE + 3 * 4 + 1  # one bitmap byte for 3 ranks


def _retry(d: bytes) -> bytes:
    """The request as the worker re-sends it in a quorum job (flag RETRY)."""
    b = bytearray(d)
    b[wire.AT["flags"]] |= Flags.RETRY
    return bytes(b)


def test_a_late_rank_gets_the_stored_result_and_is_not_added():
    sw, req = _job(n=3, quorum=2)
    _send(sw, 0, req[0])
    out = _send(sw, 1, req[1])  # complete: [11, 22, 33] from ranks 0 and 1, to all three
    assert sorted(a for _, a in out) == [_addr(0), _addr(1), _addr(2)]
    # Rank 2's first transmission comes late: dropped (the multicast reached it), not added.
    assert _send(sw, 2, req[2]) == []
    assert sw.stats()["drops"]["late_duplicate"] == 1
    # Its re-send (it lost the multicast) gets a unicast copy of the stored result.
    out = _send(sw, 2, _retry(req[2]), now=2.0)
    assert [a for _, a in out] == [_addr(2)]
    h, payload, ranks = _result(out[0][0])
    assert payload == [11, 22, 33] and ranks == 0b011  # rank 2's [100, ...] is not in it
    assert h.flags & Flags.RESENT
    assert sw.stats()["late_contributions"] == 1 and sw.stats()["results_multicast"] == 1
    out = _send(sw, 2, _retry(req[2]), now=3.0)  # again: the same answer, still not added
    assert _result(out[0][0])[1:] == ([11, 22, 33], 0b011)
    assert sw.stats()["late_contributions"] == 2


def _one_slot_job(config=None):
    """A switch (``config``) and the three joined workers of a job of one slot, quorum 2."""
    spec = JobSpec(job_id=9, token=77, num_workers=3, window=1, elements_per_packet=4,
                   quorum=2)
    sw = SwitchDataplane(config)
    ws = []
    for r in range(3):
        w = WorkerEndpoint(spec=spec, rank=r, switch_address=SW)
        w.join(0.0)
        exchange({_addr(r): w, SW: sw}, 0.0)
        ws.append(w)
    return sw, ws


def test_a_rank_left_rounds_behind_gets_them_from_the_history():
    """Ranks 0 and 1 (quorum 2 of 3) run two more rounds on the slot, overwriting both sets:
    rank 2's re-sent first round is answered from the slot's history."""
    sw, ws = _one_slot_job()
    firsts = {}
    for op in range(3):  # three one-chunk operations on the one slot: sets 0, 1, 0 again
        # (Rank 2 starts the first before the others, its request lost; then after them: it
        # has their result then, and sends nothing.)
        for r in (2, 0, 1) if op == 0 else (0, 1, 2):
            x = np.array([op + 1, 10 * r], np.int32)
            ws[r].start_allreduce(x, np.empty_like(x), float(op))
            sent = ws[r].datagrams_to_send(float(op))
            if r == 2 and op > 0:
                assert sent == [] and ws[r].counters["operations_completed"] == op + 1
                continue
            (d, _), = sent
            if op == 0:
                firsts[r] = bytes(d)
            if r < 2:
                for res, a in _send(sw, r, bytes(d), now=float(op)):
                    ws[[_addr(q) for q in range(3)].index(a)].receive_datagram(res, SW,
                                                                              float(op))
    out = _send(sw, 2, _retry(firsts[2]), now=5.0)
    h, payload, ranks = _result(out[0][0])
    assert (h.seq, payload, ranks) == (0, [2, 10], 0b011)  # op 0: ranks 0 and 1 only
    assert sw.stats()["old_results_answered"] == 1
    assert sw.stats()["drops"].get("stale", 0) == 0
    assert _send(sw, 2, firsts[2], now=6.0) == []  # a first transmission: no answer


def _left_behind(history: int, ops: int):
    """Ranks 0 and 1 (quorum 2 of 3, one slot) run ``ops`` one-chunk operations while rank 2,
    in the first, hears nothing (its request and every result to it lost). Returns the
    switch, rank 2's worker and its first request."""
    from switchml.protocol.config import SwitchConfig
    sw, ws = _one_slot_job(SwitchConfig(quorum_history=history))
    x = np.array([1, 20], np.int32)
    ws[2].start_allreduce(x, np.empty_like(x), 0.0)
    (first, _), = ws[2].datagrams_to_send(0.0)
    for op in range(ops):
        for r in (0, 1):
            x = np.array([op + 1, 10 * r], np.int32)
            ws[r].start_allreduce(x, np.empty_like(x), float(op))
            (d, _), = ws[r].datagrams_to_send(float(op))
            for res, a in _send(sw, r, bytes(d), now=float(op)):
                if a != _addr(2):
                    ws[[_addr(q) for q in range(3)].index(a)].receive_datagram(
                        res, SW, float(op))
    return sw, ws[2], bytes(first)


@pytest.mark.parametrize("history", [0, 2])
def test_a_resend_of_a_round_past_the_history_is_answered_gone_and_fails_at_once(history):
    """Past the slot's history (``history`` rounds, after the two sets), rank 2's re-sent
    first round is answered GONE, sealed, echoing it; rank 2's operation fails on it at once
    with RoundGone, naming the round (it waited ``op_timeout_s`` before). Its first
    transmission gets no answer; a round still in the history is answered with its result."""
    from switchml.protocol.auth import reply_sealed
    from switchml.protocol.events import OperationAborted
    sw, w2, first = _left_behind(history, ops=history + 3)
    assert _send(sw, 2, first, now=10.0) == []  # a first transmission: dropped as stale
    (gone, a), = _send(sw, 2, _retry(first), now=10.5)
    h, req = unpack_header(gone), unpack_header(first)
    assert a == _addr(2) and h.type is MessageType.GONE and h.flags & Flags.AUTH
    assert (h.seq, h.chunk, h.slot, h.set_bit, h.rank) == (req.seq, req.chunk, req.slot,
                                                          req.set_bit, 2)
    assert reply_sealed(w2._key, gone, h)
    assert sw.stats()["rounds_gone_answered"] == 1
    # A GONE whose sealed bytes were altered is dropped; an unsealed one too.
    other = bytearray(gone)
    other[wire.AT["chunk"]:wire.AT["chunk"] + 4] = (5).to_bytes(4, "little")
    w2.receive_datagram(bytes(other), SW, 10.6)
    unsealed = bytearray(gone[:wire.HEADER_SIZE])
    unsealed[wire.AT["flags"]] &= ~Flags.AUTH
    w2.receive_datagram(bytes(unsealed), SW, 10.6)
    assert w2.state is WorkerState.BUSY and w2.drops["unauthenticated_reply"] == 2
    w2.receive_datagram(gone, SW, 10.7)
    assert w2.state is not WorkerState.BUSY and w2.counters["gone_received"] == 1
    ev, = [e for e in iter(w2.next_event, None) if isinstance(e, OperationAborted)]
    assert ev.gone and ev.seq == req.seq
    assert "completed without this rank" in ev.reason and "rejoin" in ev.reason
    # One operation fewer behind: the first round is still in the history (with none, in the
    # shadow set), and answered with its result.
    sw, _w2, first = _left_behind(history, ops=history + 2)
    out = _send(sw, 2, _retry(first), now=10.5)
    assert _result(out[0][0])[0].type is MessageType.RESULT
    stats = sw.stats()
    assert stats["rounds_gone_answered"] == 0
    assert stats["old_results_answered" if history else "late_contributions"] == 1


def test_a_stale_gone_about_a_chunk_whose_result_came_is_dropped():
    """A sealed GONE that names the operation in flight but a chunk its lane is not waiting
    for (its result came by another path) changes nothing (``stale_gone``)."""
    from switchml.protocol.auth import seal_reply
    from switchml.protocol.wire import Header, pack_header
    sw, w2, first = _left_behind(0, ops=3)
    req = unpack_header(first)
    other_chunk = pack_header(Header(MessageType.GONE, req.job, rank=2, token=req.token,
                                     seq=req.seq, chunk=req.chunk + 1, slot=req.slot,
                                     set_bit=req.set_bit))
    w2.receive_datagram(seal_reply(w2._key, other_chunk), SW, 10.0)
    assert w2.state is WorkerState.BUSY and w2.drops["stale_gone"] == 1


def test_a_resend_into_a_quorum_round_counts_once():
    sw, req = _job(n=4, quorum=3)
    _send(sw, 0, req[0])
    waiting = _send(sw, 0, req[0], now=1.5)  # re-sent while open: WAITING, not added again
    assert [unpack_header(d).type for d, _ in waiting] == [MessageType.WAITING]
    missing = int.from_bytes(waiting[0][0][wire.HEADER_SIZE:wire.HEADER_SIZE + 1], "little")
    assert missing == 0b1110
    assert _send(sw, 3, req[3]) == []  # two of three
    out = _send(sw, 1, req[1])
    h, payload, ranks = _result(out[0][0])
    assert payload == [1011, 2022, 3033] and ranks == 0b1011  # rank 0 once, not twice
    # A contributor re-sends into the complete round (its result was lost): the same copy.
    again = _send(sw, 3, req[3], now=2.0)
    assert _result(again[0][0])[1:] == ([1011, 2022, 3033], 0b1011)
    assert sw.stats()["results_resent"] == 1 and sw.stats()["late_contributions"] == 0


def test_a_quorum_of_one_completes_at_the_first_contribution():
    sw, req = _job(n=2, quorum=1)
    out = _send(sw, 1, req[1])
    assert len(out) == 2 and _result(out[0][0])[1:] == ([10, 20, 30], 0b10)


def test_without_a_quorum_every_rank_is_needed_and_results_carry_no_bitmap():
    sw, req = _job(n=3, quorum=None)
    _send(sw, 0, req[0])
    assert _send(sw, 1, req[1]) == []  # two of three: still open
    out = _send(sw, 2, req[2])
    h, payload, ranks = _result(out[0][0])
    assert payload == [111, 222, 333] and ranks is None
    assert h.flags & Flags.CONTRIBUTORS == 0 and len(out[0][0]) == wire.HEADER_SIZE + 12
    # A re-send into the complete round gets a copy (the result was lost), as ever.
    assert _result(_send(sw, 2, req[2])[0][0])[1:] == ([111, 222, 333], None)


def test_joins_that_disagree_about_the_quorum_are_refused():
    sw = SwitchDataplane()
    a = WorkerEndpoint(spec=JobSpec(job_id=4, token=5, num_workers=3, quorum=2), rank=0,
                       switch_address=SW)
    b = WorkerEndpoint(spec=JobSpec(job_id=4, token=5, num_workers=3), rank=1,
                       switch_address=SW)
    for r, w in enumerate((a, b)):
        w.join(0.0)
        exchange({_addr(r): w, SW: sw}, 0.0)
    assert a.state is WorkerState.READY and b.state is not WorkerState.READY
    assert "quorum=2 (at 0 us: 0); asked" in str(b.error) and "quorum=none" in str(b.error)


@pytest.mark.parametrize("quorum", [0, 4, -1, 2.0])
def test_a_quorum_outside_1_to_n_is_refused(quorum):
    # (2.0: refused as a float where an integer belongs, before the range is checked)
    with pytest.raises(ValueError, match="quorum must be (None or )?an integer"):
        JobSpec(job_id=1, token=2, num_workers=3, quorum=quorum)


# -- whole operations over the in-memory fabric ------------------------------------------------

def _one_hot(n: int, size: int, dtype) -> list[np.ndarray]:
    """Rank r contributes 2**r everywhere: a sum says which ranks it holds."""
    return [np.full(size, 1 << r, dtype) for r in range(n)]


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_a_rank_that_starts_late_completes_from_the_results_it_was_sent(dtype):
    """Ranks 0-2 of 4 (quorum 3) finish each operation before rank 3 starts it; rank 3 then
    completes at once from the results the switch multicast meanwhile, with the same sum."""
    from switchml.transport.memory import MemoryCluster
    c = MemoryCluster(num_workers=4, window=4, elements_per_packet=8, quorum=3, seed=1)
    for _ in range(3):
        xs = _one_hot(4, 100, dtype)
        outs = [np.empty_like(x) for x in xs]
        fast = c.start(xs[:3], outs[:3], ranks=[0, 1, 2])
        c.wait(fast)
        t = c.fabric.now
        slow = c.start(xs[3:], outs[3:], ranks=[3])
        c.wait(slow)
        assert c.fabric.now == t  # no round trip: every result was already there
        for o in outs:
            assert (o == 7).all()  # 1 + 2 + 4: ranks 0, 1 and 2
        for h in fast + slow:
            assert (h.contributor_counts() == 3).all()
    counters = c.workers[3].counters
    assert counters["results_taken_ahead"] > 0 and counters["results_left_out"] > 0


def test_without_a_quorum_a_late_start_waits_for_its_rank():
    from switchml.transport.memory import MemoryCluster
    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=8, seed=1)
    xs = _one_hot(3, 50, np.int32)
    fast = c.start(xs[:2], ranks=[0, 1])
    t = c.fabric.now
    c.fabric.run(lambda: c.fabric.now > t + 1.0)  # a second of virtual time: rank 2 is needed
    assert not any(h.done() for h in fast)
    c.wait(fast + c.start(xs[2:], ranks=[2]))
    assert all((x == 7).all() for x in xs) and fast[0].contributor_counts() is None


def _start_late(c, handles, r, x, out):
    handles[r] = c.start([x], [out], ranks=[r])[0]


def _all_done(handles, ranks):
    return ranks <= set(handles) and all(handles[r].done() for r in ranks)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_rank_ends_each_operation_with_the_same_sum_under_stragglers_and_loss(data):
    """A random schedule of stragglers (a rank that starts an operation a little late, or
    only after the others finished it) and loss: every rank that completes an operation has
    the same result, bit for bit; each block of it is the sum of the one-hot inputs of the
    ranks its contributor count names (at least k); the on-time ranks always complete. A
    straggler that starts after the others finished and then loses one of the results the
    switch multicast cannot get it again (the switch has moved on): its operation fails with
    a clear error, RoundGone, as soon as it re-sends (the switch answers GONE; counted here,
    not hidden)."""
    from switchml.protocol.config import WorkerConfig
    from switchml.protocol.errors import RoundGone
    from switchml.transport.memory import FaultModel, MemoryCluster, MemoryFabric
    n = data.draw(st.integers(3, 5), "n")
    k = data.draw(st.integers((n + 1) // 2, n - 1), "quorum")
    loss = data.draw(st.sampled_from([0.0, 0.02, 0.05]), "loss")
    seed = data.draw(st.integers(0, 2**16), "seed")
    dtype = data.draw(st.sampled_from([np.int32, np.float32]), "dtype")
    fabric = MemoryFabric(FaultModel(loss_rate=loss, reorder_rate=0.05, latency_s=1e-4,
                                     jitter_s=5e-5), seed)
    config = WorkerConfig(initial_rto_s=0.01, max_rto_s=0.05, op_timeout_s=0.5)
    c = MemoryCluster(num_workers=n, window=4, elements_per_packet=8, quorum=k, seed=seed,
                      fabric=fabric, worker_config=config)
    alive = set(range(n))
    for op in range(4):
        late = data.draw(st.sets(st.sampled_from(sorted(alive)), max_size=n - k), f"late{op}")
        after = {r for r in late if data.draw(st.booleans(), f"after{op}.{r}")}
        # int32: one-hot, a sum names its ranks; float32: 1.0 each, a sum counts them (the
        # same exponent everywhere: nothing is clamped).
        xs = _one_hot(n, 200, dtype) if dtype == np.int32 else [np.ones(200, dtype)] * n
        xs = [x.copy() for x in xs]
        outs = [np.empty_like(x) for x in xs]
        on_time = sorted(alive - late)
        handles = dict(zip(on_time, c.start([xs[r] for r in on_time], [outs[r] for r in on_time],
                                            ranks=on_time)))
        for r in sorted(late - after):
            delay = data.draw(st.floats(0, 2e-3), f"delay{op}.{r}")
            c.fabric.call_at(c.fabric.now + delay, functools.partial(
                _start_late, c, handles, r, xs[r], outs[r]))
        ready = alive - after
        c.fabric.run(functools.partial(_all_done, handles, ready))
        for r in sorted(after):
            _start_late(c, handles, r, xs[r], outs[r])
        c.fabric.run(functools.partial(_all_done, handles, set(handles)))
        done = {}
        for r, h in handles.items():
            if h.exception() is None:
                done[r] = h
            else:
                assert r in after and isinstance(h.exception(), RoundGone), h.exception()
                alive.discard(r)  # its job failed: it takes no further part
        assert set(on_time) <= set(done)
        first = outs[on_time[0]]
        counts = done[on_time[0]].contributor_counts()
        for r in done:
            assert outs[r].tobytes() == first.tobytes()
            assert np.array_equal(done[r].contributor_counts(), counts)
        if dtype == np.int32:
            assert all(bin(int(v)).count("1") == int(m) for v, m in zip(first, counts))
        else:
            assert np.array_equal(first, counts.astype(np.float32))
        assert (counts >= k).all()


def test_the_metrics_show_the_quorum_and_the_late_ranks_answers():
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from switchml.control.metrics import SwitchCollector
    sw, req = _job(n=3, quorum=2)
    _send(sw, 0, req[0])
    _send(sw, 1, req[1])
    _send(sw, 2, _retry(req[2]))
    registry = CollectorRegistry()
    registry.register(SwitchCollector(lambda: {**sw.stats(), "job_states": sw.job_states(2.0)},
                                      pool_slots=sw.config.pool_slots))
    text = generate_latest(registry).decode()
    assert 'switchml_job_quorum{job_id="9"} 2.0' in text
    assert "switchml_late_contributions_total 1.0" in text
    assert "switchml_old_results_answered_total 0.0" in text
    assert "switchml_members_joined_total 3.0" in text  # the job's three ranks
    assert "switchml_members_left_total 0.0" in text and "switchml_jobs_expired_total 0.0" in text


def _ahead_setup(keep_bytes: int = 256 * 2**20):
    """Rank 1 of a 2-rank job with a quorum of 1 runs operation 0 alone; the switch's results,
    addressed to rank 0 as well, are returned (rank 0 joined, idle)."""
    from switchml.protocol.config import WorkerConfig
    spec = JobSpec(job_id=9, token=77, num_workers=2, window=2, elements_per_packet=4,
                   quorum=1)
    sw = SwitchDataplane()
    ws = [WorkerEndpoint(spec=spec, rank=r, switch_address=SW,
                         config=WorkerConfig(quorum_keep_bytes=keep_bytes)) for r in range(2)]
    for r, w in enumerate(ws):
        w.join(0.0)
        exchange({_addr(r): w, SW: sw}, 0.0)
    x = np.arange(10, dtype=np.float32) + 1
    out1 = np.empty_like(x)
    ws[1].start_allreduce(x, out1, 1.0)
    to_rank0 = []
    for _ in range(20):  # rank 1 alone drives the operation; rank 0 listens
        for d, _ in ws[1].datagrams_to_send(1.0):
            for res, a in _send(sw, 1, bytes(d)):
                (ws[1].receive_datagram(res, SW, 1.0) if a == _addr(1)
                 else to_rank0.append(res))
    assert (out1 == x).all()  # a sum of rank 1 alone
    return ws[0], to_rank0, x


def _batch_of(datagrams):
    from switchml.protocol.endpoint import Batch
    return Batch.of_pairs([(SW, d) for d in datagrams])


def test_results_kept_ahead_are_checked_first_and_complete_the_operation():
    w, results, x = _ahead_setup()
    forged = []
    for d in results[:3]:
        b = bytearray(d)
        b[12] ^= 1  # another token
        forged.append(bytes(b))
        forged.append(d[:-1])  # cut short
        c = bytearray(d)
        c[4] &= ~0x10  # no contributor bitmap flag
        forged.append(bytes(c))
        s = bytearray(d)
        s[20:24] = (5000).to_bytes(4, "little")  # an operation too far ahead
        forged.append(bytes(s))
    w.receive_many(_batch_of(forged + results), 2.0)
    assert w.counters["results_kept_ahead"] == len(results)
    assert sum(w.drops.values()) == len(forged)
    out0 = np.empty_like(x)
    w.start_allreduce(x * 100, out0, 3.0)  # rank 0 starts late: done at once, rank 1's sum
    assert (out0 == x).all() and w.counters["operations_completed"] == 1


def test_results_kept_ahead_hold_their_own_bytes_not_their_receive_slots():
    """recvmmsg gives each datagram a 64 KiB slot: the kept results of a batch must hold
    their own bytes, not the buffer they lay in (a copy of that span once held 58-1,600 times
    what ``quorum_keep_bytes`` counts). Measured with tracemalloc (numpy reports its buffers
    to it), against the results' own size; and the results still complete the operation."""
    import tracemalloc

    from switchml.protocol.endpoint import Batch
    w, results, x = _ahead_setup()
    slot = 1 << 16
    buf = np.zeros(len(results) * slot, np.uint8)
    for i, d in enumerate(results):
        buf[i * slot:i * slot + len(d)] = np.frombuffer(d, np.uint8)
    n = len(results)
    batch = Batch(buf, np.arange(n, dtype=np.int64) * slot,
                  np.array([len(d) for d in results], np.int64), np.zeros(n, np.int64), n,
                  lambda _i: SW, sender=SW)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        w.receive_many(batch, 2.0)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # what this receive left allocated in the code that keeps results ahead
    kept = sum(d.size_diff for d in after.compare_to(before, "filename")
               if d.traceback[0].filename.endswith("worker_ahead.py"))
    own = sum(len(d) for d in results)
    assert w.counters["results_kept_ahead"] == n
    assert own <= kept < own + 4096, (kept, own, n * slot)  # not the slots' n x 64 KiB
    out0 = np.empty_like(x)
    w.start_allreduce(x * 100, out0, 3.0)
    assert (out0 == x).all() and w.counters["operations_completed"] == 1


def test_an_operation_whose_every_result_is_kept_sends_no_request():
    """A rank behind that starts an operation the others finished completes it from the
    results it kept and sends nothing (the switch would drop each request as late); one
    that lacks a result sends its window, as any rank does."""
    w, results, x = _ahead_setup()
    w.receive_many(_batch_of(results), 2.0)
    out0 = np.empty_like(x)
    w.start_allreduce(x * 100, out0, 3.0)
    assert (out0 == x).all() and w.counters["operations_completed"] == 1
    assert w.datagrams_to_send(3.0) == [] and w.counters["requests_not_sent"] > 0
    last = max(results, key=lambda d: int.from_bytes(d[24:28], "little"))
    w, results, x = _ahead_setup()
    w.receive_many(_batch_of([d for d in results if d[24:28] != last[24:28]]), 2.0)
    w.start_allreduce(x * 100, np.empty_like(x), 3.0)
    assert w.datagrams_to_send(3.0) and not w.counters["requests_not_sent"]


def test_results_beyond_the_keep_budget_are_dropped_and_counted():
    w, results, x = _ahead_setup(keep_bytes=100)
    w.receive_many(_batch_of(results), 2.0)
    assert w.counters.get("results_kept_ahead", 0) == 0
    assert w.drops["ahead_dropped"] == len(results)


def _after(fabric, t):
    return fabric.now > t


def test_a_dead_rank_does_not_stop_a_quorum_job():
    """Rank 3 of 4 (quorum 3) dies after the first operation, and the switch soon counts it
    gone (its member timeout). Ranks 0 and 1 then start each operation before rank 2 and
    re-send into the open rounds: the switch answers WAITING for ranks 2 and 3, 3 gone, which
    fails a job without a quorum naming it; a quorum job waits for rank 2 and goes on, every
    operation complete, without a restart."""
    from switchml.protocol.config import SwitchConfig, WorkerConfig
    from switchml.protocol.errors import OperationFailed
    from switchml.transport.memory import MemoryCluster
    for quorum in (3, None):
        sw = SwitchDataplane(SwitchConfig(member_timeout_s=0.5))
        c = MemoryCluster(num_workers=4, window=4, elements_per_packet=8, quorum=quorum,
                          seed=3, switch=sw,
                          worker_config=WorkerConfig(initial_rto_s=0.05, max_rto_s=0.2,
                                                     op_timeout_s=5.0))
        c.wait(c.start(_one_hot(4, 100, np.int32)))
        c.fabric.detach(c.addresses[3])  # rank 3 is gone: no datagram to or from it
        c.fabric.run(functools.partial(_after, c.fabric, c.fabric.now + 1.0))  # member timeout
        for _ in range(3):
            xs = _one_hot(4, 100, np.int32)[:3]
            early = c.start(xs[:2], ranks=[0, 1])
            until = functools.partial(_after, c.fabric, c.fabric.now + 0.3)
            c.fabric.run(lambda early=early, until=until: until() or any(
                h.done() for h in early))  # re-sends, WAITING answers
            if quorum is None:
                with pytest.raises(OperationFailed, match=r"waits for rank\(s\) \[3\]"):
                    c.wait(early)
                break
            assert not any(h.done() for h in early)
            hs = early + c.start(xs[2:], ranks=[2])
            c.wait(hs)
            assert all((h.result() == 7).all() for h in hs)
        if quorum is not None:
            assert c.workers[0].counters["waiting_for_gone_ranks"] > 0


def test_a_rank_behind_within_an_operation_takes_the_later_results_it_was_sent():
    """One lane, eight chunks, quorum 3 of 4: the result of chunk 1 never reaches rank 3, so
    its lane waits there while the others finish every chunk. Rank 3's one re-send gets chunk
    1 from the slot's history; chunks 2..7 it already has (kept as they came by multicast):
    it completes with one re-send, not one per chunk, and the same sum."""
    from switchml.protocol.config import WorkerConfig
    from switchml.transport.memory import FaultModel, MemoryCluster, MemoryFabric
    lost = []

    def drop(payload, src, dst):  # chunk 1's result, on its way to rank 3, once
        if (not lost and dst[0].endswith(".3") and payload[3] == int(MessageType.RESULT)
                and int.from_bytes(payload[24:28], "little") == 1):
            lost.append(1)
            return True
        return False

    fabric = MemoryFabric(FaultModel(latency_s=1e-4), 0, drop_filter=drop)
    c = MemoryCluster(num_workers=4, window=1, elements_per_packet=4, quorum=3, seed=0,
                      fabric=fabric,
                      worker_config=WorkerConfig(initial_rto_s=0.05, max_rto_s=0.2))
    xs = _one_hot(4, 32, np.int32)
    c.wait(c.start(xs))
    assert lost and all((x == xs[0]).all() for x in xs)
    counters = c.workers[3].counters
    assert counters["retransmissions"] == 1, counters
    assert counters["results_kept_ahead"] >= 6 and counters["results_received"] == 8


# -- the deadline: m ranks after D ------------------------------------------------------------

def _deadline_job(n=3, quorum=3, quorum_min=2, deadline_s=0.01):
    spec = JobSpec(job_id=9, token=0x0BAD_F00D_1234, num_workers=n, window=4,
                   elements_per_packet=16, quorum=quorum, quorum_min=quorum_min,
                   quorum_deadline_s=deadline_s)
    sw = SwitchDataplane()
    requests = []
    for r in range(n):
        w = WorkerEndpoint(spec=spec, rank=r, switch_address=SW)
        w.join(0.0)
        exchange({_addr(r): w, SW: sw}, 0.0)
        x = np.array([1, 2, 3], np.int32) * 10 ** r
        w.start_allreduce(x, np.empty_like(x), 0.0)
        (d, _), = w.datagrams_to_send(0.0)
        requests.append(bytes(d))
    return sw, requests


def test_at_the_deadline_a_round_completes_with_the_minimum():
    """Quorum 3 of 3, but 10 ms after its first contribution a round with 2 completes."""
    sw, req = _deadline_job()
    assert _send(sw, 0, req[0], now=1.0) == []
    assert _send(sw, 1, req[1], now=1.002) == []
    assert sw.get_timer() == pytest.approx(1.010)
    sw.handle_timer(1.009)
    assert sw.datagrams_to_send(1.009) == []  # not yet
    sw.handle_timer(1.0101)
    out = [(bytes(d), a) for d, a in sw.datagrams_to_send(1.0101)]
    assert sorted(a for _, a in out) == [_addr(0), _addr(1), _addr(2)]
    h, payload, ranks = _result(out[0][0])
    assert payload == [11, 22, 33] and ranks == 0b011 and h.rank == 3  # (3: the deadline)
    assert sw.stats()["rounds_completed_at_deadline"] == 1
    assert _send(sw, 2, req[2], now=1.02) == []  # late: the multicast reached it
    assert _result(_send(sw, 2, _retry(req[2]), now=1.03)[0][0])[1:] == ([11, 22, 33], 0b011)


def test_a_round_short_of_the_minimum_waits_past_the_deadline():
    sw, req = _deadline_job(quorum_min=2)
    _send(sw, 0, req[0], now=1.0)
    assert sw.get_timer() > 1.5  # one contribution: nothing to complete (only the lease)
    sw.handle_timer(1.5)
    assert sw.datagrams_to_send(1.5) == []
    assert _send(sw, 2, req[2], now=2.0) == []  # the second: due at once (opened at 1.0)
    assert sw.get_timer() == pytest.approx(1.010)
    sw.handle_timer(2.0)
    h, payload, ranks = _result(sw.datagrams_to_send(2.0)[0][0])
    assert payload == [101, 202, 303] and ranks == 0b101


def test_expire_rounds_matches_the_reference():
    from switchml.protocol import kernels as K
    from switchml.protocol.kernels import aggregate
    sw, req = _deadline_job(n=4, quorum=4, quorum_min=2)
    for r in range(3):  # rounds with 1, 2 and 3 of 4, opened at different times
        _send(sw, r, req[r], now=1.0 + r * 0.004)
    job = next(iter(sw._jobs.values()))
    arrays = [job.jobv, job.st, job.seen, job.conflict, job.bufs, job.clog, job.cursor,
              job.mkeys, job.heard]
    for now in (1.005, 1.02):
        mine, ref = [a.copy() for a in arrays], [a.copy() for a in arrays]
        cnt_a, cnt_b = np.zeros(K.SC.N, np.int64), np.zeros(K.SC.N, np.int64)
        done_a, done_b = np.zeros((16, 3), np.int64), np.zeros((16, 3), np.int64)
        na = K.expire_rounds(*mine, now, cnt_a, done_a)
        nb = aggregate.expire_rounds(*ref, now, cnt_b, done_b)
        assert na == nb == (0 if now < 1.01 else 1)
        assert np.array_equal(done_a[:na], done_b[:nb]) and np.array_equal(cnt_a, cnt_b)
        for a, b in zip(mine, ref):
            assert a.tobytes() == b.tobytes()


def test_a_quorum_of_all_with_a_deadline_goes_on_without_a_dead_rank():
    """Every rank's gradient while all answer (quorum 4 of 4); with rank 3 dead, each round
    completes 20 ms after it opens with the other three, and AVG would divide by 3."""
    from switchml.protocol.config import WorkerConfig
    from switchml.transport.memory import MemoryCluster
    c = MemoryCluster(num_workers=4, window=4, elements_per_packet=8, quorum=4, quorum_min=3,
                      quorum_deadline_s=0.02, seed=2,
                      worker_config=WorkerConfig(initial_rto_s=0.05, max_rto_s=0.2))
    hs = c.start(_one_hot(4, 100, np.int32))
    c.wait(hs)
    assert all((h.result() == 15).all() and (h.contributor_counts() == 4).all() for h in hs)
    c.fabric.detach(c.addresses[3])
    t0 = c.fabric.now
    hs = c.start(_one_hot(4, 100, np.int32)[:3], ranks=[0, 1, 2])
    c.wait(hs)
    assert all((h.result() == 7).all() and (h.contributor_counts() == 3).all() for h in hs)
    assert 0.02 <= c.fabric.now - t0 < 2.0  # the deadline, not a timeout
