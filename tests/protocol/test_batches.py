"""The batch entry point of the compiled data plane (``receive_many`` of an ``endpoint.Batch``).

A GRO buffer or a recvmmsg batch must give exactly what the same datagrams give one by one, and
no batch of bytes, however malformed (truncated, wrong segment sizes, other jobs' headers,
random), may raise, read out of bounds or change another job's state.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_switch import TOKEN, TOKEN2, decode, join_job

from switchml.protocol import kernels as K
from switchml.protocol import wire
from switchml.protocol.config import JobSpec, SwitchConfig
from switchml.protocol.endpoint import Batch, exchange
from switchml.protocol.events import OperationCompleted
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.worker import WorkerEndpoint


def _sw() -> SwitchDataplane:
    return SwitchDataplane(SwitchConfig(pool_slots=64, max_elements_per_packet=64))


def _job_state(sw: SwitchDataplane, job_id: int) -> tuple[bytes, ...]:
    job = sw._jobs[job_id]
    return (job.st.tobytes(), job.seen.tobytes(), job.conflict.tobytes(), job.bufs.tobytes(),
            job.jobv.tobytes())


def _gro(datagrams: list[bytes]) -> tuple[np.ndarray, int, int]:
    buf = b"".join(datagrams)
    return np.frombuffer(bytearray(buf), np.uint8), len(buf), len(datagrams[0])


def test_kernel_constants_match_the_wire_format():
    assert (K.HDR, K.MAGIC, K.VERSION) == (wire.HEADER_SIZE, wire.MAGIC, wire.VERSION)
    assert (K.T_REQUEST, K.T_RESULT) == (wire.MessageType.REQUEST, wire.MessageType.RESULT)
    assert K.KNOWN_FLAGS == wire.KNOWN_FLAGS and K.EXP_ZERO == wire.EXP_ZERO
    assert K.RESULT_FLAGS == wire.RESULT_FLAGS
    assert K.F_CONTRIBUTORS == wire.Flags.CONTRIBUTORS
    assert (K.F_NONFINITE, K.F_HAS_DATA, K.F_HAS_EXP) == (
        wire.Flags.NONFINITE, wire.Flags.HAS_DATA, wire.Flags.HAS_EXP)
    assert (K.E_BYTES, K.E_INT32, K.E_INT16) == (wire.ElementType.BYTES, wire.ElementType.INT32,
                                                wire.ElementType.INT16)
    # The header field offsets the kernels read: pack a header and read it back.
    h = wire.Header(wire.MessageType.REQUEST, 0x01020304, rank=0x0506, token=0x0708090A0B0C0D0E,
                    seq=0x11121314, chunk=0x21222324, slot=0x31323334, set_bit=1, count=7,
                    elem=wire.ElementType.INT16, flags=5, exp_data=-3, exp_next=-32768,
                    digest=0x9A)
    d = np.frombuffer(bytearray(wire.pack_header(h)), np.uint8)
    assert (K.u32(d, 8), K.u16(d, 6), K.u32(d, 20), K.u32(d, 24), K.u32(d, 28)) == (
        h.job, h.rank, h.seq, h.chunk, h.slot)
    assert np.uint64(np.int64(K.i64(d, 12))) == np.uint64(h.token)
    assert (K.u16(d, 32), d[34], d[35], K.i16(d, 36), K.i16(d, 38), d[4], d[5]) == (
        7, 2, 0x9A, -3, -32768, 5, 1)


def test_a_gro_buffer_gives_what_the_datagrams_give_one_by_one():
    """Two switches, the same requests: one gets GRO buffers per sender, the other single
    datagrams. Same results, same state."""
    rng = np.random.default_rng(1)
    outs = []
    states = []
    for batched in (True, False):
        sw = _sw()
        job = join_job(sw, 7, TOKEN, 3, window=8, k=16)
        sent = []
        for rnd in range(3):
            for r in range(3):
                reqs = [job.req(r, rng.integers(-1000, 1000, 16), slot=s, set_bit=rnd % 2,
                                seq=0, chunk=rnd * 8 + s) for s in range(8)]
                if batched:
                    buf, n, seg = _gro(reqs)
                    sw.receive_many(Batch.of_segments(buf, n, seg, job.addrs[r]), 0.0)
                else:
                    for q in reqs:
                        sw.receive_datagram(q, job.addrs[r], 0.0)
                sent.extend(decode(d, a) for d, a in sw.datagrams_to_send(0.0))
        outs.append([(o.raw, o.addr) for o in sent])
        states.append(_job_state(sw, 7))
        rng = np.random.default_rng(1)
    assert len(outs[0]) == 3 * 8 * 3  # every round multicast to 3 ranks
    assert outs[0] == outs[1]
    assert states[0] == states[1]


def test_a_batch_of_one_datagram_gives_what_receive_datagram_gives():
    outs = []
    for batched in (True, False):
        sw = _sw()
        job = join_job(sw, 7, TOKEN, 2, window=4, k=4)
        for r in range(2):
            q = job.req(r, [r + 1] * 4, slot=0)
            if batched:
                sw.receive_many(Batch.of_datagram(q, job.addrs[r]), 0.0)
            else:
                sw.receive_datagram(q, job.addrs[r], 0.0)
        sw.receive_many(Batch.of_segments(np.zeros(0, np.uint8), 0, 0, job.addrs[0]), 0.0)
        outs.append(([(bytes(d), a) for d, a in sw.datagrams_to_send(0.0)], sw.stats()))
    assert outs[0][0] and outs[0] == outs[1]
    assert outs[0][1]["drops"] == {"short": 1}


def test_a_recvmmsg_batch_of_several_senders_is_taken_in_order():
    sw = _sw()
    job = join_job(sw, 7, TOKEN, 2, window=4, k=4)
    reqs = [job.req(0, [1, 2, 3, 4], slot=0), job.req(1, [10, 20, 30, 40], slot=0),
            job.req(1, [5, 5, 5, 5], slot=1), job.req(0, [1, 1, 1, 1], slot=1)]
    slot = 128
    buf = np.zeros(slot * len(reqs), np.uint8)
    for i, q in enumerate(reqs):
        buf[i * slot:i * slot + len(q)] = np.frombuffer(q, np.uint8)
    starts = np.arange(len(reqs), dtype=np.int64) * slot
    lens = np.array([len(q) for q in reqs], np.int64)
    senders = np.array([0, 1, 1, 0], np.int64)
    sw.receive_many(Batch(buf, starts, lens, senders, len(reqs), lambda k: job.addrs[k]), 0.0)
    out = [decode(d, a) for d, a in sw.datagrams_to_send(0.0)]
    for addr in job.addrs:  # every rank gets both results, in the order the rounds completed
        assert [o.payload.tolist() for o in out if o.addr == addr] == [[11, 22, 33, 44],
                                                                        [6, 6, 6, 6]]
    assert len(out) == 4


def test_a_rank_spoofed_from_another_address_inside_a_batch_is_not_aggregated():
    """In a recvmmsg batch the kernel must check every datagram's sender, not only the
    first's: rank 0's token is known to rank 1, which claims rank 0 for its second datagram."""
    sw = _sw()
    job = join_job(sw, 7, TOKEN, 2, window=4, k=4)
    reqs = [job.req(0, [1, 1, 1, 1], slot=0), job.req(0, [7, 7, 7, 7], slot=1)]
    buf = np.frombuffer(bytearray(b"".join(reqs)), np.uint8)
    starts = np.array([0, len(reqs[0])], np.int64)
    lens = np.array([len(q) for q in reqs], np.int64)
    sw.receive_many(Batch(buf, starts, lens, np.array([0, 1], np.int64), 2,
                          lambda k: job.addrs[k]), 0.0)
    assert sw.drops["wrong_source"] == 1
    assert not sw._jobs[7].seen[:, 1].any()


_valid = st.builds(lambda r, s, v, c: (r, s, v, c), st.integers(0, 1), st.integers(0, 3),
                   st.integers(0, 1), st.integers(0, 5))


@settings(derandomize=True, max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.one_of(
    st.binary(max_size=120),
    _valid.map(lambda t: ("valid",) + t),
    st.tuples(st.just("other_job"), st.integers(0, 1), st.integers(0, 3)),
), min_size=1, max_size=12), seg=st.integers(0, 140), cut=st.integers(0, 400),
    mmsg=st.booleans())
def test_no_batch_of_bytes_raises_or_touches_another_job(chunks, seg, cut, mmsg):
    sw = _sw()
    victim = join_job(sw, 9, TOKEN2, 2, window=4, k=8, host="v")
    victim.send(0, list(range(8)), slot=2)  # an open round ...
    victim.send(0, [1] * 8, slot=3)
    victim.send(1, [2] * 8, slot=3)  # ... and a completed one
    sw.datagrams_to_send(0.0)
    before = _job_state(sw, 9)
    attacker = join_job(sw, 7, TOKEN, 2, window=4, k=8)
    parts = []
    for c in chunks:
        if isinstance(c, bytes):
            parts.append(c)
        elif c[0] == "valid":
            _, r, s, v, ch = c
            parts.append(attacker.req(r, np.arange(8), slot=s, set_bit=v, chunk=ch))
        else:  # the victim's job id and slots, without its token
            parts.append(victim.req(c[1], [5] * 8, slot=c[2], token=TOKEN))
    raw = b"".join(parts)[:cut]
    buf = np.frombuffer(bytearray(raw), np.uint8)
    if mmsg:
        starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
        lens = np.array([len(p) for p in parts], np.int64)
        keep = starts + lens <= len(raw)
        starts, lens = starts[keep], lens[keep]
        senders = np.zeros(len(starts), np.int64)
        sw.receive_many(Batch(buf, starts, lens, senders, len(starts),
                              lambda k: attacker.addrs[0]), 0.0)
    else:
        sw.receive_many(Batch.of_segments(buf, len(raw), seg, attacker.addrs[0]), 0.0)
    sw.datagrams_to_send(0.0)
    assert _job_state(sw, 9) == before
    assert sw.stats()["jobs"] == 2


@settings(derandomize=True, max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(junk=st.lists(st.binary(max_size=200), min_size=1, max_size=8),
       seg=st.integers(0, 100))
def test_no_batch_of_bytes_makes_a_worker_raise_or_lose_its_operation(junk, seg):
    """Junk between the results of an operation: the operation still completes exactly."""
    sw = SwitchDataplane()
    spec = JobSpec(job_id=5, token=6, num_workers=1, window=2, elements_per_packet=4)
    sa, wa = ("s", 1), ("w", 2)
    w = WorkerEndpoint(spec=spec, rank=0, switch_address=sa)
    w.join(0.0)
    exchange({wa: w, sa: sw}, 0.0)
    x = np.arange(20, dtype=np.float32)
    out = np.zeros_like(x)
    w.start_allreduce(x, out, 0.0)
    raw = b"".join(junk)
    w.receive_many(Batch.of_segments(np.frombuffer(bytearray(raw), np.uint8), len(raw), seg, sa),
                   0.0)
    for _ in range(100):
        moved = False
        for d, _ in w.datagrams_to_send(0.0):
            sw.receive_datagram(bytes(d), wa, 0.0)
        results = [bytes(d) for d, _ in sw.datagrams_to_send(0.0)]
        if results:
            moved = True
            buf, n, size = _gro(results) if len({len(r) for r in results}) == 1 else (
                None, 0, 0)
            if buf is not None:
                w.receive_many(Batch.of_segments(buf, n, size, sa), 0.0)
            else:
                for r in results:
                    w.receive_datagram(r, sa, 0.0)
        if not moved:
            break
    events = []
    while (ev := w.next_event()) is not None:
        events.append(ev)
    assert any(isinstance(e, OperationCompleted) for e in events)
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize(("mtu", "k"), [(1500, 358), (9000, 2233), (65536, 16366)])
def test_elements_for_mtu_fill_the_path_without_fragmentation(mtu, k):
    assert wire.elements_for_mtu(mtu) == k
    assert 20 + 8 + wire.HEADER_SIZE + 4 * k <= max(mtu, 65535)
    if mtu < 65535:
        assert 20 + 8 + wire.HEADER_SIZE + 4 * (k + 1) > mtu
    with pytest.raises(ValueError, match="no room"):
        wire.elements_for_mtu(60)
