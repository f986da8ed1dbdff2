"""The switch's receive batches: one ``recvmmsg`` brings several members' requests (and
anything else) in one call, which the kernel takes in one pass where it can. Crafted
datagrams; results, NACKs and drops checked against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
from test_switch import decode, join, join_job, request

from switchml.protocol import kernels as K
from switchml.protocol.auth import job_key, join_datagram, leave_proof
from switchml.protocol.config import SwitchConfig
from switchml.protocol.endpoint import Batch
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import (
    EXP_ZERO,
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    pack_header,
    pack_join,
    pack_leave,
    unpack_challenge,
    unpack_header,
)

TOKEN = 0x5EC2E7_0000_0000_01


def _batch(pairs, numbers: dict, *, stable: bool) -> Batch:
    """``(address, datagram)`` pairs as one receive call, senders numbered by ``numbers``."""
    b = Batch.of_pairs(pairs)
    addr_of = {numbers[a]: a for a, _ in pairs}
    senders = np.array([numbers[a] for a, _ in pairs], np.int64)
    return b._replace(senders=senders, address_of=addr_of.__getitem__, stable_senders=stable)


def _drain(sw: SwitchDataplane):
    return [decode(d, a) for d, a in sw.datagrams_to_send(now=0.0)]


def _switch() -> SwitchDataplane:
    return SwitchDataplane(SwitchConfig(pool_slots=64, max_elements_per_packet=64,
                                        max_workers=8, nack_gap=0))


@pytest.mark.parametrize("stable", [True, False])
def test_several_members_in_one_batch_sum_right_and_a_forger_among_them_is_dropped(stable):
    sw = _switch()
    job = join_job(sw, 5, TOKEN, 3)
    evil = ("evil", 6666)
    numbers = {a: 100 + i for i, a in enumerate(job.addrs)} | {evil: 7}
    for seq in range(3):  # later calls: the senders checked in earlier ones (stable numbers)
        pairs = []
        for slot in range(2):
            pairs.append((job.addrs[0], job.req(0, [1, 2], slot=slot, seq=seq, chunk=slot)))
            pairs.append((job.addrs[1], job.req(1, [10, 20], slot=slot, seq=seq, chunk=slot)))
            # Rank 2's job, token and rank, from another address: a forgery.
            pairs.append((evil, job.req(2, [1000, 1000], slot=slot, seq=seq, chunk=slot)))
            pairs.append((job.addrs[2], job.req(2, [100, 200], slot=slot, seq=seq,
                                                chunk=slot)))
        sw.receive_many(_batch(pairs, numbers, stable=stable), now=0.0)
        out = _drain(sw)
        assert sorted((o.header.type, o.header.slot - job.slot_base, o.addr) for o in out) == [
            (MessageType.RESULT, s, a) for s in range(2) for a in job.addrs]
        assert all(o.payload.tolist() == [111, 222] for o in out)
        assert sw.drops == {"wrong_source": 2 * (seq + 1)}


@pytest.mark.parametrize("stable", [True, False])
def test_two_jobs_interleaved_in_one_batch_stay_apart(stable):
    sw = _switch()
    a = join_job(sw, 5, TOKEN, 2, host="a")
    b = join_job(sw, 6, TOKEN + 1, 2, host="b")
    numbers = {addr: i for i, addr in enumerate(a.addrs + b.addrs)}
    pairs = [(a.addrs[0], a.req(0, [1])), (b.addrs[0], b.req(0, [5])),
             (a.addrs[1], a.req(1, [2])), (b.addrs[1], b.req(1, [6])),
             # rank 0 of job a claims job b's rank 0 (b's token): not its member address
             (a.addrs[0], b.req(0, [99], seq=1))]
    sw.receive_many(_batch(pairs, numbers, stable=stable), now=0.0)
    out = _drain(sw)
    assert [(o.header.job, o.addr, o.payload.tolist()) for o in out] == [
        (5, a.addrs[0], [3]), (5, a.addrs[1], [3]), (6, b.addrs[0], [11]), (6, b.addrs[1], [11])]
    assert sw.drops == {"wrong_source": 1}


def test_a_rank_that_left_and_joined_from_elsewhere_is_not_taken_from_its_old_address():
    """The kernel takes a rank's requests from the sender number whose address Python
    checked; a new membership must make it check again, or the old address (whose number is
    still stable) would feed the rank's slots. Every datagram arrives as the UDP switch's
    receiver hands it over (stable numbers)."""
    sw = _switch()
    job = join_job(sw, 5, TOKEN, 2)
    moved = ("moved", 3000)
    numbers = {job.addrs[0]: 1, job.addrs[1]: 2, moved: 3}

    def send(*pairs, now=0.0):
        sw.receive_many(_batch(list(pairs), numbers, stable=True), now=now)
        return _drain(sw)

    out = send((job.addrs[0], job.req(0, [1])), (job.addrs[1], job.req(1, [2])))
    assert [o.payload.tolist() for o in out] == [[3], [3]]
    key = job_key(None, 5, TOKEN)
    proof = leave_proof(key, job=5, token=TOKEN, rank=1, cookie=job.cookies[1])
    (o,) = send((job.addrs[1], pack_leave(job=5, token=TOKEN, rank=1, proof=proof)))
    assert o.header.type is MessageType.LEFT
    info = ControlInfo(2, 4, 8)  # a JOIN challenged before the LEAVE is spent: a second on
    (c,) = send((moved, pack_join(job=5, token=TOKEN, rank=1, info=info)), now=1.0)
    (o,) = send((moved, join_datagram(key, job=5, token=TOKEN, rank=1, seq=0, info=info,
                                      cookie=unpack_challenge(c.payload))), now=1.0)
    assert o.header.type is MessageType.JOINED
    out = send((job.addrs[0], job.req(0, [1], seq=1)),
               (job.addrs[1], job.req(1, [50], seq=1)),  # the old address: not a member now
               (moved, job.req(1, [7], seq=1)), now=1.0)
    assert [(o.addr, o.payload.tolist()) for o in out] == [(job.addrs[0], [8]), (moved, [8])]
    assert sw.drops == {"wrong_source": 1}


def test_every_nack_of_a_batch_goes_out_even_past_the_kernels_buffer():
    """Rank 1's odd chunks of the first window are lost: each even chunk shows the odd one
    before it missing (gap 1), more NACKs than one kernel call holds (``REPLIES_PER_CALL``).
    Every NACK names the lost chunk and its slot, for rank 1, with the job's token and the
    operation's seq, a header and nothing else."""
    window = 2 * K.REPLIES_PER_CALL + 20
    sw = SwitchDataplane(SwitchConfig(pool_slots=window, max_window=window,
                                      max_elements_per_packet=8, nack_gap=1))
    addrs = [("w0", 1000), ("w1", 1001)]
    for r, addr in enumerate(addrs):
        (o,) = join(sw, 9, TOKEN, r, ControlInfo(2, window, 1), addr)
        assert o.header.type is MessageType.JOINED
    _drain(sw)
    sent = range(0, window, 2)
    pairs = [(addrs[1], request(9, TOKEN, 1, p, 0, 4, p, [], flags=Flags.HAS_EXP,
                                exp_next=0)) for p in sent]
    sw.receive_many(_batch(pairs, {addrs[0]: 1, addrs[1]: 2}, stable=True), now=0.0)
    nacks = [(unpack_header(bytes(d)), bytes(d), a) for d, a in sw.datagrams_to_send(0.0)]
    expected = [Header(MessageType.NACK, 9, rank=1, token=TOKEN, seq=4, chunk=p - 1,
                       slot=p - 1, elem=ElementType.BYTES, exp_data=EXP_ZERO,
                       exp_next=EXP_ZERO) for p in sent if p >= 1]
    assert len(expected) > K.REPLIES_PER_CALL
    assert [raw for _, raw, _ in nacks] == [pack_header(h) for h in expected]
    assert {a for _, _, a in nacks} == {addrs[1]}
    assert sw.stats()["nacks_sent"] == len(expected)


def test_resends_in_one_batch_are_answered_past_the_kernels_buffer_with_exact_replies():
    """Every lane of a 3-rank job: rank 0 re-sends into a complete round (lane even) or an
    open one (lane odd), all in one receive batch, more answers than one kernel call holds
    (``REPLIES_PER_CALL``). Each answer is the hand-built datagram: the stored result with the
    RESENT flag, or WAITING naming ranks 1 and 2 (open lanes lack them) and none gone."""
    window = K.REPLIES_PER_CALL + 30
    sw = SwitchDataplane(SwitchConfig(pool_slots=window, max_window=window,
                                      max_elements_per_packet=8, nack_gap=0))
    job = join_job(sw, 5, TOKEN, 3, window=window, k=8)
    base, numbers = job.slot_base, {a: i + 1 for i, a in enumerate(job.addrs)}
    first, expected = [], []
    for s in range(window):
        vals = [[s, 1, -2], [10 * s, 3, 4], [-s, 5, 6]]
        ranks = range(3) if s % 2 == 0 else range(1)  # even lanes complete, odd lanes open
        first += [(job.addrs[r], request(5, TOKEN, r, base + s, 0, 7, s, vals[r]))
                  for r in ranks]
        if s % 2 == 0:
            h = Header(MessageType.RESULT, 5, rank=2, token=TOKEN, seq=7, chunk=s,
                       slot=base + s, count=3, elem=ElementType.INT32,
                       flags=Flags.HAS_DATA | Flags.RESENT)
            total = np.array([10 * s, 9, 8], "<i4").tobytes()
            expected.append(pack_header(h) + total)
        else:
            h = Header(MessageType.WAITING, 5, rank=0, token=TOKEN, seq=7, chunk=s,
                       slot=base + s, count=2, elem=ElementType.BYTES)
            expected.append(pack_header(h) + bytes([0b110, 0]))
    sw.receive_many(_batch(first, numbers, stable=True), now=0.0)
    _drain(sw)
    again = [(job.addrs[0], request(5, TOKEN, 0, base + s, 0, 7, s, [s, 1, -2]))
             for s in range(window)]
    sw.receive_many(_batch(again, numbers, stable=True), now=0.0)
    out = [(bytes(d), a) for d, a in sw.datagrams_to_send(0.0)]
    assert len(expected) > K.REPLIES_PER_CALL
    assert [d for d, _ in out] == expected
    assert {a for _, a in out} == {job.addrs[0]}
    st = sw.stats()
    assert (st["results_resent"], st["waiting_sent"]) == (window // 2, window // 2)
    assert sw.drops == {"duplicate": window // 2}


def test_waiting_names_the_missing_ranks_that_went_silent_as_gone():
    """WAITING's second bitmap: of the ranks missing, those silent for the member timeout
    (rank 2 joined at 0 and sent nothing since; rank 1 sent a keep-alive of a request at
    t = 9)."""
    sw = SwitchDataplane(SwitchConfig(pool_slots=64, max_elements_per_packet=64, max_workers=8,
                                      nack_gap=0, member_timeout_s=10.0))
    job = join_job(sw, 6, TOKEN, 4, window=2, k=4)
    base, numbers = job.slot_base, {a: i + 1 for i, a in enumerate(job.addrs)}
    sw.receive_many(_batch([(job.addrs[1], request(6, TOKEN, 1, base + 1, 0, 0, 1, [1]))],
                           numbers, stable=True), now=9.0)
    for now in (9.5, 10.5):  # rank 2's silence passes the timeout between the two
        sw.receive_many(_batch([(job.addrs[0], request(6, TOKEN, 0, base, 0, 0, 0, [1])),
                                (job.addrs[3], request(6, TOKEN, 3, base, 0, 0, 0, [2]))],
                               numbers, stable=True), now=now)
    _drain(sw)
    sw.receive_many(_batch([(job.addrs[0], request(6, TOKEN, 0, base, 0, 0, 0, [1]))],
                           numbers, stable=True), now=10.5)
    (o,) = _drain(sw)
    assert o.header.type is MessageType.WAITING and o.addr == job.addrs[0]
    assert o.payload.tolist() == [0b0110, 0b0100]  # ranks 1 and 2 missing; rank 2 gone


def test_a_member_timeout_of_inf_never_calls_a_rank_gone():
    """``member_timeout_s=inf``: silence never makes a rank gone (and the job still forms)."""
    sw = SwitchDataplane(SwitchConfig(pool_slots=64, max_elements_per_packet=64, max_workers=8,
                                      nack_gap=0, member_timeout_s=float("inf")))
    job = join_job(sw, 7, TOKEN, 2, window=2, k=4)
    base, numbers = job.slot_base, {a: i + 1 for i, a in enumerate(job.addrs)}
    for now in (1.0, 1e7):  # the second, a re-send long after rank 1 went silent
        sw.receive_many(_batch([(job.addrs[0], request(7, TOKEN, 0, base, 0, 0, 0, [1]))],
                               numbers, stable=True), now=now)
    (o,) = _drain(sw)
    assert o.header.type is MessageType.WAITING
    assert o.payload.tolist() == [0b10, 0]  # rank 1 missing, not gone
