"""Who may change a job (docs/protocol.md section 2, "Who may join"): every control message a
job's workers send is captured on its way to the switch and replayed, from another address
and from the member's own (an on-path spoofer), at once and after the challenge's lifetime,
in each phase of a job. Nothing may change: the members stay where they joined, the sums stay
bit-identical to an undisturbed run's (and equal to numpy's), and each replay is counted.

The proofs are checked against HMAC-SHA256 computed here from the documented byte layout,
not against the code's own helpers.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import pytest

from switchml.protocol import auth
from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.endpoint import exchange
from switchml.protocol.events import MemberJoined
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import ControlInfo, MessageType, pack_join, unpack_header
from switchml.protocol.worker import WorkerEndpoint, WorkerState

SA = ("switch", 1)
ADDRS = [("w0", 10), ("w1", 11)]
EVIL = ("evil", 666)
SECRET = b"0123456789abcdef-the-switch-secret"
SPEC = JobSpec(job_id=0xC0FFEE, token=0x1234_5678_9ABC_DEF0, num_workers=2, window=2,
               elements_per_packet=4)
CONTROL = (MessageType.JOIN, MessageType.LEAVE, MessageType.KEEPALIVE)
LIFETIME = SwitchConfig().join_challenge_s


class Tap:
    """Passes datagrams to the switch and keeps a copy of each control message (what an
    on-path observer sees)."""

    def __init__(self, sw: SwitchDataplane) -> None:
        self.sw = sw
        self.captured: list[tuple[bytes, tuple]] = []

    def receive_datagram(self, data, addr, now: float) -> None:
        raw = bytes(data)
        if unpack_header(raw).type in CONTROL:
            self.captured.append((raw, addr))
        self.sw.receive_datagram(raw, addr, now)

    def datagrams_to_send(self, now: float):
        return self.sw.datagrams_to_send(now)


def _inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(37).astype(np.float32) for _ in range(2)]


def _run(phase: str | None, source: str, delay: float, secret: bytes | None):
    """One job: join, two all-reduces, both ranks leave; at ``phase`` every control message
    captured so far is replayed ``delay`` seconds later from ``source`` ("other": an
    attacker's address; "same": each message's own sender). Returns (sums, switch, members
    seen joining, outputs of the replays)."""
    sw = SwitchDataplane(SwitchConfig(secret=secret))
    tap = Tap(sw)
    ws = [WorkerEndpoint(spec=SPEC, rank=r, switch_address=SA,
                         config=WorkerConfig(secret=secret, keepalive_s=1.0)) for r in range(2)]
    eps = {SA: tap, ADDRS[0]: ws[0], ADDRS[1]: ws[1]}
    now = 0.0
    replies: list[tuple[MessageType, tuple]] = []

    def replay() -> None:
        nonlocal now
        now += delay
        for raw, addr in list(tap.captured):
            sw.receive_datagram(raw, EVIL if source == "other" else addr, now)
        for d, dst in sw.datagrams_to_send(now):
            replies.append((unpack_header(bytes(d)).type, dst))
            if dst in eps:  # what the members' own address receives, they get
                eps[dst].receive_datagram(bytes(d), SA, now)
        exchange(eps, now)

    for w in ws:
        w.join(now)
    exchange(eps, now)
    assert [w.state for w in ws] == [WorkerState.READY] * 2
    now += 1.0  # idle: each rank renews the lease (KEEPALIVE)
    for w in ws:
        w.handle_timer(now)
    exchange(eps, now)
    if phase == "joined":
        replay()
    xs = _inputs()
    outs = []
    for op in range(2):
        out = [np.empty_like(x) for x in xs]
        ws[0].start_allreduce(xs[0], out[0], now)
        exchange(eps, now)  # rank 0's first window is in; its slots wait for rank 1
        if phase == "mid-operation" and op == 1:
            replay()
        ws[1].start_allreduce(xs[1], out[1], now)
        exchange(eps, now)
        assert [w.state for w in ws] == [WorkerState.READY] * 2, [w.error for w in ws]
        outs.append(out)
    ws[0].close(now)
    exchange(eps, now)
    assert ws[0].state is WorkerState.CLOSED
    if phase == "one left":
        replay()
        assert sw.jobs[SPEC.job_id] and sw.stats()["jobs"] == 1
    ws[1].close(now)
    exchange(eps, now)
    assert ws[1].state is WorkerState.CLOSED
    if phase == "all left":
        replay()
    assert {unpack_header(raw).type for raw, _ in tap.captured} >= set(CONTROL)
    joined = []
    while (e := sw.next_event()) is not None:
        if isinstance(e, MemberJoined):
            joined.append((e.rank, e.address))
    return outs, sw, joined, replies


@pytest.fixture(scope="module")
def undisturbed():
    return {s: _run(None, "other", 0.0, s)[0] for s in (None, SECRET)}


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "secret"])
@pytest.mark.parametrize("source, delay", [("other", 0.001), ("other", LIFETIME + 1),
                                           ("same", 0.001), ("same", LIFETIME + 1)],
                         ids=["elsewhere-at-once", "elsewhere-later", "spoofed-at-once",
                              "spoofed-later"])
@pytest.mark.parametrize("phase", ["joined", "mid-operation", "one left", "all left"])
def test_a_replayed_control_message_changes_nothing(phase, source, delay, secret,
                                                    undisturbed):
    outs, sw, joined, replies = _run(phase, source, delay, secret)
    xs = _inputs()
    for op in range(2):
        for r in range(2):
            assert outs[op][r].tobytes() == undisturbed[secret][op][r].tobytes()
            np.testing.assert_allclose(outs[op][r], xs[0] + xs[1], rtol=1e-5, atol=1e-6)
    assert joined == [(0, ADDRS[0]), (1, ADDRS[1])]  # nobody joined again, or elsewhere
    # The replayer learns nothing but a fresh challenge, an acknowledged LEAVE that changed
    # nothing, or that the job is gone (a replayed KEEPALIVE's echo).
    assert all(dst != EVIL or t in (MessageType.CHALLENGE, MessageType.LEFT,
                                    MessageType.UNKNOWN_JOB) for t, dst in replies)
    st = sw.stats()
    assert st["jobs"] == 0 and st["slots_in_use"] == 0  # both left: the job is gone for good
    drops = sw.drops
    replayed_proven = {"bad_cookie", "stale_cookie", "spent_cookie"} & set(drops)
    if source == "other":
        assert drops["bad_cookie"] >= 2  # the two proven JOINs, made for other addresses
    elif delay > LIFETIME:
        assert drops["stale_cookie"] >= 2
    elif phase in ("one left", "all left"):
        assert drops["spent_cookie"] >= 1  # challenged before the rank left
    else:
        assert not replayed_proven  # the member's own JOIN again: idempotent, answered


def test_a_replayed_leave_cannot_end_a_later_membership():
    """Rank 0 joins, leaves, joins again (a new challenge): its old LEAVE, replayed from its
    own address, proves the old membership's cookie and is refused."""
    sw = SwitchDataplane()
    tap = Tap(sw)
    w = WorkerEndpoint(spec=SPEC, rank=0, switch_address=SA)
    eps = {SA: tap, ADDRS[0]: w}
    w.join(0.0)
    exchange(eps, 0.0)
    w2 = WorkerEndpoint(spec=SPEC, rank=1, switch_address=SA)  # keeps the job alive
    eps[ADDRS[1]] = w2
    w2.join(0.0)
    exchange(eps, 0.0)
    w.close(1.0)
    exchange(eps, 1.0)
    old_leave = [raw for raw, a in tap.captured if unpack_header(raw).type is MessageType.LEAVE]
    again = WorkerEndpoint(spec=SPEC, rank=0, switch_address=SA)
    eps[ADDRS[0]] = again
    again.join(2.0)
    exchange(eps, 2.0)
    assert again.state is WorkerState.READY
    sw.receive_datagram(old_leave[0], ADDRS[0], 3.0)
    assert sw.datagrams_to_send(3.0) == []
    assert sw.drops["bad_leave"] == 1
    x = [np.arange(8, dtype=np.int32), 10 * np.arange(8, dtype=np.int32)]
    outs = [np.empty_like(v) for v in x]
    again.start_allreduce(x[0], outs[0], 3.0)
    w2.start_allreduce(x[1], outs[1], 3.0)
    exchange(eps, 3.0)
    assert np.array_equal(outs[0], 11 * np.arange(8)) and np.array_equal(outs[1], outs[0])


def test_a_leave_that_changes_nothing_is_answered_and_counted():
    """A LEAVE from an address that is not the rank's member (a stranger replaying a captured
    one) and a LEAVE for a job the switch no longer holds (a retry whose LEFT was lost) are
    answered with LEFT, change nothing, and are counted as ``stray_leave``."""
    sw = SwitchDataplane()
    tap = Tap(sw)
    ws = [WorkerEndpoint(spec=SPEC, rank=r, switch_address=SA) for r in range(2)]
    eps = {SA: tap, ADDRS[0]: ws[0], ADDRS[1]: ws[1]}
    for w in ws:
        w.join(0.0)
    exchange(eps, 0.0)
    ws[0].close(1.0)
    exchange(eps, 1.0)
    (leave,) = [raw for raw, _ in tap.captured if unpack_header(raw).type is MessageType.LEAVE]
    assert sw.stats()["members_left"] == 1
    sw.receive_datagram(leave, EVIL, 2.0)  # rank 0 has left: EVIL is no member of it
    (reply,) = sw.datagrams_to_send(2.0)
    assert reply[1] == EVIL and unpack_header(reply[0]).type is MessageType.LEFT
    assert sw.stats()["members_left"] == 1 and sw.stats()["jobs"] == 1  # rank 1 stays
    assert sw.drops["stray_leave"] == 1
    ws[1].close(3.0)
    exchange(eps, 3.0)
    assert sw.stats()["jobs"] == 0
    sw.receive_datagram(leave, ADDRS[0], 4.0)  # the job is gone
    (reply,) = sw.datagrams_to_send(4.0)
    assert reply[1] == ADDRS[0] and unpack_header(reply[0]).type is MessageType.LEFT
    assert sw.drops["stray_leave"] == 2 and sw.stats()["jobs"] == 0


def test_a_replayed_joined_to_a_ready_worker_is_counted_and_changes_nothing():
    """The switch's JOINED, captured on its way to rank 0 and replayed to it 100 times once it
    is ready: dropped and counted (``unexpected_control``), the rank stays ready and its next
    sum is numpy's."""
    sw = SwitchDataplane()
    ws = [WorkerEndpoint(spec=SPEC, rank=r, switch_address=SA) for r in range(2)]
    captured = []

    class Watch:  # rank 0's side: keeps a copy of every JOINED it is sent
        def receive_datagram(self, data, addr, now):
            if unpack_header(bytes(data)).type is MessageType.JOINED:
                captured.append(bytes(data))
            ws[0].receive_datagram(data, addr, now)

        def datagrams_to_send(self, now):
            return ws[0].datagrams_to_send(now)

    eps = {SA: sw, ADDRS[0]: Watch(), ADDRS[1]: ws[1]}
    for w in ws:
        w.join(0.0)
    exchange(eps, 0.0)
    assert captured and ws[0].state is WorkerState.READY
    for _ in range(100):
        ws[0].receive_datagram(captured[0], SA, 1.0)
    assert ws[0].drops["unexpected_control"] == 100 and ws[0].state is WorkerState.READY
    assert ws[0].datagrams_to_send(1.0) == []
    xs = _inputs()
    outs = [np.empty_like(v) for v in xs]
    for w, v, o in zip(ws, xs, outs):
        w.start_allreduce(v, o, 2.0)
    exchange(eps, 2.0)
    np.testing.assert_allclose(outs[0], xs[0] + xs[1], rtol=1e-5, atol=1e-6)
    assert outs[0].tobytes() == outs[1].tobytes()


def test_join_proofs_are_the_documented_hmacs():
    """job key = HMAC-SHA256(secret, "switchml job key v1" | job u32 | token u64); JOIN proof
    = HMAC(key, "JOIN" | job u32 | token u64 | rank u16 | seq u32 | n | W | k (u32) |
    cookie); LEAVE proof = HMAC(key, "LEAVE" | job | token | rank | cookie); little-endian."""
    def mac(k, m):
        return hmac.new(k, m, hashlib.sha256).digest()

    key = mac(SECRET, b"switchml job key v1" + struct.pack("<IQ", 9, 0xABCDEF))
    assert auth.job_key(SECRET, 9, 0xABCDEF) == key
    assert auth.job_key(None, 9, 0xABCDEF) == mac(b"", b"switchml job key v1"
                                                  + struct.pack("<IQ", 9, 0xABCDEF))
    cookie = bytes(range(24))
    info = ControlInfo(4, 16, 358, quorum=3, quorum_min=2, deadline_us=5000, options=1)
    want = mac(key, b"JOIN" + struct.pack("<IQHIIIIIIII", 9, 0xABCDEF, 3, 65536, 4, 16, 358, 3,
                                          2, 5000, 1) + cookie)
    assert auth.join_proof(key, job=9, token=0xABCDEF, rank=3, seq=65536, info=info,
                           cookie=cookie) == want
    assert auth.leave_proof(key, job=9, token=0xABCDEF, rank=3, cookie=cookie) == mac(
        key, b"LEAVE" + struct.pack("<IQH", 9, 0xABCDEF, 3) + cookie)


def test_a_cookie_is_good_only_for_its_address_job_and_rank_and_only_for_a_while():
    c = auth.Challenges(5.0, key=bytes(32))
    cookie = c.issue(100.0, ("10.0.0.1", 4000), 9, 3)
    assert len(cookie) == 24 and auth.Challenges.issued_at(cookie) == pytest.approx(100.0)
    assert c.check(cookie, 104.9, ("10.0.0.1", 4000), 9, 3) is None
    assert c.check(cookie, 105.1, ("10.0.0.1", 4000), 9, 3) == "stale_cookie"
    assert c.check(cookie, 99.0, ("10.0.0.1", 4000), 9, 3) == "stale_cookie"  # from the future
    for addr, job, rank in ((("10.0.0.1", 4001), 9, 3), (("10.0.0.2", 4000), 9, 3),
                            (("10.0.0.1", 4000), 8, 3), (("10.0.0.1", 4000), 9, 2)):
        assert c.check(cookie, 101.0, addr, job, rank) == "bad_cookie"
    forged = bytearray(cookie)
    forged[0] ^= 1  # another issue time under the same MAC
    assert c.check(bytes(forged), 101.0, ("10.0.0.1", 4000), 9, 3) == "bad_cookie"
    other_switch = auth.Challenges(5.0, key=bytes(31) + b"\x01")
    assert other_switch.check(cookie, 101.0, ("10.0.0.1", 4000), 9, 3) == "bad_cookie"
    assert c.check(bytes(24), 101.0, ("10.0.0.1", 4000), 9, 3) == "bad_cookie"
    with pytest.raises(ValueError, match="lifetime_s must be > 0"):
        auth.Challenges(0)


def test_a_stale_challenge_answer_draws_a_fresh_challenge_and_the_worker_joins():
    """A worker whose proven JOIN arrives after the cookie's lifetime (a slow host) is
    challenged again, and joins on its next answer."""
    sw = SwitchDataplane(SwitchConfig(join_challenge_s=0.5))
    w = WorkerEndpoint(spec=SPEC, rank=0, switch_address=SA)
    w.join(0.0)
    (hello, _), = w.datagrams_to_send(0.0)
    sw.receive_datagram(bytes(hello), ADDRS[0], 0.0)
    (challenge, _), = sw.datagrams_to_send(0.0)
    w.receive_datagram(bytes(challenge), SA, 0.0)
    (proven, _), = w.datagrams_to_send(0.0)
    sw.receive_datagram(bytes(proven), ADDRS[0], 1.0)  # late
    (again, _), = sw.datagrams_to_send(1.0)
    assert unpack_header(bytes(again)).type is MessageType.CHALLENGE
    assert sw.drops == {"stale_cookie": 1}
    w.receive_datagram(bytes(again), SA, 1.0)
    exchange({SA: sw, ADDRS[0]: w}, 1.0)
    assert w.state is WorkerState.READY


def test_challenges_beyond_the_budget_are_dropped_and_counted_then_refill():
    # A token bucket of 10 a second: 50 cookie-less JOINs from 50 (spoofable) sources at one
    # instant draw 10 CHALLENGEs; half a second later 5 more; a second later 10, not 15.
    sw = SwitchDataplane(SwitchConfig(challenges_per_s=10))
    info = ControlInfo(2, 4, 8)

    def flood(now: float, count: int) -> int:
        for i in range(count):
            sw.receive_datagram(pack_join(job=7, token=9, rank=0, info=info), (f"v{i}", 1),
                                now=now)
        return sum(1 for d, _ in sw.datagrams_to_send(now) if d[3] == MessageType.CHALLENGE)

    assert flood(100.0, 50) == 10
    assert sw.stats()["drops"]["challenge_budget"] == 40
    assert flood(100.5, 50) == 5
    assert flood(102.0, 50) == 10  # (the bucket holds one second's worth)
    assert sw.stats()["challenges_sent"] == 25


def test_a_worker_turned_away_by_the_budget_joins_when_it_refills():
    # Every token spent by a flood: the worker's cookie-less JOIN is dropped; it asks again
    # after its retry interval, gets its CHALLENGE from the refilled bucket and joins.
    from switchml.transport.memory import MemoryCluster
    sw = SwitchDataplane(SwitchConfig(challenges_per_s=2))
    c = MemoryCluster(num_workers=1, window=4, switch=sw)
    for i in range(2):
        sw.receive_datagram(pack_join(job=7, token=9, rank=0, info=ControlInfo(1, 4, 8)),
                            (f"v{i}", 1), now=0.0)
    sw.datagrams_to_send(0.0)
    c.join()
    assert sw.stats()["drops"]["challenge_budget"] >= 1
    assert np.array_equal(c.allreduce([np.arange(5, dtype=np.int32)])[0], np.arange(5))
