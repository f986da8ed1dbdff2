"""The switch dataplane, driven only with crafted datagrams (REFERENCE.md sections 1 and 9).

Every test builds datagrams by hand with ``wire.pack_header`` and numpy payloads, sends them from
fake addresses, and asserts on the exact datagrams ``datagrams_to_send`` returns, on ``drops`` and
on ``stats()``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from switchml.protocol.auth import job_key, join_datagram, leave_proof
from switchml.protocol.config import SwitchConfig
from switchml.protocol.errors import WireError
from switchml.protocol.events import JobCreated, JobRefused, JobRemoved, MemberJoined
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import (
    EXP_ZERO,
    HEADER_SIZE,
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    pack_control_info,
    pack_header,
    pack_join,
    pack_leave,
    unpack_challenge,
    unpack_header,
    unpack_joined,
    unpack_mismatch,
    unpack_payload,
)

POOL = 64
MAX_K = 64
TOKEN = 0x5EC2E7_0000_0000_01
TOKEN2 = 0x5EC2E7_0000_0000_02


# -- Helpers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Out:
    """A decoded datagram the switch sent (copied: switch buffers are reused)."""

    header: Header
    payload: np.ndarray
    addr: tuple[str, int]
    raw: bytes


@dataclass
class Job:
    sw: SwitchDataplane
    job_id: int
    token: int
    n: int
    window: int
    k: int
    slot_base: int
    addrs: list[tuple[str, int]]
    cookies: list[bytes]

    def req(self, rank: int, values, *, slot: int = 0, set_bit: int = 0, seq: int = 0,
            chunk: int = 0, flags: int = Flags.HAS_DATA, exp_data: int = EXP_ZERO,
            exp_next: int = EXP_ZERO, token: int | None = None, job_id: int | None = None,
            count: int | None = None, digest: int = 0) -> bytes:
        """A REQUEST for local slot ``slot`` (absolute slot = slot_base + slot)."""
        return request(self.job_id if job_id is None else job_id,
                       self.token if token is None else token, rank, self.slot_base + slot,
                       set_bit, seq, chunk, values, flags=flags, exp_data=exp_data,
                       exp_next=exp_next, count=count, digest=digest)

    def send(self, rank: int, values, **kw) -> list[Out]:
        """Send a REQUEST from ``rank``'s own address and return the decoded output."""
        return deliver(self.sw, self.req(rank, values, **kw), self.addrs[rank])

    def round(self, values_by_rank, **kw) -> list[Out]:
        """Every rank contributes in order; all but the last must produce nothing."""
        for rank, values in enumerate(values_by_rank[:-1]):
            assert self.send(rank, values, **kw) == []
        return self.send(len(values_by_rank) - 1, values_by_rank[-1], **kw)


def request(job_id: int, token: int, rank: int, slot: int, set_bit: int, seq: int, chunk: int,
            values, *, flags: int = Flags.HAS_DATA, exp_data: int = EXP_ZERO,
            exp_next: int = EXP_ZERO, count: int | None = None, digest: int = 0) -> bytes:
    payload = np.asarray(values, dtype=np.int64).astype("<i4").tobytes()
    n = len(payload) // 4 if count is None else count
    h = Header(MessageType.REQUEST, job_id, rank=rank, token=token, seq=seq, chunk=chunk,
               slot=slot, set_bit=set_bit, count=n, elem=ElementType.INT32, flags=int(flags),
               exp_data=exp_data, exp_next=exp_next, digest=digest)
    return pack_header(h) + payload


def control(mtype: MessageType, job_id: int, token: int, rank: int,
            info: ControlInfo | None = None) -> bytes:
    payload = b"" if info is None else pack_control_info(info)
    h = Header(mtype, job_id, rank=rank, token=token, count=len(payload), elem=ElementType.BYTES)
    return pack_header(h) + payload


def proven_join(sw: SwitchDataplane, job_id: int, token: int, rank: int, info: ControlInfo,
                addr, *, seq: int = 0, secret: bytes | None = None) -> bytes:
    """Ask ``sw`` for a challenge from ``addr`` (it must answer with exactly one CHALLENGE,
    to ``addr``) and return the JOIN that answers it, proven as a worker would prove it."""
    out = deliver(sw, pack_join(job=job_id, token=token, rank=rank, seq=seq, info=info), addr)
    assert [(o.header.type, o.addr) for o in out] == [(MessageType.CHALLENGE, addr)]
    assert len(out[0].raw) < len(pack_join(job=job_id, token=token, rank=rank, info=info))
    return join_datagram(job_key(secret, job_id, token), job=job_id, token=token, rank=rank,
                         seq=seq, info=info, cookie=unpack_challenge(out[0].payload))


def join(sw: SwitchDataplane, job_id: int, token: int, rank: int, info: ControlInfo, addr,
         *, seq: int = 0, secret: bytes | None = None) -> list[Out]:
    """The whole JOIN handshake of one rank; returns what the proven JOIN drew."""
    return deliver(sw, proven_join(sw, job_id, token, rank, info, addr, seq=seq,
                                   secret=secret), addr)


def leave(sw: SwitchDataplane, job_id: int, token: int, rank: int, addr,
          cookie: bytes = bytes(24), *, secret: bytes | None = None) -> list[Out]:
    """A LEAVE proven for the membership that began with ``cookie``."""
    proof = leave_proof(job_key(secret, job_id, token), job=job_id, token=token, rank=rank,
                        cookie=cookie)
    return deliver(sw, pack_leave(job=job_id, token=token, rank=rank, proof=proof), addr)


def decode(datagram, addr) -> Out:
    raw = bytes(datagram)
    h = unpack_header(raw)
    return Out(h, unpack_payload(raw, h).copy(), addr, raw)


def deliver(sw: SwitchDataplane, data: bytes, addr) -> list[Out]:
    sw.receive_datagram(data, addr, now=0.0)
    return [decode(d, a) for d, a in sw.datagrams_to_send(now=0.0)]


def join_job(sw: SwitchDataplane, job_id: int, token: int, n: int, *, window: int = 4,
             k: int = 8, host: str = "w") -> Job:
    """JOIN ``n`` ranks from (host+rank, 1000+rank) and drain the JOINED replies."""
    addrs = [(f"{host}{r}", 1000 + r) for r in range(n)]
    info = ControlInfo(n, window, k)
    slot_base = None
    cookies = []
    for r, addr in enumerate(addrs):
        out = join(sw, job_id, token, r, info, addr)
        assert len(out) == 1
        (o,) = out
        assert o.header.type is MessageType.JOINED
        assert (o.header.job, o.header.rank, o.header.token) == (job_id, r, token)
        assert o.addr == addr
        granted, cookie = unpack_joined(o.payload)
        cookies.append(cookie)
        assert (granted.num_workers, granted.window, granted.elements_per_packet) == (n, window,
                                                                                     k)
        if slot_base is None:
            slot_base = granted.slot_base
        assert granted.slot_base == slot_base
    assert slot_base is not None
    return Job(sw, job_id, token, n, window, k, slot_base, addrs, cookies)


def drain_events(sw: SwitchDataplane) -> list:
    events = []
    while (e := sw.next_event()) is not None:
        events.append(e)
    return events


def assert_result_to_all(job: Job, out: list[Out], expected, *, seq: int, chunk: int,
                         slot: int = 0, set_bit: int = 0) -> Header:
    """``out`` is exactly one RESULT per member, in rank order, with the ``expected`` sum."""
    assert [o.addr for o in out] == job.addrs
    first = out[0]
    for o in out:
        assert o.raw == first.raw  # the same datagram to everybody
    h = first.header
    assert h.type is MessageType.RESULT
    assert (h.job, h.token, h.seq, h.chunk, h.slot, h.set_bit) == (
        job.job_id, job.token, seq, chunk, job.slot_base + slot, set_bit)
    assert h.elem is ElementType.INT32
    assert not h.flags & Flags.RESENT
    assert first.payload.dtype == np.dtype("<i4")
    assert first.payload.tolist() == list(expected)
    return h


def total_drops(sw: SwitchDataplane) -> int:
    return sum(sw.drops.values())


@pytest.fixture
def sw() -> SwitchDataplane:
    # These crafted rounds put chunks on slots freely (a real worker's chunk p goes to slot
    # p mod E), which NACKs would read as gaps: test_nack.py tests NACKs.
    return SwitchDataplane(SwitchConfig(pool_slots=POOL, max_elements_per_packet=MAX_K,
                                        max_workers=64, nack_gap=0))


@pytest.fixture
def job2(sw) -> Job:
    return join_job(sw, 7, TOKEN, 2)


@pytest.fixture
def job3(sw) -> Job:
    return join_job(sw, 8, TOKEN, 3)


# -- Basic reduction (scenario 1) -------------------------------------------------------------


def test_join_fixture_state(sw, job2):
    assert sw.jobs == {7: ControlInfo(2, 4, 8, job2.slot_base)}
    st_ = sw.stats()
    assert st_["jobs"] == 1
    assert st_["slots_in_use"] == 4
    assert st_["packets_in"] == 4  # per rank: JOIN, proven JOIN
    assert st_["packets_out"] == 4  # CHALLENGE, JOINED
    assert st_["challenges_sent"] == 2
    assert st_["memory_bytes"] == 2 * 4 * (HEADER_SIZE + 4 * 8)
    assert sw.drops == {}
    events = drain_events(sw)
    assert events == [
        JobCreated(7, 2, job2.slot_base, 4, 8),
        MemberJoined(7, 0, job2.addrs[0]),
        MemberJoined(7, 1, job2.addrs[1]),
    ]


def test_basic_reduction_two_workers(sw, job2):
    a = [1, 2, 3, -4]
    b = [10, 20, 30, 40]
    assert job2.send(0, a, seq=3, chunk=5, slot=1) == []
    out = job2.send(1, b, seq=3, chunk=5, slot=1)
    h = assert_result_to_all(job2, out, [11, 22, 33, 36], seq=3, chunk=5, slot=1)
    assert h.count == 4
    assert h.flags == Flags.HAS_DATA
    assert h.rank == 1  # the header is the completing packet's
    st_ = sw.stats()
    assert st_["results_multicast"] == 1
    assert st_["results_resent"] == 0
    assert st_["elements_aggregated"] == {7: 4}
    assert sw.drops == {}


def test_basic_reduction_three_workers_exponents_and_flags(sw, job3):
    flags = int(Flags.HAS_DATA | Flags.HAS_EXP)
    assert job3.send(0, [1, 2], flags=flags, exp_data=-3, exp_next=5) == []
    assert job3.send(1, [3, 4], flags=flags | Flags.NONFINITE, exp_data=-3, exp_next=9) == []
    out = job3.send(2, [5, 6], flags=flags, exp_data=-3, exp_next=EXP_ZERO)
    h = assert_result_to_all(job3, out, [9, 12], seq=0, chunk=0)
    assert h.exp_data == -3  # echoed
    assert h.exp_next == 9  # max over workers (EXP_ZERO ignored)
    assert h.flags == Flags.HAS_DATA | Flags.HAS_EXP | Flags.NONFINITE  # NONFINITE ORed


def test_nonfinite_from_first_contributor_is_kept(sw, job2):
    assert job2.send(0, [1], flags=Flags.HAS_DATA | Flags.NONFINITE) == []
    out = job2.send(1, [1])
    assert out[0].header.flags == Flags.HAS_DATA | Flags.NONFINITE


def test_exponent_only_round_has_empty_payload(sw, job2):
    # The first packets of a float operation carry only the look-ahead exponent.
    assert job2.send(0, [], flags=Flags.HAS_EXP, exp_next=-7) == []
    out = job2.send(1, [], flags=Flags.HAS_EXP, exp_next=-20)
    h = assert_result_to_all(job2, out, [], seq=0, chunk=0)
    assert h.count == 0 and h.exp_next == -7 and h.exp_data == EXP_ZERO


# -- Retransmissions (scenarios 2, 6, 7, 8) ---------------------------------------------------


def test_retransmit_after_reduction_gets_unicast_copy(sw, job3):
    vals = [[1, 1, 1], [2, 2, 2], [4, 4, 4]]
    multicast = job3.round(vals, seq=1, chunk=2, slot=3, set_bit=1)
    assert_result_to_all(job3, multicast, [7, 7, 7], seq=1, chunk=2, slot=3, set_bit=1)
    for rank in (2, 0, 1, 0):
        out = job3.send(rank, vals[rank], seq=1, chunk=2, slot=3, set_bit=1)
        assert len(out) == 1
        (o,) = out
        assert o.addr == job3.addrs[rank]  # to that worker only
        assert o.header.type is MessageType.RESULT
        assert o.header.flags == Flags.HAS_DATA | Flags.RESENT
        assert o.payload.tolist() == [7, 7, 7]
        # Byte-identical to the multicast except for the RESENT flag.
        expected = bytearray(multicast[0].raw)
        expected[4] |= Flags.RESENT
        assert o.raw == bytes(expected)
    st_ = sw.stats()
    assert st_["results_resent"] == 4
    assert st_["results_multicast"] == 1
    assert sw.drops == {}


def test_duplicates_while_open_get_waiting_and_sum_stays_right(sw, job3):
    assert job3.send(0, [5, 5]) == []
    for _ in range(3):
        out = job3.send(0, [5, 5])
        assert len(out) == 1
        (o,) = out
        assert o.addr == job3.addrs[0]
        h = o.header
        assert h.type is MessageType.WAITING
        assert (h.job, h.token, h.seq, h.chunk, h.slot, h.set_bit) == (8, TOKEN, 0, 0,
                                                                       job3.slot_base, 0)
        assert h.elem is ElementType.BYTES
        assert h.count == 2
        assert o.payload.tolist() == [0b110, 0]  # ranks 1 and 2 missing, none gone
    assert job3.send(1, [1, 2]) == []
    (o,) = job3.send(1, [1, 2])  # a duplicate with data is not added again either
    assert o.header.type is MessageType.WAITING
    assert o.payload.tolist() == [0b100, 0]
    out = job3.send(2, [100, 200])
    assert_result_to_all(job3, out, [106, 207], seq=0, chunk=0)
    assert sw.drops == {"duplicate": 4}
    assert sw.stats()["waiting_sent"] == 4
    assert sw.stats()["results_multicast"] == 1


def test_retransmit_into_previous_set_while_next_set_half_full(sw, job2):
    r1 = job2.round([[1, 2], [3, 4]], seq=0, chunk=1, set_bit=0)
    assert_result_to_all(job2, r1, [4, 6], seq=0, chunk=1)
    # Rank 0 got the result and moved on to set 1 (half full); rank 1 lost it and resends.
    assert job2.send(0, [100, 100], seq=0, chunk=5, set_bit=1) == []
    (o,) = job2.send(1, [3, 4], seq=0, chunk=1, set_bit=0)
    assert o.addr == job2.addrs[1]
    assert o.header.flags & Flags.RESENT
    assert (o.header.seq, o.header.chunk, o.header.set_bit) == (0, 1, 0)
    assert o.payload.tolist() == [4, 6]
    # Then rank 1 catches up and set 1 completes with only this round's data.
    out = job2.send(1, [1, 1], seq=0, chunk=5, set_bit=1)
    assert_result_to_all(job2, out, [101, 101], seq=0, chunk=5, set_bit=1)
    assert sw.drops == {}


def test_slot_reuse_and_retransmit_after_several_rounds(sw, job2):
    # Scenario 8: several rounds, then the next set half full: the previous set still answers.
    for r in range(5):
        out = job2.round([[r, 1], [r, 2]], seq=r, set_bit=r % 2)
        assert_result_to_all(job2, out, [2 * r, 3], seq=r, chunk=0, set_bit=r % 2)
    assert job2.send(1, [9, 9], seq=5, set_bit=1) == []
    (o,) = job2.send(0, [4, 1], seq=4, set_bit=0)
    assert o.header.flags & Flags.RESENT
    assert o.payload.tolist() == [8, 3]
    assert o.header.seq == 4
    out = job2.send(0, [1, 1], seq=5, set_bit=1)
    assert_result_to_all(job2, out, [10, 10], seq=5, chunk=0, set_bit=1)


def test_result_lost_then_recovered_from_shadow_copy(sw, job2):
    multicast = job2.round([[7], [8]], seq=2, chunk=0)
    assert_result_to_all(job2, multicast, [15], seq=2, chunk=0)
    # The copy to rank 0 was lost: rank 0 retransmits the same request.
    out = job2.send(0, [7], seq=2, chunk=0)
    assert [(o.addr, o.header.type, o.payload.tolist()) for o in out] == [
        (job2.addrs[0], MessageType.RESULT, [15])]
    assert out[0].header.flags == Flags.HAS_DATA | Flags.RESENT
    assert sw.stats()["results_resent"] == 1


# -- Sets and slot reuse (scenarios 3, 4, 5) --------------------------------------------------


def test_fresh_slot_starting_on_set_1(sw, job2):
    out = job2.round([[1, 2, 3], [4, 5, 6]], slot=2, set_bit=1)
    h = assert_result_to_all(job2, out, [5, 7, 9], seq=0, chunk=0, slot=2, set_bit=1)
    assert h.set_bit == 1


def test_both_sets_in_flight(sw, job2):
    # Set 0 is half full while set 1 of the same slot completes; then set 0 completes too.
    assert job2.send(0, [1, 1], seq=0, chunk=0, set_bit=0) == []
    assert job2.send(0, [5, 6], seq=0, chunk=4, set_bit=1) == []
    out = job2.send(1, [50, 60], seq=0, chunk=4, set_bit=1)
    assert_result_to_all(job2, out, [55, 66], seq=0, chunk=4, set_bit=1)
    out = job2.send(1, [2, 3], seq=0, chunk=0, set_bit=0)
    assert_result_to_all(job2, out, [3, 4], seq=0, chunk=0, set_bit=0)
    assert sw.drops == {}


def test_set_0_then_set_1_different_data(sw, job2):
    out = job2.round([[1, 2], [3, 4]], seq=0, set_bit=0)
    assert_result_to_all(job2, out, [4, 6], seq=0, chunk=0, set_bit=0)
    out = job2.round([[-10, 20], [30, -40]], seq=1, set_bit=1)
    assert_result_to_all(job2, out, [20, -20], seq=1, chunk=0, set_bit=1)


def test_slot_reuse_0101_overwrites(sw, job3):
    rng = np.random.default_rng(5)
    counts = [8, 8, 3, 5, 1, 8]  # shorter rounds after longer ones: stale tails must not leak
    for r, count in enumerate(counts):
        vals = rng.integers(-1000, 1000, size=(3, count))
        out = job3.round([list(v) for v in vals], seq=10 + r, chunk=r, slot=1, set_bit=r % 2)
        h = assert_result_to_all(job3, out, vals.sum(axis=0).tolist(), seq=10 + r, chunk=r,
                                 slot=1, set_bit=r % 2)
        assert h.count == count
    assert sw.stats()["results_multicast"] == len(counts)
    assert sw.stats()["elements_aggregated"] == {8: sum(counts)}
    assert sw.stats()["rounds_abandoned"] == 0


def test_slots_are_independent(sw, job2):
    assert job2.send(0, [1], slot=0) == []
    assert job2.send(0, [2], slot=1) == []
    assert job2.send(0, [3], slot=3) == []
    assert_result_to_all(job2, job2.send(1, [10], slot=1), [12], seq=0, chunk=0, slot=1)
    assert_result_to_all(job2, job2.send(1, [10], slot=3), [13], seq=0, chunk=0, slot=3)
    assert_result_to_all(job2, job2.send(1, [10], slot=0), [11], seq=0, chunk=0, slot=0)


# -- Stale packets and late duplicates --------------------------------------------------------


def test_stale_packet_dropped_and_changes_nothing(sw, job2):
    # Round A on set 1, complete. Round B (newer) on set 0 is half full.
    out = job2.round([[1, 1], [2, 2]], seq=5, chunk=1, set_bit=1)
    assert_result_to_all(job2, out, [3, 3], seq=5, chunk=1, set_bit=1)
    assert job2.send(0, [10, 10], seq=5, chunk=3, set_bit=0) == []
    before = sw.stats()
    # Older rounds into set 0, from the rank that has not contributed yet.
    assert job2.send(1, [999, 999], seq=5, chunk=2, set_bit=0) == []  # older chunk
    assert job2.send(1, [999, 999], seq=4, chunk=9, set_bit=0) == []  # older operation
    assert job2.send(1, [999, 999], seq=5, chunk=1, set_bit=0) == []  # the round of set 1
    assert sw.drops == {"stale": 3}
    after = sw.stats()
    assert after["results_multicast"] == before["results_multicast"]
    # Rank 1's bit in set 1 was not cleared by the stale packets: a resend still gets the copy.
    (o,) = job2.send(1, [2, 2], seq=5, chunk=1, set_bit=1)
    assert o.header.flags & Flags.RESENT and o.payload.tolist() == [3, 3]
    # And set 0 completes with only the current round's data.
    out = job2.send(1, [20, 20], seq=5, chunk=3, set_bit=0)
    assert_result_to_all(job2, out, [30, 30], seq=5, chunk=3, set_bit=0)
    assert sw.drops == {"stale": 3}


def test_stale_packet_into_completed_set_gets_no_copy(sw, job2):
    out = job2.round([[4], [5]], seq=7, chunk=2)
    assert_result_to_all(job2, out, [9], seq=7, chunk=2)
    assert job2.send(0, [4], seq=7, chunk=0) == []
    assert job2.send(0, [4], seq=6, chunk=2) == []
    assert sw.drops == {"stale": 2}
    assert sw.stats()["results_resent"] == 0


def test_seq_compares_with_serial_arithmetic(sw, job2):
    out = job2.round([[1], [1]], seq=2**32 - 1, chunk=9)
    assert_result_to_all(job2, out, [2], seq=2**32 - 1, chunk=9)
    # seq 0 follows 2**32 - 1: a new round, not stale.
    out = job2.round([[3], [4]], seq=0, chunk=0)
    assert_result_to_all(job2, out, [7], seq=0, chunk=0)
    # And now 2**32 - 1 is the older one.
    assert job2.send(0, [1], seq=2**32 - 1, chunk=9) == []
    assert sw.drops == {"stale": 1}


def test_late_duplicate_from_worker_that_moved_on(sw, job2):
    out = job2.round([[1, 2], [3, 4]], seq=0, chunk=0, set_bit=0)
    assert_result_to_all(job2, out, [4, 6], seq=0, chunk=0)
    # Rank 0 moves on to set 1; its bit in set 0 is cleared.
    assert job2.send(0, [5, 5], seq=0, chunk=4, set_bit=1) == []
    # A late duplicate of rank 0's set-0 packet: not a contribution, not a resend.
    assert job2.send(0, [1, 2], seq=0, chunk=0, set_bit=0) == []
    assert sw.drops == {"late_duplicate": 1}
    assert sw.stats()["results_resent"] == 0
    out = job2.send(1, [5, 5], seq=0, chunk=4, set_bit=1)
    assert_result_to_all(job2, out, [10, 10], seq=0, chunk=4, set_bit=1)


# -- Isolation --------------------------------------------------------------------------------


def _bad_datagrams(a: Job, b: Job) -> dict[str, tuple[bytes, tuple[str, int]]]:
    """One bad datagram per drop reason, all aimed at job ``a``'s open round on slot 0."""
    ok = {"seq": 1, "chunk": 0, "slot": 0, "set_bit": 0}
    return {
        "unknown_job": (a.req(1, [1000] * 4, job_id=4242, **ok), a.addrs[1]),
        "bad_token": (a.req(1, [1000] * 4, token=a.token ^ 1, **ok), a.addrs[1]),
        "bad_rank": (a.req(a.n, [1000] * 4, **ok), a.addrs[1]),
        "wrong_source": (a.req(1, [1000] * 4, **ok), ("evil", 1001)),
        # rank 1 of job a from the address of rank 1 of job b
        "wrong_source_other_job": (a.req(1, [1000] * 4, **ok), b.addrs[1]),
        # job a's header, job b's slot (right after a's range)
        "bad_slot": (request(a.job_id, a.token, 1, b.slot_base, 0, 1, 0, [1000] * 4),
                     a.addrs[1]),
        "bad_slot_high": (a.req(1, [1000] * 4, **{**ok, "slot": a.window + 10}), a.addrs[1]),
        # job b's header, job a's last slot (right below b's range)
        "bad_slot_below": (request(b.job_id, b.token, 1, b.slot_base - 1, 0, 1, 0, [1000] * 4),
                           b.addrs[1]),
        "bad_payload": (a.req(1, [1000] * (a.k + 1), **ok), a.addrs[1]),
        "inconsistent_chunk": (a.req(1, [1000] * 3, **ok), a.addrs[1]),
    }


BAD_CASES = {
    "unknown_job": "unknown_job",
    "bad_token": "bad_token",
    "bad_rank": "bad_rank",
    "wrong_source": "wrong_source",
    "wrong_source_other_job": "wrong_source",
    "bad_slot": "bad_slot",
    "bad_slot_high": "bad_slot",
    "bad_slot_below": "bad_slot",
    "bad_payload": "bad_payload",
    "inconsistent_chunk": "inconsistent_chunk",
}


def _assert_only_unknown_job_echo(out, case, bad, addr):
    """Bad datagrams get no answer, except an unknown job, or a live one under another token
    (the two must look the same to whoever lacks the token): one header-only UNKNOWN_JOB echo
    to the sender (so a worker notices a restarted switch), never larger than the request; and
    a member's chunk that disagrees with its round: one MISMATCH to that member."""
    if case == "inconsistent_chunk":
        # To the sender; the round's contributor (rank 0 of job a) is told once, the first time.
        assert out[0].addr == addr and all(o.header.type is MessageType.MISMATCH for o in out)
        assert [o.addr for o in out[1:]] in ([], [("a0", 1000)])
        return
    if case not in ("unknown_job", "bad_token"):
        assert out == []
        return
    assert len(out) == 1
    o = out[0]
    assert o.addr == addr and o.header.type is MessageType.UNKNOWN_JOB
    assert o.header.count == 0 and len(o.raw) <= len(bad)


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_isolation_bad_datagram_dropped_and_other_job_unaffected(sw, case):
    a = join_job(sw, 1, TOKEN, 2, window=4, k=8, host="a")
    b = join_job(sw, 2, TOKEN2, 2, window=4, k=8, host="b")
    assert b.slot_base == a.slot_base + a.window
    bad, addr = _bad_datagrams(a, b)[case]
    # Both jobs have a round open on their slot 0.
    assert a.send(0, [1, 2, 3, 4], seq=1) == []
    assert b.send(0, [5, 5, 5, 5], seq=1) == []
    for _ in range(2):
        _assert_only_unknown_job_echo(deliver(sw, bad, addr), case, bad, addr)
    assert sw.drops == {BAD_CASES[case]: 2}
    # Job b completes interleaved with more bad traffic.
    out = b.send(1, [1, 1, 1, 1], seq=1)
    assert_result_to_all(b, out, [6, 6, 6, 6], seq=1, chunk=0)
    _assert_only_unknown_job_echo(deliver(sw, bad, addr), case, bad, addr)
    # Job a's open round was not touched either.
    out = a.send(1, [10, 20, 30, 40], seq=1)
    assert_result_to_all(a, out, [11, 22, 33, 44], seq=1, chunk=0)
    assert sw.drops == {BAD_CASES[case]: 3}
    assert sw.stats()["packets_in"] == 8 + 4 + 3  # 4 JOIN handshakes
    assert sw.stats()["results_multicast"] == 2


def test_inconsistent_exponent_or_flags_within_round(sw, job2):
    flags = int(Flags.HAS_DATA | Flags.HAS_EXP)
    assert job2.send(0, [1, 1], flags=flags, exp_data=4) == []
    for bad_flags, bad_exp in ((flags, 5),  # other exp_data
                               (Flags.HAS_DATA, 4),  # no HAS_EXP
                               (Flags.HAS_EXP, 4)):  # no HAS_DATA
        o, *to_rank0 = job2.send(1, [1, 1], flags=bad_flags, exp_data=bad_exp)
        assert o.header.type is MessageType.MISMATCH and o.addr == job2.addrs[1]
        assert [x.addr for x in to_rank0] in ([], [job2.addrs[0]])  # only the first time
        m = unpack_mismatch(o.payload)
        assert (m.theirs.flags, m.theirs.exp_data) == (flags, 4)
        assert (m.mine.flags, m.mine.exp_data) == (int(bad_flags), bad_exp)
    assert sw.drops == {"inconsistent_chunk": 3}
    out = job2.send(1, [2, 2], flags=flags | Flags.NONFINITE, exp_data=4)  # NONFINITE may differ
    h = assert_result_to_all(job2, out, [3, 3], seq=0, chunk=0)
    assert h.flags == flags | Flags.NONFINITE


def test_bytes_payload_in_request_is_bad_payload(sw, job2):
    h = Header(MessageType.REQUEST, job2.job_id, rank=0, token=TOKEN, slot=job2.slot_base,
               count=4, elem=ElementType.BYTES, flags=int(Flags.HAS_DATA))
    assert deliver(sw, pack_header(h) + bytes(4), job2.addrs[0]) == []
    assert sw.drops == {"bad_payload": 1}


def test_undecodable_and_unexpected_types_dropped(sw, job2):
    assert deliver(sw, b"hello", job2.addrs[0]) == []
    assert deliver(sw, b"\x00" * 64, job2.addrs[0]) == []
    for mtype in (MessageType.RESULT, MessageType.WAITING, MessageType.JOINED,
                  MessageType.REFUSED, MessageType.UNKNOWN_JOB):
        h = Header(mtype, job2.job_id, token=TOKEN)
        assert deliver(sw, pack_header(h), job2.addrs[0]) == []
    assert sw.drops == {"short": 1, "bad_magic": 1, "unexpected_type": 5}


# -- Control ----------------------------------------------------------------------------------


def test_join_is_idempotent(sw, job2):
    drain_events(sw)
    info = ControlInfo(2, 4, 8)
    for _ in range(2):
        (o,) = join(sw, 7, TOKEN, 1, info, job2.addrs[1])
        assert o.header.type is MessageType.JOINED
        assert unpack_joined(o.payload)[0] == ControlInfo(2, 4, 8, job2.slot_base)
    assert drain_events(sw) == []  # no new job, no new member
    assert sw.stats()["jobs"] == 1
    assert sw.stats()["slots_in_use"] == 4
    assert sw.drops == {}


def test_rejoin_from_new_address_moves_results(sw, job2):
    drain_events(sw)
    new = ("w1-new", 2001)
    (o,) = join(sw, 7, TOKEN, 1, ControlInfo(2, 4, 8), new)
    assert o.header.type is MessageType.JOINED and o.addr == new
    assert drain_events(sw) == [MemberJoined(7, 1, new)]
    assert job2.send(0, [1]) == []
    assert deliver(sw, job2.req(1, [1]), job2.addrs[1]) == []  # old address: wrong_source
    out = deliver(sw, job2.req(1, [2]), new)
    assert [o.addr for o in out] == [job2.addrs[0], new]
    assert out[0].payload.tolist() == [3]
    assert sw.drops == {"wrong_source": 1}


@pytest.mark.parametrize("info", [ControlInfo(3, 4, 8), ControlInfo(2, 5, 8),
                                  ControlInfo(2, 4, 16)])
def test_join_with_different_geometry_refused(sw, job2, info):
    (o,) = join(sw, 7, TOKEN, 0, info, ("w9", 9))
    assert o.header.type is MessageType.REFUSED
    assert o.addr == ("w9", 9)
    assert (o.header.job, o.header.token) == (7, TOKEN)
    reason = o.payload.tobytes().decode()
    assert "job 7 exists with n=2 window=4 elements_per_packet=8" in reason
    assert (f"asked n={info.num_workers} window={info.window} "
            f"elements_per_packet={info.elements_per_packet}") in reason
    assert sw.drops == {"refused": 1}
    assert sw.jobs[7] == ControlInfo(2, 4, 8, job2.slot_base)  # unchanged
    # The refused JOIN did not re-register rank 0 at the new address.
    assert job2.send(0, [1]) == []


def _answers(sw, job, token, addr):
    """What a stranger without the switch's secret gets for a JOIN of ``job`` under
    ``token``: the CHALLENGE (its type), then, for a JOIN with that cookie and a proof under
    a wrong secret, the answers' types and the REFUSED's reason."""
    info = ControlInfo(2, 4, 8)
    (ch,) = deliver(sw, pack_join(job=job, token=token, rank=0, info=info), addr)
    out = deliver(sw, join_datagram(job_key(b"not the switch's secret", job, token), job=job,
                                    token=token, rank=0, seq=0, info=info,
                                    cookie=unpack_challenge(ch.payload)), addr)
    return ch.header.type, [o.header.type for o in out], [o.payload.tobytes() for o in out]


def test_join_with_wrong_token_for_existing_job_looks_like_an_unknown_job(sw, job2):
    """A wrong-token JOIN once told live job ids from unused ones (it was dropped unanswered,
    where an unknown id drew a challenge): a stranger learns nothing now, and the job is
    untouched."""
    drain_events(sw)
    live = _answers(sw, 7, TOKEN ^ 0xFF, ("thief", 1))
    unknown = _answers(sw, 4242, TOKEN ^ 0xFF, ("thief", 1))
    assert live == unknown
    assert live[:2] == (MessageType.CHALLENGE, [MessageType.REFUSED])
    assert sw.drops == {"bad_proof": 2, "refused": 2}
    assert 4242 not in sw.jobs
    assert [type(e) for e in drain_events(sw)] == [JobRefused, JobRefused]
    # rank 0 still belongs to its original address
    assert job2.send(0, [1]) == []
    assert_result_to_all(job2, job2.send(1, [1]), [2], seq=0, chunk=0)


def test_join_rank_outside_existing_job_refused(sw, job2):
    (o,) = join(sw, 7, TOKEN, 2, ControlInfo(2, 4, 8), ("w2", 2))
    assert o.header.type is MessageType.REFUSED
    assert "rank 2 outside job 7 of 2" in o.payload.tobytes().decode()


def test_refused_join_of_new_job_leaves_no_state(sw):
    (o,) = join(sw, 5, TOKEN, 3, ControlInfo(2, 8, 8), ("w", 1))
    assert o.header.type is MessageType.REFUSED
    assert "rank 3" in o.payload.tobytes().decode()
    assert [type(e) for e in drain_events(sw)] == [JobRefused]  # no JobCreated
    assert sw.stats()["jobs"] == 0
    assert sw.stats()["slots_in_use"] == 0


def test_join_malformed_control_payload_dropped(sw):
    h = Header(MessageType.JOIN, 5, token=TOKEN, count=15, elem=ElementType.BYTES)
    assert deliver(sw, pack_header(h) + bytes(15), ("w", 1)) == []
    assert sw.drops == {"bad_control": 1}
    assert sw.stats()["jobs"] == 0


def test_job_larger_than_pool_refused(sw):
    (o,) = join(sw, 3, TOKEN, 0, ControlInfo(2, POOL + 1, 8), ("w", 1))
    assert o.header.type is MessageType.REFUSED
    reason = o.payload.tobytes().decode()
    assert f"pool of {POOL}" in reason
    assert f"asked {POOL + 1} slots" in reason
    assert sw.stats()["jobs"] == 0
    assert sw.stats()["slots_in_use"] == 0
    assert sw.drops == {"refused": 1}
    assert [type(e) for e in drain_events(sw)] == [JobRefused]  # no JobCreated


def test_job_larger_than_remaining_pool_refused(sw, job2):
    (o,) = join(sw, 3, TOKEN, 0, ControlInfo(2, POOL - 3, 8), ("w", 1))
    assert o.header.type is MessageType.REFUSED
    reason = o.payload.tobytes().decode()
    assert f"largest free range is {POOL - 4} of a pool of {POOL}" in reason
    assert sw.stats()["slots_in_use"] == 4


@pytest.mark.parametrize("info, fragments", [
    # n = 0: rank 0 is outside the job too; either reason names the problem
    (ControlInfo(0, 4, 8), ("num_workers must be in 1..64, got 0", "rank 0 outside job 3 of 0")),
    (ControlInfo(65, 4, 8), ("num_workers must be in 1..64, got 65",)),
    (ControlInfo(2, 0, 8), ("window must be in 1..256, got 0",)),
    (ControlInfo(2, 257, 8), ("window must be in 1..256, got 257",)),
    (ControlInfo(2, 4, 0), (f"elements_per_packet must be in 1..{MAX_K}, got 0",)),
    (ControlInfo(2, 4, MAX_K + 1), (f"elements_per_packet must be in 1..{MAX_K}, got 65",)),
])
def test_join_with_invalid_geometry_refused(sw, info, fragments):
    (o,) = join(sw, 3, TOKEN, 0, info, ("w", 1))
    assert o.header.type is MessageType.REFUSED
    reason = o.payload.tobytes().decode()
    assert any(f in reason for f in fragments), reason
    assert sw.stats()["jobs"] == 0 and sw.stats()["slots_in_use"] == 0
    assert [type(e) for e in drain_events(sw)] == [JobRefused]  # no JobCreated


def test_leave_of_all_members_frees_slots(sw):
    job = join_job(sw, 11, TOKEN, 2, window=POOL, k=8)  # the whole pool
    assert sw.stats()["slots_in_use"] == POOL
    drain_events(sw)
    # The pool is full now.
    (o,) = join(sw, 12, TOKEN2, 0, ControlInfo(1, 1, 8), ("x", 1))
    assert o.header.type is MessageType.REFUSED
    (o,) = leave(sw, 11, TOKEN, 0, job.addrs[0], job.cookies[0])
    assert o.header.type is MessageType.LEFT and o.addr == job.addrs[0]
    assert (o.header.job, o.header.rank) == (11, 0)
    assert sw.stats()["jobs"] == 1  # rank 1 is still there
    assert sw.stats()["slots_in_use"] == POOL
    # rank 0 left: its requests are no longer accepted; it is told to join again
    (echo,) = job.send(0, [1])
    assert echo.header.type is MessageType.UNKNOWN_JOB and echo.addr == job.addrs[0]
    assert sw.drops == {"refused": 1, "not_joined": 1}
    (o,) = leave(sw, 11, TOKEN, 1, job.addrs[1], job.cookies[1])
    assert o.header.type is MessageType.LEFT
    st_ = sw.stats()
    assert st_["jobs"] == 0 and st_["slots_in_use"] == 0 and st_["memory_bytes"] == 0
    assert (st_["members_joined"], st_["members_left"], st_["jobs_expired"]) == (2, 2, 0)
    assert sw.jobs == {}
    refused, removed = drain_events(sw)
    assert isinstance(refused, JobRefused) and refused.job_id == 12
    assert removed == JobRemoved(11, "left")
    # A new job can take the whole pool again.
    new = join_job(sw, 12, TOKEN2, 1, window=POOL, k=8, host="n")
    assert new.slot_base == 0
    assert_result_to_all(new, new.send(0, [5, 6], slot=POOL - 1), [5, 6], seq=0, chunk=0,
                         slot=POOL - 1)


def test_leave_with_wrong_token_or_address_keeps_job(sw, job2):
    # Answered as a LEAVE of an unknown job is (LEFT), and nothing changes
    (o,) = leave(sw, 7, TOKEN ^ 1, 0, job2.addrs[0], job2.cookies[0])
    assert o.header.type is MessageType.LEFT and o.header.token == TOKEN ^ 1
    assert sw.drops == {"bad_token": 1}
    # Right token, wrong address: acknowledged but the member stays.
    for rank in (0, 1):
        (o,) = leave(sw, 7, TOKEN, rank, ("evil", 1), job2.cookies[rank])
        assert o.header.type is MessageType.LEFT
    assert sw.stats()["jobs"] == 1
    assert_result_to_all(job2, job2.round([[1], [2]]), [3], seq=0, chunk=0)


def test_leave_of_unknown_job_is_acknowledged(sw):
    (o,) = leave(sw, 99, TOKEN, 0, ("w", 1))
    assert o.header.type is MessageType.LEFT
    assert sw.drops == {"stray_leave": 1}  # answered (a lost LEFT's retry), and counted


def test_remove_job_operator_action(sw, job2):
    drain_events(sw)
    assert sw.remove_job(7, "operator") is True
    assert sw.remove_job(7, "operator") is False
    assert drain_events(sw) == [JobRemoved(7, "operator")]
    assert sw.stats()["slots_in_use"] == 0
    (echo,) = job2.send(0, [1])
    assert echo.header.type is MessageType.UNKNOWN_JOB and echo.addr == job2.addrs[0]
    assert sw.drops == {"unknown_job": 1}


def test_two_jobs_get_disjoint_slot_ranges(sw):
    jobs = [join_job(sw, 100 + i, TOKEN + i, 2, window=w, k=8, host=f"j{i}-")
            for i, w in enumerate([5, 1, 7, 3])]
    ranges = [set(range(j.slot_base, j.slot_base + j.window)) for j in jobs]
    for i in range(len(ranges)):
        for k in range(i + 1, len(ranges)):
            assert not ranges[i] & ranges[k]
    assert all(r <= set(range(POOL)) for r in ranges)
    assert sw.stats()["slots_in_use"] == 16
    # Each job aggregates on its own slots at the same local slot and set, concurrently.
    for i, j in enumerate(jobs):
        assert j.send(0, [i]) == []
    for i, j in enumerate(jobs):
        assert_result_to_all(j, j.send(1, [100]), [100 + i], seq=0, chunk=0)


def test_freed_range_is_reused_first_fit(sw):
    a = join_job(sw, 1, TOKEN, 1, window=10, k=8, host="a")
    b = join_job(sw, 2, TOKEN, 1, window=10, k=8, host="b")
    leave(sw, 1, TOKEN, 0, a.addrs[0], a.cookies[0])
    c = join_job(sw, 3, TOKEN, 1, window=4, k=8, host="c")
    assert (a.slot_base, b.slot_base, c.slot_base) == (0, 10, 0)
    assert sw.stats()["slots_in_use"] == 14


# -- Sizes ------------------------------------------------------------------------------------


def test_single_worker_completes_on_single_contribution(sw):
    job = join_job(sw, 1, TOKEN, 1)
    out = job.send(0, [3, -4, 5], seq=9, chunk=1, slot=2, set_bit=1)
    assert_result_to_all(job, out, [3, -4, 5], seq=9, chunk=1, slot=2, set_bit=1)
    # A retransmission gets the copy; the next round on the other set works too.
    (o,) = job.send(0, [3, -4, 5], seq=9, chunk=1, slot=2, set_bit=1)
    assert o.header.flags & Flags.RESENT and o.payload.tolist() == [3, -4, 5]
    out = job.send(0, [7], seq=9, chunk=5, slot=2, set_bit=0)
    assert_result_to_all(job, out, [7], seq=9, chunk=5, slot=2, set_bit=0)


def test_forty_workers(sw):
    n = 40
    job = join_job(sw, 40, TOKEN, n, window=2, k=4)
    vals = [[r, 2 * r, -r, 1] for r in range(n)]
    for r in range(n - 1):
        assert job.send(r, vals[r]) == []
        if r == 33:
            # WAITING names missing ranks beyond bit 31: 34..39 in a 5-byte bitmap (then the
            # 5-byte bitmap of those gone: none).
            (o,) = job.send(r, vals[r])
            assert o.header.type is MessageType.WAITING
            assert o.header.count == 10
            raw = o.payload.tobytes()
            assert int.from_bytes(raw[:5], "little") == sum(1 << k for k in range(34, 40))
            assert raw[5:] == bytes(5)
    out = job.send(n - 1, vals[n - 1])
    assert_result_to_all(job, out, [780, 1560, -780, 40], seq=0, chunk=0)
    assert len(out) == 40
    # The high ranks can fetch the shadow copy too.
    (o,) = job.send(39, vals[39])
    assert o.header.flags & Flags.RESENT and o.addr == job.addrs[39]


def test_full_size_packet(sw):
    job = join_job(sw, 1, TOKEN, 2, window=1, k=MAX_K)
    a = np.arange(MAX_K)
    out = job.round([a, 2 * a])
    assert_result_to_all(job, out, (3 * a).tolist(), seq=0, chunk=0)
    assert len(out[0].raw) == HEADER_SIZE + 4 * MAX_K


def test_int32_sums_wrap_on_overflow(sw, job3):
    big = 2**31 - 1
    out = job3.round([[big, -(2**31), 5], [1, -1, big], [0, 0, big]])
    # two's complement wrap, as the hardware switch: no saturation, no error
    expected = [(big + 1) - 2**32, 2**31 - 1, (5 + 2 * big) - 2**32]
    assert_result_to_all(job3, out, expected, seq=0, chunk=0)
    assert expected == [-(2**31), 2**31 - 1, 3]


def test_input_buffer_not_retained(sw, job2):
    # The UDP driver receives into one preallocated buffer and passes a memoryview of it.
    buf = bytearray(256)
    data = job2.req(0, [1, 2])
    buf[:len(data)] = data
    sw.receive_datagram(memoryview(buf)[:len(data)], job2.addrs[0], 0.0)
    assert sw.datagrams_to_send(0.0) == []
    buf[:] = bytes(256)  # the next receive overwrites it
    out = job2.send(1, [10, 10])
    assert out[0].payload.tolist() == [11, 12]


# -- Properties -------------------------------------------------------------------------------

VICTIM_JOB = 0x7A5C1
VICTIM_TOKEN = 0x0DDC0FFEE0DDF00D
NOISY_JOB = 3
NOISY_TOKEN = 0xBAD
ATTACKER = ("evil", 666)
ACCOMPLICE = ("evil", 667)
HOSTILE_ADDRS = [ATTACKER, ACCOMPLICE, ("v0", 1000), ("v1", 1001)]


def _victim_switch() -> tuple[SwitchDataplane, Job]:
    """A switch with the victim job, and a noisy job whose token the generated traffic knows."""
    sw = SwitchDataplane(SwitchConfig(pool_slots=32, max_elements_per_packet=MAX_K,
                                      max_workers=64))
    victim = join_job(sw, VICTIM_JOB, VICTIM_TOKEN, 2, window=2, k=4, host="v")
    info = ControlInfo(2, 2, 4)
    for rank, addr in enumerate((ATTACKER, ACCOMPLICE)):
        (o,) = join(sw, NOISY_JOB, NOISY_TOKEN, rank, info, addr)
        assert o.header.type is MessageType.JOINED
    return sw, victim


def _check_one(sw: SwitchDataplane, data: bytes, addr) -> None:
    """Deliver one hostile datagram and check it was answered or counted, never raised."""
    packets_in = sw.packets_in
    drops_before = total_drops(sw)
    sw.receive_datagram(data, addr, now=0.0)
    out = [decode(d, a) for d, a in sw.datagrams_to_send(now=0.0)]
    assert sw.packets_in == packets_in + 1
    delta = total_drops(sw) - drops_before
    assert delta in (0, 1)
    try:
        h = unpack_header(data)
    except WireError as exc:
        assert delta == 1 and sw.drops[exc.reason] >= 1
        assert out == []
        return
    # Nothing about the victim job goes out without its token: a reply naming its job id only
    # echoes the sender's own job id and token (as an unknown job's would), never the
    # victim's token; only senders of this traffic (members of jobs it can reach) ever
    # receive anything.
    for o in out:
        if o.header.job == VICTIM_JOB:
            assert (o.header.job, o.header.token) == (h.job, h.token)
        assert o.header.token != VICTIM_TOKEN or h.token == VICTIM_TOKEN
        assert o.addr in HOSTILE_ADDRS
    if h.type is not MessageType.REQUEST or delta == 1:
        # Control replies and WAITING: to the sender. A refused chunk (MISMATCH) is also told
        # to the members of the sender's own job that contributed to the round.
        assert all(o.addr == addr or (o.header.type is MessageType.MISMATCH
                                      and o.header.job == h.job) for o in out)
    if delta == 0 and not out:
        # Silently accepted: only a contribution or a lease renewal (KEEPALIVE) of a job the
        # sender belongs to.
        assert h.type in (MessageType.REQUEST, MessageType.KEEPALIVE)
        assert h.job != VICTIM_JOB


def _victim_round(sw: SwitchDataplane, victim: Job, r: int, before_last) -> None:
    seq, set_bit = r, r % 2
    assert victim.send(0, [r, 1, 2, 3], seq=seq, set_bit=set_bit) == []
    before_last()
    out = victim.send(1, [1, r, 0, -3], seq=seq, set_bit=set_bit)
    assert_result_to_all(victim, out, [r + 1, r + 1, 2, 0], seq=seq, chunk=0, set_bit=set_bit)


@settings(derandomize=True, max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=120), min_size=1, max_size=8))
def test_property_arbitrary_bytes_never_raise(blobs):
    sw, victim = _victim_switch()
    drops0 = total_drops(sw)
    for r, blob in enumerate(blobs):
        _victim_round(sw, victim, r, lambda b=blob: _check_one(sw, b, ATTACKER))
    assert total_drops(sw) - drops0 == len(blobs)
    assert sw.stats()["results_multicast"] == len(blobs)


_u16 = st.integers(0, 2**16 - 1)
_u32 = st.integers(0, 2**32 - 1)
_i16 = st.integers(-(2**15), 2**15 - 1)
_small = st.integers(0, 3)
_TYPES = [MessageType.REQUEST] * 6 + [MessageType.JOIN] * 2 + [MessageType.LEAVE] + list(
    MessageType)


@st.composite
def hostile_traffic(draw):
    """(datagram, source): valid headers with random fields and random payload lengths, aimed
    at the victim (without its token, from anywhere, also from a victim's address), at the noisy
    job (with its token, mostly from its members), at small job ids, or anywhere."""
    mtype = draw(st.sampled_from(_TYPES))
    elem = draw(st.sampled_from([ElementType.INT32, ElementType.INT32, ElementType.BYTES]))
    target = draw(st.sampled_from(["victim", "noisy", "noisy", "noisy", "small", "random"]))
    rank = draw(st.one_of(st.integers(0, 2), _u16))
    addr = draw(st.sampled_from(HOSTILE_ADDRS))
    if target == "victim":
        job_id = VICTIM_JOB
        token = draw(st.one_of(st.just(VICTIM_TOKEN ^ 1), st.integers(0, 2**64 - 1)))
    elif target == "noisy":
        job_id, token = NOISY_JOB, NOISY_TOKEN
        mtype = draw(st.sampled_from([MessageType.REQUEST] * 3 + [mtype]))
        rank = draw(st.sampled_from([0, 1, 0, 1, rank]))
        if rank < 2 and draw(st.booleans()):
            addr = (ATTACKER, ACCOMPLICE)[rank]
    elif target == "small":
        job_id, token = draw(st.integers(0, 2)), draw(st.integers(0, 1))
    else:
        job_id, token = draw(_u32), draw(st.integers(0, 2**64 - 1))
    assume(token != VICTIM_TOKEN)
    count = draw(st.one_of(st.integers(0, 5), st.integers(0, 80)))
    slot = draw(st.one_of(st.integers(0, 6), _u32))
    seq, chunk = draw(st.one_of(_small, _u32)), draw(st.one_of(_small, _u32))
    if target == "noisy":  # mostly well-formed: the noisy job's own slots, k = 4
        slot = draw(st.sampled_from([2, 3, slot]))
        count = draw(st.sampled_from([0, 4, 4, count]))
        elem = draw(st.sampled_from([ElementType.INT32, ElementType.INT32, elem]))
        seq, chunk = draw(st.integers(0, 1)), draw(st.integers(0, 1))
    h = Header(mtype, job_id, rank=rank, token=token, seq=seq, chunk=chunk, slot=slot,
               set_bit=draw(st.integers(0, 1)),
               count=count, elem=elem,
               flags=draw(st.sampled_from([2, 2, 3, 4, 6]) | st.integers(0, 15)),
               exp_data=draw(st.one_of(st.just(EXP_ZERO), _i16)),
               exp_next=draw(st.one_of(st.just(EXP_ZERO), _i16)))
    itemsize = 4 if elem is ElementType.INT32 else 1
    kind = draw(st.sampled_from(["exact", "exact", "exact", "control", "random"]))
    if kind == "exact":
        payload = draw(st.binary(min_size=count * itemsize, max_size=count * itemsize))
    elif kind == "control":
        info = ControlInfo(draw(st.integers(0, 70)), draw(st.one_of(st.integers(0, 40), _u32)),
                           draw(st.one_of(st.integers(0, 70), _u32)), draw(_u32))
        # A JOIN-sized payload: asking for a challenge (zero cookie), or with a forged one.
        cookie = draw(st.one_of(st.just(bytes(24)), st.binary(min_size=24, max_size=24)))
        payload = pack_control_info(info) + cookie + draw(st.binary(min_size=32, max_size=32))
        h = Header(mtype, job_id, rank=h.rank, token=token, count=len(payload) // itemsize,
                   elem=elem, flags=h.flags)
    else:
        payload = draw(st.binary(max_size=400))
    traffic = [(pack_header(h) + payload, addr)]
    if target == "noisy" and mtype is MessageType.REQUEST and h.rank < 2 and draw(st.booleans()):
        # The other noisy member sends the same chunk: rounds of the noisy job complete.
        twin = replace(h, rank=1 - h.rank, exp_next=draw(_i16),
                       flags=h.flags ^ draw(st.sampled_from([0, 0, int(Flags.NONFINITE)])))
        twin_payload = draw(st.binary(min_size=len(payload), max_size=len(payload)))
        traffic.append((pack_header(twin) + twin_payload, (ATTACKER, ACCOMPLICE)[twin.rank]))
    return traffic


@settings(derandomize=True, max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hostile_traffic(), min_size=1, max_size=8))
def test_property_valid_headers_never_raise_and_victim_stays_correct(traffic):
    sw, victim = _victim_switch()
    hostile_count = 0
    for r, batch in enumerate(traffic):
        # Interleaved between the two contributions of each victim round.
        def hostile(batch=batch):
            for data, addr in batch:
                _check_one(sw, data, addr)
                _check_one(sw, data, addr)  # and again, as a duplicate

        _victim_round(sw, victim, r, hostile)
        hostile_count += 2 * len(batch)
    st_ = sw.stats()
    assert sw.jobs[VICTIM_JOB] == ControlInfo(2, 2, 4, victim.slot_base)
    assert st_["elements_aggregated"][VICTIM_JOB] == 4 * len(traffic)
    assert st_["packets_in"] == 8 + 2 * len(traffic) + hostile_count  # 4 JOIN handshakes
    assert total_drops(sw) <= hostile_count


def test_chunks_that_disagree_are_answered_with_mismatch_on_both_sides(sw):
    """Ranks that issue different sizes: the refused rank and the round's contributors hear it
    at once, a later agreeing contributor when it contributes, a retransmission again; nobody
    waits for a timeout."""
    j = join_job(sw, 3, TOKEN, 3)
    assert j.send(0, [1, 1], chunk=5) == []
    out = j.send(1, [1, 1, 1], chunk=5)  # rank 1 thinks the chunk holds 3 elements
    assert [(o.addr, o.header.type) for o in out] == [(j.addrs[1], MessageType.MISMATCH),
                                                      (j.addrs[0], MessageType.MISMATCH)]
    o = out[0]
    assert (o.header.job, o.header.token, o.header.rank, o.header.chunk) == (3, TOKEN, 1, 5)
    m = unpack_mismatch(o.payload)
    assert (m.theirs.count, m.mine.count, m.ranks) == (2, 3, 0b001)
    assert m.theirs.elem == m.mine.elem == ElementType.INT32
    assert "2 int32" in m.theirs.describe() and "3 int32" in m.mine.describe()
    m = unpack_mismatch(out[1].payload)  # rank 0, a contributor: told about rank 1
    assert (out[1].header.rank, m.theirs.count, m.mine.count, m.ranks) == (0, 3, 2, 0b010)
    # Rank 1 again: only rank 1 hears it (the contributors were told already).
    assert [o.addr for o in j.send(1, [1, 1, 1], chunk=5)] == [j.addrs[1]]
    # Rank 2 agrees with rank 0: accepted, and told at once about rank 1.
    (o,) = j.send(2, [1, 1], chunk=5)
    assert (o.addr, o.header.type) == (j.addrs[2], MessageType.MISMATCH)
    assert unpack_mismatch(o.payload).ranks == 0b010
    for r in (0, 2):  # contributors retransmit: MISMATCH naming rank 1 instead of WAITING
        (o,) = j.send(r, [1, 1], chunk=5)
        assert (o.addr, o.header.type) == (j.addrs[r], MessageType.MISMATCH)
        m = unpack_mismatch(o.payload)
        assert (m.theirs.count, m.mine.count, m.ranks) == (3, 2, 0b010)
    assert sw.stats()["mismatch_sent"] == 6
    assert sw.stats()["waiting_sent"] == 0
    # A new round on the slot forgets the conflict: a retransmission there gets WAITING again.
    assert j.send(0, [1, 1], chunk=6) == []
    (o,) = j.send(0, [1, 1], chunk=6)
    assert o.header.type is MessageType.WAITING
    assert int.from_bytes(o.payload.tobytes(), "little") == 0b110


def test_a_rank_that_sends_its_right_chunk_after_a_wrong_one_clears_its_conflict(sw, job2):
    assert job2.send(0, [1, 1]) == []
    assert len(job2.send(1, [1, 1, 1])) == 2  # refused: MISMATCH to rank 1 and rank 0
    out = job2.send(1, [2, 2])  # its right chunk: the round completes, no MISMATCH
    assert_result_to_all(job2, out, [3, 3], seq=0, chunk=0)


def test_operation_digest_must_match_and_is_echoed_in_the_result(sw, job2):
    """Same chunk geometry, different operations (e.g. 1000 vs 1001 elements: every chunk but
    the last looks the same): the digest tells them apart at the first chunk."""
    assert job2.send(0, [1, 1], digest=0x11) == []
    o, to_rank0 = job2.send(1, [1, 1], digest=0x22)
    assert o.header.type is MessageType.MISMATCH and to_rank0.addr == job2.addrs[0]
    m = unpack_mismatch(o.payload)
    assert (m.theirs.digest, m.mine.digest, m.ranks) == (0x11, 0x22, 0b01)
    assert m.theirs.count == m.mine.count == 2
    out = job2.send(1, [2, 2], digest=0x11)  # the agreeing chunk still completes the round
    h = assert_result_to_all(job2, out, [3, 3], seq=0, chunk=0)
    assert h.digest == 0x11


def test_a_secret_holders_join_under_another_token_is_told_the_id_is_taken():
    """Whoever holds the switch's secret may create jobs: a JOIN it proves for a live job id
    under another token is refused, saying so (it needs another id), and the job is kept."""
    secret = b"s" * 32
    sw = SwitchDataplane(SwitchConfig(pool_slots=64, secret=secret))
    join(sw, 7, TOKEN, 0, ControlInfo(2, 4, 8), ("a0", 1000), secret=secret)
    (o,) = join(sw, 7, TOKEN ^ 1, 0, ControlInfo(2, 4, 8), ("b0", 1000), secret=secret)
    assert o.header.type is MessageType.REFUSED
    assert "job 7 is in use with another token" in o.payload.tobytes().decode()
    assert sw.jobs[7].num_workers == 2 and sw.drops == {"refused": 1}
