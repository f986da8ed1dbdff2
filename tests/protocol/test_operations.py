"""Shared-switch operations: leases, keep-alives, switch restarts, rejoins, the secret."""

from __future__ import annotations

import numpy as np
import pytest

from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.dtypes import BFLOAT16
from switchml.protocol.errors import OperationFailed, SwitchMLError
from switchml.protocol.events import JobRemoved, OperationRestarted
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.worker import WorkerEndpoint, WorkerState
from switchml.transport.memory import FaultModel, MemoryCluster, MemoryFabric

SECRET = b"0123456789abcdef-secret"


def _inputs(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) for _ in range(n)]


def test_silent_job_loses_its_slots_after_the_lease():
    sw = SwitchDataplane(SwitchConfig(pool_slots=8, lease_timeout_s=3.0))
    c = MemoryCluster(num_workers=2, window=8, switch=sw,
                      worker_config=WorkerConfig(keepalive_s=1.0))
    c.join()
    assert sw.stats()["slots_in_use"] == 8
    # Idle but alive: keep-alives hold the lease far beyond its length.
    c.fabric.run(lambda: c.fabric.now > 20.0)
    assert sw.stats()["jobs"] == 1
    # Both workers die without LEAVE: the lease expires, the slots come back.
    for a in c.addresses:
        c.fabric.detach(a)
    c.fabric.run(lambda: sw.stats()["jobs"] == 0, max_time_s=40.0)
    assert sw.stats()["slots_in_use"] == 0
    assert 20.0 < c.fabric.now <= 24.0 + 1e-6  # last keep-alive + 3 s lease
    removed = [e for e in c.fabric.events[c.SWITCH] if isinstance(e, JobRemoved)]
    assert removed and "lease expired" in removed[0].reason
    # What the switch counted (its stats and metrics): two ranks joined, none left, one
    # job's lease expired.
    got = sw.stats()
    assert (got["members_joined"], got["members_left"], got["jobs_expired"]) == (2, 0, 1)
    # A new job fits in the freed pool.
    d = MemoryCluster(num_workers=1, window=8, job_id=99, fabric=c.fabric)
    assert np.array_equal(d.allreduce([np.arange(5, dtype=np.int32)])[0], np.arange(5))


@pytest.mark.parametrize("faults", [FaultModel(), FaultModel(loss_rate=0.05, reorder_rate=0.2)],
                         ids=["clean", "lossy"])
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16, np.int32], ids=str)
def test_switch_restart_mid_operation_is_retried_transparently(faults, dtype):
    n, size = 3, 20_000
    xs = [(x * 100).astype(dtype) for x in _inputs(n, size, seed=3)]
    clean = MemoryCluster(num_workers=n, window=4, elements_per_packet=512)
    expected = clean.allreduce(xs)[0]
    c = MemoryCluster(num_workers=n, window=4, elements_per_packet=512, faults=faults, seed=7)
    # The job has history (seq 1 comes next, sets have alternated), and an in-place operation
    # of other inputs left its copy in the buffer each worker keeps for restarts.
    first = [(-2 * x).astype(dtype) for x in xs]
    c.wait(c.start(first, first))
    assert np.array_equal(first[0], -2 * expected)
    outs = [x.copy() for x in xs]  # in place: the restart must use the input, not partial sums
    base = c.switch.stats()["results_multicast"]
    handles = c.start(outs, outs)
    first_seq = handles[0].seq
    # Well into the operation: results of many blocks have landed in every rank's input.
    c.fabric.run(lambda: c.switch.stats()["results_multicast"] > base + 25)
    # The switch crashes and comes back empty at the same address; datagrams already on
    # their way (old epoch) reach the new one.
    c.fabric.detach(c.SWITCH)
    c.switch = SwitchDataplane()
    c.fabric.attach(c.SWITCH, c.switch)
    restarted = {}
    for r, a in enumerate(c.addresses):
        c.fabric.run(lambda a=a: any(isinstance(e, OperationRestarted)
                                     for e in c.fabric.events[a]), max_time_s=120)
        restarted[r] = [e for e in c.fabric.events[a] if isinstance(e, OperationRestarted)]
    new_seqs = [restarted[r][-1].new_seq for r in range(n)]
    assert len(set(new_seqs)) == 1 and new_seqs[0] > first_seq
    c.wait(handles)  # the handles follow their operation to its new sequence number
    assert [h.seq for h in handles] == new_seqs
    for o in outs:
        assert np.array_equal(o, expected)
    # The job goes on: the next operation is exact too.
    again = c.allreduce(xs)
    assert np.array_equal(again[0], expected)


def test_idle_workers_rejoin_a_restarted_switch():
    n = 2
    xs = _inputs(n, 3000, seed=4)
    c = MemoryCluster(num_workers=n, window=4, elements_per_packet=256,
                      worker_config=WorkerConfig(keepalive_s=0.5))
    expected = c.allreduce(xs)[0]
    c.fabric.detach(c.SWITCH)
    c.switch = SwitchDataplane()
    c.fabric.attach(c.SWITCH, c.switch)
    # Keep-alives meet UNKNOWN_JOB; the workers join again and the next operation just works.
    c.fabric.run(lambda: c.switch.stats()["jobs"] == 1, max_time_s=10)
    c.fabric.run(lambda: all(w.state is WorkerState.READY for w in c.workers), max_time_s=20)
    assert np.array_equal(c.allreduce(xs)[0], expected)


def test_restarts_are_bounded():
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=64,
                      worker_config=WorkerConfig(max_restarts=1, op_timeout_s=5.0,
                                                 join_timeout_s=2.0))
    c.join()
    handles = c.start(_inputs(2, 10_000, 1))
    failed = lambda: all(w.state is WorkerState.ERROR for w in c.workers)  # noqa: E731
    crashes = 0
    while not failed():  # the switch keeps losing the job
        c.fabric.run(lambda: c.switch.stats()["results_multicast"] > 3 or failed(),
                     max_time_s=60)
        c.fabric.detach(c.SWITCH)
        c.switch = SwitchDataplane()
        c.fabric.attach(c.SWITCH, c.switch)
        crashes += 1
        c.fabric.run(lambda: c.switch.stats()["jobs"] or failed(), max_time_s=60)
    assert crashes == 2
    with pytest.raises(OperationFailed, match="lost the job 2 times"):
        c.wait(handles)
    assert [h.seq for h in handles] == [2**16] * 2  # reported for the restarted operation


def test_restarted_worker_cannot_rejoin_a_running_job():
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=64)
    c.allreduce(_inputs(2, 100, 1))
    # Rank 1 restarts as a new process (new address) with the same spec.
    w = WorkerEndpoint(spec=c.spec, rank=1, switch_address=c.SWITCH)
    c.fabric.attach(("restarted", 1), w)
    w.join(c.fabric.now)
    c.fabric.flush(("restarted", 1))
    c.fabric.run(lambda: w.state is not WorkerState.JOINING)
    assert w.state is WorkerState.ERROR
    assert "is joined from" in w.error and "start a new job" in w.error


def test_peers_of_a_dead_rank_fail_within_the_member_timeout_naming_it():
    """Rank 2 dies between operations (no LEAVE). Its peers' next operation fails once the
    switch has heard nothing from it for member_timeout_s (it tells them in WAITING), long
    before their own op_timeout_s, and the error names rank 2."""
    cfg = WorkerConfig(op_timeout_s=600.0)
    c = MemoryCluster(num_workers=3, window=2, elements_per_packet=64,
                      switch=SwitchDataplane(SwitchConfig(member_timeout_s=4.0)),
                      worker_config=cfg)
    c.allreduce(_inputs(3, 1000, 1))
    c.fabric.detach(c.addresses[2])
    died = c.fabric.now
    handles = [c.sessions[r].submit(np.ones(1000, np.float32), now=c.fabric.now)
               for r in range(2)]
    for a in c.addresses[:2]:
        c.fabric.flush(a)
    c.fabric.run(lambda: all(w.state is WorkerState.ERROR for w in c.workers[:2]),
                 max_time_s=60)
    assert 4.0 <= c.fabric.now - died <= 4.0 + 2.5  # the member timeout, plus a backed-off RTO
    for w, h in zip(c.workers[:2], handles):
        assert "rank(s) [2]" in w.error and "heard nothing from" in w.error, w.error
        assert h.done() and isinstance(h.exception(), OperationFailed)


def test_a_dead_switch_fails_operations_as_unreachable_and_a_dead_rank_does_not():
    """What a caller (the torch backend's failover) must tell apart: a switch that stopped
    answering raises ``SwitchUnreachable``, also after it had named a rank it waited for
    (it then stops answering the re-sends); a live switch naming a silent rank raises a plain
    ``OperationFailed``."""
    from switchml.protocol.errors import SwitchUnreachable
    cfg = WorkerConfig(op_timeout_s=4.0, max_rto_s=0.5)
    for case in ("switch dies", "rank silent", "switch dies after naming a rank"):
        c = MemoryCluster(num_workers=3, window=2, elements_per_packet=64, worker_config=cfg)
        c.allreduce(_inputs(3, 1000, 1))
        ranks = range(3) if case == "switch dies" else range(2)
        handles = [c.sessions[r].submit(np.ones(1000, np.float32), now=c.fabric.now)
                   for r in ranks]
        if case == "switch dies":
            c.fabric.detach(c.SWITCH)
        for r in ranks:
            c.fabric.flush(c.addresses[r])
        if case == "switch dies after naming a rank":
            c.fabric.run(lambda c=c: c.fabric.now > 2.0 and c.workers[0].progress(
                c.fabric.now) is not None)
            assert "answers, but rank(s) [2]" in c.workers[0].progress(c.fabric.now)
            c.fabric.detach(c.SWITCH)
        c.fabric.run(lambda c=c, ranks=ranks: all(c.workers[r].state is WorkerState.ERROR
                                                  for r in ranks), max_time_s=30)
        for h in handles:
            err = h.exception()
            assert isinstance(err, OperationFailed), (case, err)
            if case == "rank silent":
                assert not isinstance(err, SwitchUnreachable), err
                assert "answers, but rank(s) [2]" in str(err), err
            else:
                assert isinstance(err, SwitchUnreachable), (case, err)
                assert "no answer from the switch" in str(err), err
                if case != "switch dies":
                    assert "it last said it waited for rank(s) [2]" in str(err), err


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_a_failed_in_place_operation_leaves_its_input_as_it_was(dtype):
    """The switch dies with part of an in-place all-reduce's results written over its input:
    the failure puts the input back (from the copy kept for restarts), so a caller can run
    the same operation another way (the torch backend's failover sums it over gloo)."""
    cfg = WorkerConfig(op_timeout_s=2.0, max_rto_s=0.5)
    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=64, worker_config=cfg)
    c.allreduce([np.ones(100, dtype) for _ in range(3)])
    rng = np.random.default_rng(5)
    inputs = [(rng.standard_normal(20_000) * 100).astype(dtype) for _ in range(3)]
    xs = [x.copy() for x in inputs]
    handles = [c.sessions[r].submit(xs[r], xs[r], now=c.fabric.now) for r in range(3)]
    for a in c.addresses:
        c.fabric.flush(a)
    # until about half of rank 0's blocks hold sums
    c.fabric.run(lambda: (xs[0] != inputs[0]).mean() > 0.4)
    assert not handles[0].done()
    c.fabric.detach(c.SWITCH)
    c.fabric.run(lambda: all(h.done() for h in handles), max_time_s=30)
    for r in range(3):
        assert isinstance(handles[r].exception(), OperationFailed)
        assert np.array_equal(xs[r], inputs[r]), r


def test_rejoin_from_a_new_address_before_any_operation_is_allowed():
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=64)
    c.join()
    w = c.restart_worker(1, ("restarted", 1))
    c.fabric.run(lambda: w.state is WorkerState.READY)
    xs = _inputs(2, 1000, 2)
    out = c.allreduce(xs)
    assert np.allclose(out[0], xs[0] + xs[1], atol=1e-5)


def test_creating_or_joining_a_job_needs_the_switch_secret_not_just_the_token():
    fabric = MemoryFabric()
    sw = SwitchDataplane(SwitchConfig(secret=SECRET))
    # The switch's REFUSED is sealed under the key of its secret, which these workers cannot
    # verify: they go on asking until their JOIN times out, then quote it.
    with pytest.raises(SwitchMLError, match="within 10 s; a REFUSED that does not verify .* "
                       "proof does not verify: the worker's secret"):
        MemoryCluster(num_workers=2, switch=sw, fabric=fabric).join()
    assert sw.stats()["jobs"] == 0 and sw.drops["bad_proof"] >= 2
    wrong = WorkerConfig(secret=b"not the secret, 16+ bytes")
    with pytest.raises(SwitchMLError, match="proof does not verify"):
        MemoryCluster(num_workers=1, switch=sw, fabric=fabric, job_id=8,
                      worker_config=wrong).join()
    good = MemoryCluster(num_workers=2, switch=sw, fabric=fabric, job_id=9,
                         worker_config=WorkerConfig(secret=SECRET))
    xs = [np.arange(4, dtype=np.int32)] * 2
    assert np.array_equal(good.allreduce(xs)[0], 2 * np.arange(4))
    # Someone who knows the running job's id and token (both travel in every datagram) but
    # not the secret cannot join it, not even in place of a rank that has not joined yet.
    half = MemoryCluster(num_workers=2, switch=sw, fabric=fabric, job_id=10,
                         worker_config=WorkerConfig(secret=SECRET))
    half.sessions[0].join(fabric.now)
    fabric.flush(half.addresses[0])
    fabric.run(lambda: half.workers[0].state is WorkerState.READY)
    before = sw.drops["bad_proof"]
    thief = WorkerEndpoint(spec=half.spec, rank=1, switch_address=MemoryCluster.SWITCH)
    fabric.attach(("thief", 1), thief)
    thief.join(fabric.now)
    fabric.flush(("thief", 1))
    fabric.run(lambda: thief.state is not WorkerState.JOINING)
    assert thief.state is WorkerState.ERROR and "proof does not verify" in thief.error
    assert sw.drops["bad_proof"] > before and half.switch.stats()["jobs"] == 2
    # Rank 1 can still join, from its own address, with the secret.
    half.sessions[1].join(fabric.now)
    fabric.flush(half.addresses[1])
    fabric.run(lambda: half.workers[1].state is WorkerState.READY)


def test_an_open_switch_refuses_a_worker_that_brings_a_secret():
    c = MemoryCluster(num_workers=1, worker_config=WorkerConfig(secret=SECRET))
    with pytest.raises(SwitchMLError, match="this switch has no secret"):
        c.join()


def test_secret_must_be_long_enough():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SwitchConfig(secret=b"short")


def test_worker_restart_events_name_the_new_sequence_number():
    spec = JobSpec(job_id=1, token=2, num_workers=1, window=2, elements_per_packet=8)
    c = MemoryCluster(num_workers=1, window=2, elements_per_packet=8, job_id=1, token=2)
    assert c.spec == spec
    c.allreduce([np.ones(100, np.float32)])
    (h,) = c.start([np.ones(100, np.float32)])
    seq = h.seq
    c.fabric.detach(c.SWITCH)
    c.switch = SwitchDataplane()
    c.fabric.attach(c.SWITCH, c.switch)
    c.fabric.run(lambda: any(isinstance(e, OperationRestarted)
                             for e in c.fabric.events[c.addresses[0]]), max_time_s=60)
    (ev,) = [e for e in c.fabric.events[c.addresses[0]] if isinstance(e, OperationRestarted)]
    assert ev.seq == seq and ev.new_seq == seq + 2**16
    c.wait([h])
    assert h.seq == ev.new_seq
    assert c.workers[0].counters["operations_restarted"] == 1


@pytest.mark.parametrize("down_s", [0.0, 0.05, 0.5])
def test_ranks_that_notice_a_restart_late_still_catch_up(down_s):
    """One rank retransmits much later than the others (a slow path): it finds the job already
    re-created by the others and must be told to join the new epoch, not silently dropped."""
    n = 3
    xs = _inputs(n, 20_000, seed=0)
    expected = MemoryCluster(num_workers=n, window=4, elements_per_packet=512).allreduce(xs)[0]
    slow = WorkerConfig(min_rto_s=0.3, initial_rto_s=0.3, op_timeout_s=5)
    c = MemoryCluster(num_workers=n, window=4, elements_per_packet=512,
                      worker_config=[WorkerConfig(op_timeout_s=5)] * (n - 1) + [slow])
    c.allreduce(xs)
    outs = [np.empty_like(x) for x in xs]
    c.start(xs, outs)
    c.fabric.run(lambda: c.switch.stats()["results_multicast"] > 25)
    c.fabric.detach(c.SWITCH)
    if down_s:
        t = c.fabric.now
        c.fabric.run(lambda: c.fabric.now > t + down_s)
    c.switch = SwitchDataplane()
    c.fabric.attach(c.SWITCH, c.switch)
    c.fabric.run(lambda: all(w.state is WorkerState.READY for w in c.workers), max_time_s=60)
    for o in outs:
        assert np.array_equal(o, expected)
    assert all(w.counters["operations_restarted"] == 1 for w in c.workers)
