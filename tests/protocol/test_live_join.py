"""A rank joins a running quorum job: a replacement for one that died takes its place on the
switch, resumes from a live rank's position, and contributes from its next operation
(docs/protocol.md section 7, "Joining a running job"). Sums are checked against one-hot
inputs: rank r adds 2**r, so every element says which ranks it holds."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.endpoint import exchange
from switchml.protocol.errors import LocalProtocolError
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.worker import WorkerEndpoint
from switchml.protocol.worker_ahead import Position
from switchml.transport.memory import MemoryCluster

SW = ("127.0.0.1", 2)


def _one_hot(n: int, size: int, ranks) -> list[np.ndarray]:
    return [np.full(size, 1 << r, np.int32) for r in ranks]


def _running_job(quorum: int | None):
    """A switch with a 3-rank job whose ranks have sent their first requests (so it runs),
    and those requests."""
    spec = JobSpec(job_id=9, token=0x0BAD_F00D_1234, num_workers=3, window=4,
                   elements_per_packet=16, quorum=quorum)
    sw = SwitchDataplane()
    requests = []
    for r in range(3):
        w = WorkerEndpoint(spec=spec, rank=r, switch_address=SW)
        w.join(0.0)
        exchange({("127.0.0.1", 10 + r): w, SW: sw}, 0.0)
        x = np.full(3, 1 << r, np.int32)
        w.start_allreduce(x, np.empty_like(x), 0.0)
        (d, _), = w.datagrams_to_send(0.0)
        requests.append(bytes(d))
    for r, d in enumerate(requests[:2]):
        sw.receive_datagram(d, ("127.0.0.1", 10 + r), 0.5)
    sw.datagrams_to_send(0.5)
    return spec, sw, requests


def _join_from(spec, sw, rank, addr, *, late):
    """A new endpoint for ``rank`` at ``addr`` joins (JOIN, challenge, JOIN, JOINED)."""
    w = WorkerEndpoint(spec=spec, rank=rank, switch_address=SW)
    w.join(1.0, late=late)
    exchange({addr: w, SW: sw}, 1.0)
    return w


def test_a_replacement_takes_a_running_quorum_jobs_rank_and_the_old_address_is_dropped():
    spec, sw, req = _running_job(quorum=2)
    new = ("127.0.0.1", 99)
    w = _join_from(spec, sw, 2, new, late=True)
    assert w.state.value == "ready"  # JOINED: the switch took it
    st = sw.stats()
    assert st["members_replaced"] == 1 and st["members_joined"] == 4
    # The dead rank's address is no longer the member's: its request is dropped, unanswered.
    sw.receive_datagram(req[2], ("127.0.0.1", 12), 2.0)
    assert sw.datagrams_to_send(2.0) == []
    assert sw.drops["wrong_source"] == 1


def test_without_a_quorum_a_replacement_is_refused_naming_the_remedy():
    spec, sw, _ = _running_job(quorum=None)
    with pytest.raises(LocalProtocolError, match="no quorum"):
        WorkerEndpoint(spec=spec, rank=2, switch_address=SW).join(1.0, late=True)
    w = _join_from(spec, sw, 2, ("127.0.0.1", 99), late=False)
    assert w.state.value == "error" and "give the job a quorum" in w.error
    assert sw.stats()["members_replaced"] == 0


def test_a_position_round_trips_and_bad_bytes_say_what_is_wrong():
    p = Position((7, 2**32 - 1), (bytes([0, 1, 1]), bytes([1] * 16)))
    assert Position.from_bytes(p.to_bytes()) == p
    assert Position.of_parts([p.part(0), p.part(1)]) == p
    for bad, why in [(b"XXXX", "magic"), (p.to_bytes()[:-1], "truncated"),
                     (p.to_bytes()[:9], "truncated"), (b"SMP1", "at least one part"),
                     (b"SMP1" + bytes([1, 0, 0, 0, 1, 0, 0, 0, 2]), "0 or 1")]:
        with pytest.raises(ValueError, match=why):
            Position.from_bytes(bad)


def _after(fabric, t):
    return fabric.now > t


def _cluster():
    return MemoryCluster(num_workers=4, window=4, elements_per_packet=8, quorum=3, seed=5,
                         switch=SwitchDataplane(SwitchConfig(member_timeout_s=0.5)),
                         worker_config=WorkerConfig(initial_rto_s=0.05, max_rto_s=0.2,
                                                    op_timeout_s=5.0))


def _run(c, size, ranks, first=()):
    """One all-reduce of one-hot inputs on ``ranks`` (``first`` start 5 ms before the
    rest); returns each rank's result."""
    xs = dict(zip(ranks, _one_hot(4, size, ranks)))
    hs = {r: h for r, h in zip(first, c.start([xs[r] for r in first], ranks=list(first)))}
    if first:
        c.fabric.run(functools.partial(_after, c.fabric, c.fabric.now + 0.005))
    rest = [r for r in ranks if r not in first]
    hs.update(zip(rest, c.start([xs[r] for r in rest], ranks=rest)))
    c.wait(list(hs.values()))
    return {r: xs[r] for r in ranks}


def test_a_replacement_resumes_from_a_live_rank_and_contributes_from_its_next_operation():
    """Rank 3 of 4 (quorum 3) dies after 1,030 operations (most of them empty: the job's
    sequence numbers are then far from a new rank's 0). The other three go on. A new rank 3
    joins late from a new address; a live rank's position is taken at once, and the three run
    one more operation (5 chunks on 4 lanes: the lanes' sets now differ) while the new rank
    loads its state. It resumes from the position: that operation completes from the results
    it was multicast, the same sum as the others', and in the next one, started first, its
    data is in the sums every rank gets."""
    c = _cluster()
    for _ in range(1030):
        c.wait(c.start([np.empty(0, np.int32)] * 4))
    _run(c, 100, range(4))
    c.fabric.detach(c.addresses[3])  # rank 3 is gone
    c.fabric.run(functools.partial(_after, c.fabric, c.fabric.now + 1.0))
    for size in (37, 64):
        out = _run(c, size, [0, 1, 2])
        assert all((v == 7).all() for v in out.values())  # ranks 0, 1, 2 (quorum 3)
    w = c.restart_worker(3, ("replacement", 1), late=True)
    c.fabric.run(lambda: c.sessions[3].joined or c.sessions[3].error is not None)
    assert c.sessions[3].joined, c.sessions[3].error
    with pytest.raises(LocalProtocolError, match="resume"):
        w.start_allreduce(np.zeros(4, np.int32), np.zeros(4, np.int32), c.fabric.now)
    pos = Position.from_bytes(c.workers[0].position().to_bytes())  # (as it would travel)
    out = _run(c, 37, [0, 1, 2])  # meanwhile: the new rank keeps what it is sent
    assert all((v == 7).all() for v in out.values())
    w.resume(pos)
    caught_up = _run(c, 37, [3])[3]  # that same operation, from the kept results
    assert np.array_equal(caught_up, out[0])
    # (the results it was sent, 4 of 5 by the time it started: none asked for again)
    assert w.counters["results_taken_ahead"] >= 4 and w.counters["retransmissions"] == 0
    got = _run(c, 64, range(4), first=[3, 0, 1])
    assert all(np.array_equal(v, got[0]) for v in got.values())
    assert (got[0] & 8).all() and (got[0] == 0b1011).any()  # rank 3's data in every chunk
    assert c.switch.stats()["members_replaced"] == 1


def _replaced_with_a_budget(keep_bytes):
    """The cluster after one operation, rank 3 dead and replaced by a rank that joined late
    with a keep budget of ``keep_bytes``; (cluster, the replacement's endpoint)."""
    import dataclasses
    c = _cluster()
    _run(c, 100, range(4))
    c.fabric.detach(c.addresses[3])
    c.fabric.run(functools.partial(_after, c.fabric, c.fabric.now + 1.0))
    c.workers[3].config = dataclasses.replace(c.workers[3].config,
                                              quorum_keep_bytes=keep_bytes)
    w = c.restart_worker(3, ("replacement", 1), late=True)
    c.fabric.run(lambda: c.sessions[3].joined or c.sessions[3].error is not None)
    assert c.sessions[3].joined, c.sessions[3].error
    return c, w


def test_a_late_rank_over_its_keep_budget_drops_the_oldest_operations_not_the_newest():
    """A replacement whose keep budget holds about two operations' results (800 bytes) is
    sent five while it loads its state; the live rank's position is taken before the fifth.
    It makes room by dropping the oldest operations (it will skip them), so after resuming it
    completes the fifth from the results it kept, with no re-send (keeping the first ones and
    dropping the later, the fifth's results would be gone, asked for again from the switch)."""
    c, w = _replaced_with_a_budget(800)
    for _ in range(4):
        _run(c, 37, [0, 1, 2])
    pos = c.workers[0].position()
    out = _run(c, 37, [0, 1, 2])
    assert w.drops["ahead_evicted"] > 0 and not w.drops["ahead_dropped"], w.drops
    w.resume(pos)
    caught_up = _run(c, 37, [3])[3]
    assert np.array_equal(caught_up, out[0])
    assert w.counters["results_taken_ahead"] >= 4 and w.counters["retransmissions"] == 0


def test_a_pinned_position_keeps_its_operations_while_the_state_is_on_its_way():
    """The position arrives first (``pin``), the state a while later: the operations the
    others run meanwhile must not evict the position's own. With a budget of about two
    operations, four more after the position: the position's operation is kept (new results
    are dropped instead), and it completes from what was kept, with no re-send; without the
    pin, the oldest, the position's, would have been evicted first."""
    c, w = _replaced_with_a_budget(800)
    _run(c, 37, [0, 1, 2])  # (before the position: dropped at the pin)
    pos = c.workers[0].position()
    w.pin(pos)
    out = _run(c, 37, [0, 1, 2])  # the position's operation
    for _ in range(3):  # the others go on while the state travels
        _run(c, 37, [0, 1, 2])
    assert w.drops["ahead_dropped"] > 0 and not w.drops.get("ahead_evicted"), w.drops
    w.resume(pos)
    caught_up = _run(c, 37, [3])[3]
    assert np.array_equal(caught_up, out[0])
    assert w.counters["retransmissions"] == 0
    with pytest.raises(LocalProtocolError, match="pin is for"):
        w.pin(pos)  # (resumed: no position to wait for)


def test_resume_is_for_a_rank_that_joined_late_once_with_the_jobs_geometry():
    c = _cluster()
    c.wait(c.start(_one_hot(4, 37, range(4))))
    pos = c.workers[0].position()
    with pytest.raises(LocalProtocolError, match="joined a running quorum job"):
        c.workers[1].resume(pos)  # it never joined late
    c.fabric.detach(c.addresses[3])
    w = c.restart_worker(3, ("replacement", 1), late=True)
    with pytest.raises(LocalProtocolError, match="joined and idle|joined, idle"):
        w.resume(pos)  # not joined yet
    c.fabric.run(lambda: c.sessions[3].joined)
    with pytest.raises(LocalProtocolError, match="no position yet"):
        w.position()
    with pytest.raises(LocalProtocolError, match="2 parts"):
        w.resume(Position.of_parts([pos, pos]))
    with pytest.raises(LocalProtocolError, match="3 lanes"):
        w.resume(Position(pos.seqs, (bytes(3),)))
    w.resume(pos)
    assert w.position() == pos
    with pytest.raises(LocalProtocolError, match="once"):
        w.resume(pos)
    got = _run(c, 37, range(4))
    assert all(np.array_equal(v, got[0]) for v in got.values())
    hs = c.start(_one_hot(4, 37, range(4)))
    with pytest.raises(LocalProtocolError, match="between operations"):
        c.workers[0].position()
    c.wait(hs)


def test_a_straggler_catches_up_from_a_live_ranks_position_skipping_what_it_missed():
    """Rank 3 of 4 (quorum 3) is behind by three operations (it kept their results); it
    falls back to rank 0's position: its next operation is the others' next, the three it
    missed are skipped (their kept results dropped), and it ends that one with the sum."""
    c = _cluster()
    _run(c, 37, range(4))
    for _ in range(3):
        _run(c, 37, [0, 1, 2])
    w = c.workers[3]
    assert w.ops_behind == 3 and c.workers[0].ops_behind == 0
    with pytest.raises(LocalProtocolError, match="once, before its next"):
        w.resume(c.workers[0].position())  # not catching up
    w.catch_up()
    w.resume(c.workers[0].position())
    assert w.ops_behind == 0 and w.counters["resumed"] == 1
    got = _run(c, 37, range(4), first=[3, 0, 1])
    assert all(np.array_equal(v, got[0]) for v in got.values()) and (got[0] & 8).all()
    no_quorum = MemoryCluster(num_workers=2, window=4, elements_per_packet=8)
    no_quorum.wait(no_quorum.start(_one_hot(2, 8, range(2))))
    with pytest.raises(LocalProtocolError, match="quorum"):
        no_quorum.workers[0].catch_up()


def _join_capturing(w, addr, sw, now):
    """``w`` joins through ``sw`` by hand; returns the datagrams it sent (its proven JOIN
    last)."""
    w.join(now)
    sent = []
    for _ in range(10):
        out = [bytes(d) for d, _ in w.datagrams_to_send(now)]
        for d in out:
            sent.append(d)
            sw.receive_datagram(d, addr, now)
        for d, a in sw.datagrams_to_send(now):
            if a == addr:
                w.receive_datagram(d, SW, now)
        if not out:
            break
    return sent


def test_the_replaced_processs_join_replayed_does_not_take_the_rank_back():
    """Rank 1's proven JOIN, captured, is replayed from its old address after a replacement
    took the rank (within the cookie's lifetime): the cookie predates the replacement's, so
    it is spent; the rank stays the replacement's."""
    spec = JobSpec(job_id=9, token=0x0BAD_F00D_1234, num_workers=2, window=4,
                   elements_per_packet=16, quorum=1)
    sw = SwitchDataplane()
    old = ("127.0.0.1", 11)
    joins = {r: _join_capturing(WorkerEndpoint(spec=spec, rank=r, switch_address=SW),
                                ("127.0.0.1", 10 + r), sw, 0.0) for r in range(2)}
    sw.receive_datagram(bytes(_request(spec, 0)), ("127.0.0.1", 10), 0.5)  # the job runs
    sw.datagrams_to_send(0.5)
    assert sw.stats()["members_joined"] == 2
    new = WorkerEndpoint(spec=spec, rank=1, switch_address=SW)
    _join_capturing(new, ("127.0.0.1", 99), sw, 1.0)
    assert new.state.value == "ready" and sw.stats()["members_replaced"] == 1
    sw.receive_datagram(joins[1][-1], old, 1.5)  # the old process's proven JOIN, again
    assert not any(a == old for _, a in sw.datagrams_to_send(1.5))
    assert sw.drops["spent_cookie"] == 1 and sw.stats()["members_replaced"] == 1


def _request(spec, rank):
    w = WorkerEndpoint(spec=spec, rank=rank, switch_address=SW)
    sw = SwitchDataplane()
    exchange({("127.0.0.1", 50): w, SW: sw}, 0.0)  # (a throwaway switch: just the bytes)
    w.join(0.0)
    exchange({("127.0.0.1", 50): w, SW: sw}, 0.0)
    x = np.ones(3, np.int32)
    w.start_allreduce(x, np.empty_like(x), 0.0)
    (d, _), = w.datagrams_to_send(0.0)
    return d
