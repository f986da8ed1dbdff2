"""The switch's compiled data plane (``switchml._switch``, from ``src/switchml/csrc/switch.c``)
against its plain-Python reference (``protocol/kernels/aggregate.py``, ``relay.py``), rule for
rule.

* The request kernel on crafted batches: real REQUESTs of a job's ranks, then copies with
  flipped bits, cut short, of another job or rank, re-sent, out of order: every array of the
  job's state, the counters, completions, replies and what it returns, equal after each call.
* Whole jobs over the in-memory fabric with loss, duplication and reordering, once on the
  compiled kernels and once on the reference (the same seed): the same results, counters and
  every data datagram on the fabric, byte for byte; the same for a two-level tree (a rack
  switch's relay) under loss.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from switchml import _switch as C
from switchml.protocol import kernels as K
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.endpoint import exchange
from switchml.protocol.kernels import aggregate, nacks, relay, runs
from switchml.protocol.slots import action_table
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import MessageType
from switchml.protocol.worker import WorkerEndpoint
from switchml.sim.cluster import TreeCluster
from switchml.transport.memory import FaultModel, MemoryCluster, MemoryFabric

REFERENCE = {
    "switch_requests": aggregate.switch_requests, "plan_result_runs": runs.plan_result_runs,
    "log_releases": nacks.log_releases, "request_framing": K.frames.request_framing,
    "relay_up": relay.relay_up, "relay_down": relay.relay_down,
    "relay_next_due": relay.relay_next_due, "relay_due": relay.relay_due,
}
DATA_TYPES = {int(t) for t in (MessageType.REQUEST, MessageType.RESULT, MessageType.WAITING,
                                MessageType.NACK)}


def test_every_switch_kernel_the_package_exports_is_the_compiled_one():
    for name in REFERENCE:
        assert getattr(K, name) is getattr(C, name), name


# -- the request kernel on crafted batches ---------------------------------------------------

def _job_and_requests(n: int, dtype, bits: int, seed: int, quorum: int | None = None):
    """A switch with a job of ``n`` joined ranks, and every rank's first window of requests of
    one operation (crafted by real workers)."""
    spec = JobSpec(job_id=9, token=0x0BAD_F00D_1234, num_workers=n, window=4,
                   elements_per_packet=16, quorum=quorum)
    sw, sw_addr = SwitchDataplane(), ("127.0.0.1", 2)
    rng = np.random.default_rng(seed)
    requests = []
    for r in range(n):
        w = WorkerEndpoint(spec=spec, rank=r, switch_address=sw_addr)
        w.join(0.0)
        exchange({("127.0.0.1", 10 + r): w, sw_addr: sw}, 0.0)
        x = (rng.standard_normal(100) * 4).astype(dtype)
        w.start_allreduce(x, np.empty_like(x), 0.0, bits=bits)
        requests += [(bytes(d), r) for d, _ in w.datagrams_to_send(0.0)]
    job = next(iter(sw._jobs.values()))
    return sw, job, requests


def _mutate(reqs, rng):
    out = []
    for d, r in reqs:
        b = bytearray(d)
        kind = int(rng.integers(0, 9))
        if kind == 0:
            b[int(rng.integers(0, len(b)))] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            b = b[:int(rng.integers(0, len(b)))]
        elif kind == 2:
            b[6] = (b[6] + 1) % 4  # another rank's number on this rank's datagram
        elif kind == 5:
            r = (r + 1) % 3  # from another rank's address
        elif kind == 3:
            b[4] |= 0x08  # RESENT
        elif kind == 4:
            b[36] = (b[36] + 1) & 0xFF  # another exponent: a mismatch
        elif kind == 6:
            b[4] |= 0x20  # RETRY: a quorum job's re-send (a late one is answered)
        out.append((bytes(b), r))
    return out


def _arrays(sw, job):
    return [job.jobv, job.st, job.seen, job.conflict, job.bufs, job.clog, job.cursor, job.mkeys,
            job.heard]


@pytest.mark.parametrize("kind", [(np.float32, 32), (np.int32, 32), (np.float32, 16)],
                         ids=["float32", "int32", "float32/16"])
@pytest.mark.parametrize("quorum", [None, 2], ids=["all", "quorum2"])
@pytest.mark.parametrize("seed", range(4))
def test_request_kernel_matches_the_reference_on_hostile_batches(kind, seed, quorum):
    dtype, bits = kind
    n = 3
    sw, job, reqs = _job_and_requests(n, dtype, bits, seed, quorum)
    rng = np.random.default_rng(50 + seed)
    rules = action_table()
    job.mkeys[:] = 100 + np.arange(n)  # each rank's sender number, as the switch checked it
    mine = [a.copy() for a in _arrays(sw, job)]
    ref = [a.copy() for a in _arrays(sw, job)]
    shared = []
    for _ in range(2):
        shared.append([np.zeros(K.SC.N, np.int64), np.zeros((K.MAX_BATCH, 3), np.int64),
                       np.zeros((K.REPLIES_PER_CALL, job.reply_bytes), np.uint8),
                       np.zeros((K.REPLIES_PER_CALL, 2), np.int64)])
    order = list(reqs)
    rng.shuffle(order)
    # (re-sent as a quorum job's worker re-sends: RETRY)
    retried = [(d[:4] + bytes([d[4] | 0x20]) + d[5:], r) for d, r in reqs]
    batches = [reqs, _mutate(reqs, rng), order + reqs, _mutate(order, rng), reqs[::-1],
               retried]
    now = 1.0
    for batch in batches:
        datagrams = [d for d, _ in batch]
        buf = np.frombuffer(b"".join(datagrams), np.uint8).copy()
        lens = np.array([len(d) for d in datagrams], np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        srcs = np.array([job.mkeys[r] for _, r in batch], np.int64)
        i = 0
        while i < len(datagrams):
            got = C.switch_requests(buf, starts, lens, srcs, len(datagrams), i, now, *mine,
                                    rules, *shared[0])
            want = aggregate.switch_requests(buf, starts, lens, srcs, len(datagrams), i, now,
                                             *ref, rules, *shared[1])
            assert tuple(got) == tuple(want)
            for name, a, b in zip(("jobv", "st", "seen", "conflict", "bufs", "clog", "cursor",
                                   "mkeys", "heard"), mine, ref):
                assert a.tobytes() == b.tobytes(), name
            nxt, ndone, nreply, code = got
            a, b = shared
            assert a[0].tobytes() == b[0].tobytes()  # counters
            assert a[1][:ndone].tobytes() == b[1][:ndone].tobytes()  # completions
            for k in range(nreply):
                assert tuple(a[3][k]) == tuple(b[3][k])
                assert a[2][k, :a[3][k, 1]].tobytes() == b[2][k, :b[3][k, 1]].tobytes()
            i = nxt if code in (K.SS.DONE, K.SS.REPLIES_FULL, K.SS.CONFLICT_ADDED) else nxt + 1
        now += 0.01
    counters = shared[0][0]
    assert counters[K.SC.MULTICAST] > 0 and counters.sum() > counters[K.SC.MULTICAST]
    assert (counters[K.SC.LATE_ANSWERED] > 0) == (quorum is not None)


@pytest.mark.parametrize("seed", range(4))
def test_plan_result_runs_matches_the_reference(seed):
    rng = np.random.default_rng(seed)
    n, stride = int(rng.integers(0, 80)), 200
    pend = np.stack([rng.integers(0, 2, n), rng.integers(0, 16, n),
                     np.where(rng.random(n) < 0.8, stride, rng.integers(41, stride, n))],
                    axis=1).astype(np.int64).reshape(n, 3)
    a, b = np.zeros((n, 4), np.int64), np.zeros((n, 4), np.int64)
    na = C.plan_result_runs(pend, n, stride, 8, 1200, a)
    nb = runs.plan_result_runs(pend, n, stride, 8, 1200, b)
    assert na == nb and np.array_equal(a[:na], b[:nb])


def test_wrong_job_arrays_are_refused_with_a_message():
    sw, job, _ = _job_and_requests(2, np.int32, 32, 0)
    arrays = _arrays(sw, job)
    arrays[1] = arrays[1][:, :, :2].copy()  # a slot table shorter than the window
    empty = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="disagree"):
        C.switch_requests(np.zeros(1, np.uint8), empty, empty, empty, 0, 0, 0.0, *arrays,
                          action_table(), np.zeros(K.SC.N, np.int64),
                          np.zeros((8, 3), np.int64), np.zeros((8, 200), np.uint8),
                          np.zeros((8, 2), np.int64))


# -- whole jobs over the in-memory fabric ----------------------------------------------------

class _Recording(MemoryFabric):
    """A fabric that hashes every data datagram it carries, in order (control messages carry
    random nonces)."""

    def _transmit(self, src, dst, payload, t):
        if len(payload) > 3 and payload[3] in DATA_TYPES:
            self.digest.update(repr((src, dst)).encode() + bytes(payload))
        return super()._transmit(src, dst, payload, t)


def _fabric(seed: int) -> _Recording:
    f = _Recording(FaultModel(loss_rate=0.05, duplicate_rate=0.02, reorder_rate=0.1,
                              latency_s=1e-4, jitter_s=5e-5), seed)
    f.digest = hashlib.sha256()
    return f


def _star(dtype, bits: int, seed: int) -> tuple:
    fabric = _fabric(seed)
    config = WorkerConfig(initial_rto_s=0.01, max_rto_s=0.05)
    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=64, seed=seed,
                      fabric=fabric, worker_config=config)
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(1500) * 5).astype(dtype) for _ in range(3)]
    outs = [np.empty_like(x) for x in xs]
    for _ in range(2):
        c.wait(c.start(xs, outs, bits=bits))
    stats = {k: v for k, v in c.switch.stats().items() if isinstance(v, int)}
    return ([o.tobytes() for o in outs], stats, dict(c.switch.drops),
            [dict(w.counters) for w in c.workers], fabric.digest.hexdigest())


def _tree(seed: int) -> tuple:
    fabric = _fabric(seed)
    t = TreeCluster(fabric, racks=2, workers_per_rack=2, window=4, elements_per_packet=16)
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-(2**20), 2**20, 300, dtype=np.int32) for _ in range(4)]
    outs = t.allreduce(xs)
    return ([o.tobytes() for o in outs], [dict(r.counters) for r in t.racks],
            fabric.digest.hexdigest())


@pytest.mark.parametrize("kind", [(np.float32, 32), (np.int32, 32), (np.float64, 16)],
                         ids=["float32", "int32", "float64/16"])
@pytest.mark.parametrize("seed", [1, 2])
def test_jobs_under_loss_run_identically_on_the_compiled_switch_and_the_reference(
        kind, seed, monkeypatch):
    compiled = _star(*kind, seed)
    for name, f in REFERENCE.items():
        monkeypatch.setattr(K, name, f)
    reference = _star(*kind, seed)
    assert compiled[0] == reference[0]  # results
    assert compiled[1] == reference[1]  # the switch's counters
    assert compiled[2] == reference[2]  # its drops
    assert compiled[3] == reference[3]  # the workers' counters
    assert compiled[4] == reference[4]  # every data datagram on the fabric
    assert compiled[1]["results_resent"] + compiled[1].get("nacks", 0) >= 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_tree_under_loss_runs_identically_on_the_compiled_relay_and_the_reference(
        seed, monkeypatch):
    compiled = _tree(seed)
    for name, f in REFERENCE.items():
        monkeypatch.setattr(K, name, f)
    reference = _tree(seed)
    assert compiled == reference
    assert sum(c["upstream_sent"] for c in compiled[1]) > 0
