"""The switch's compiled receive-aggregate-send loop (``transport/switchpath.py``): the sums
it gives against numpy and against the switch's Python path, loss recovery through it (NACKs
it sends, retransmissions it leaves to Python), forged requests dropped while it streams, and
the dataplane's lock handed to other threads (statistics, leases) while it holds it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from switchml.control import new_job_spec
from switchml.protocol.config import WorkerConfig
from switchml.protocol.wire import ElementType, Flags, Header, MessageType, pack_header
from switchml.transport import fastpath
from switchml.transport.faults import LossyEndpoint
from switchml.transport.udp import SwitchServer, WorkerClient

pytestmark = pytest.mark.skipif(not fastpath.available(), reason="no Linux libc here")


def _allreduce(server, spec, xs, *, ops: int = 2, loss: float = 0.0,
               during=None) -> dict[int, list[np.ndarray]]:
    """Every rank's outputs of ``ops`` all-reduces of ``xs[rank]`` (int32); ``loss``: each
    worker loses that share of what it sends and receives; ``during()`` runs meanwhile."""
    outs: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []
    cfg = WorkerConfig(op_timeout_s=30, min_rto_s=0.005)

    def rank(r: int) -> None:
        try:
            wrap = (lambda s: LossyEndpoint(s, loss, seed=r)) if loss else None
            with WorkerClient(server.address, spec, r, cfg, wrap=wrap) as w:
                outs[r] = [w.allreduce(xs[r]) for _ in range(ops)]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(xs))]
    for t in threads:
        t.start()
    if during is not None:
        during(lambda: any(t.is_alive() for t in threads))
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return outs


def _inputs(n: int, numel: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(-10**6, 10**6, numel).astype(np.int32) for _ in range(n)]


@pytest.mark.parametrize("loss", [0.0, 0.02])
def test_the_switch_loop_sums_as_numpy_and_as_the_python_switch(monkeypatch, loss):
    xs = _inputs(3, 200_000)
    total = np.sum(np.stack(xs).astype(np.int64), axis=0).astype(np.int32)
    got = {}
    for fast in (True, False):
        monkeypatch.setenv("SWITCHML_FASTPATH", "1" if fast else "0")
        with SwitchServer(host="127.0.0.1", port=0) as server:
            outs = _allreduce(server, new_job_spec(3, window=16, elements_per_packet=358), xs,
                              loss=loss)
            stats = server.stats()
        for r, per_op in outs.items():
            for op, out in enumerate(per_op):
                np.testing.assert_array_equal(out, total, err_msg=f"rank {r}, operation {op}")
        got[fast] = stats
    assert got[True]["fast_path_datagrams"] > 0  # the loop took them
    assert got[False]["fast_path_datagrams"] == 0
    if loss:  # recovery went through it: NACKs it sent, answers Python gave
        assert got[True]["nacks_sent"] + got[True]["results_resent"] > 0


def test_forged_requests_while_the_loop_streams_are_dropped_and_counted():
    """Another socket sends requests with the job's id, token and rank 0 while the job
    streams: each is dropped as ``wrong_source`` (the loop hands it to Python), and the
    sums are exact."""
    xs = _inputs(2, 400_000)
    total = np.sum(np.stack(xs).astype(np.int64), axis=0).astype(np.int32)
    spec = new_job_spec(2, window=16, elements_per_packet=358)
    forged = 300
    with SwitchServer(host="127.0.0.1", port=0) as server:
        def forge(_busy) -> None:
            payload = np.full(358, 10**6, "<i4").tobytes()
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for i in range(forged):
                    h = Header(MessageType.REQUEST, spec.job_id, rank=0, token=spec.token,
                               seq=0, chunk=i % 16, slot=i % 16, count=358,
                               elem=ElementType.INT32, flags=int(Flags.HAS_DATA))
                    s.sendto(pack_header(h) + payload, server.address)
                    time.sleep(0.0005)

        outs = _allreduce(server, spec, xs, ops=3, during=forge)
        stats = server.stats()
    for per_op in outs.values():
        for out in per_op:
            np.testing.assert_array_equal(out, total)
    assert stats["fast_path_datagrams"] > 0
    # (a forged datagram that came before the job existed is an unknown job's)
    assert stats["drops"].get("wrong_source", 0) + stats["drops"].get("unknown_job", 0) \
        + stats["drops"].get("not_joined", 0) == forged


def test_other_threads_get_the_dataplane_while_the_loop_streams():
    """``stats()`` (and the lease timer) take the dataplane's lock, which the loop holds
    while it streams: each call returns at once, not when the loop next has nothing to do."""
    xs = _inputs(2, 1_000_000)
    waits: list[float] = []
    with SwitchServer(host="127.0.0.1", port=0) as server:
        def poll_stats(busy) -> None:
            while busy():
                t = time.monotonic()
                taken = server.stats()["fast_path_datagrams"]
                if taken:  # (the loop runs: the job streams)
                    waits.append(time.monotonic() - t)
                time.sleep(0.002)

        _allreduce(server, new_job_spec(2, window=32, elements_per_packet=358), xs, ops=30,
                   during=poll_stats)
    assert len(waits) > 20
    assert max(waits) < 0.1, f"stats() waited {max(waits):.2f} s for the dataplane"


@contextlib.contextmanager
def _switch_socket():
    """A switch on a loopback socket, driven by hand: ``(socket, its address, receiver,
    compiled loop, dataplane)``; the loop returns after 50 ms idle."""
    from switchml.protocol.switch import SwitchDataplane
    from switchml.transport.batching import MAX_GSO_BYTES, MAX_SEGMENTS, MultiReceiver
    from switchml.transport.switchpath import ResultSender, SwitchFastPath

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as ssock:
        ssock.bind(("127.0.0.1", 0))
        ssock.setblocking(False)
        rx = MultiReceiver(ssock)
        fast = SwitchFastPath(rx, ResultSender(ssock, max_segments=MAX_SEGMENTS,
                                               max_bytes=MAX_GSO_BYTES), max_wait_s=0.05)
        yield ssock, ssock.getsockname(), rx, fast, SwitchDataplane()


def _joined_worker(spec, rank: int, saddr, sw):
    """A worker endpoint on a socket of its own, joined to ``sw`` (in memory)."""
    from switchml.protocol.endpoint import exchange
    from switchml.protocol.worker import WorkerEndpoint

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(2.0)
    w = WorkerEndpoint(spec=spec, rank=rank, switch_address=saddr)
    w.join(0.0)
    exchange({s.getsockname(): w, saddr: sw}, 0.0)
    return s, w


def _python_path(ssock, rx, sw) -> None:
    """What the switch socket holds, through the dataplane's Python path (which admits each
    member and learns its sender number), results sent."""
    from switchml.protocol.endpoint import Batch

    time.sleep(0.05)
    while (got := rx.receive()) > 0:
        sw.receive_many(Batch(rx.buf, rx.starts, rx.lens, rx.senders, got, rx.address_of,
                              True), 0.0)
        for d, a in sw.datagrams_to_send(0.0):
            ssock.sendto(bytes(d), a)


def test_the_loop_takes_two_jobs_interleaved_datagram_by_datagram():
    """Two jobs (as HSDP's shard groups: the same hosts, one job per shard) stream at once,
    their requests interleaved in one receive batch: one call of the loop takes every one of
    them (it goes on with the other job's kernel call where a datagram names it) and returns
    only when idle; each rank's sums are exact (numpy)."""
    from switchml.protocol.config import JobSpec

    n, window, k, numel = 2, 4, 64, 4 * 64 * 3  # three windows of chunks per rank
    with _switch_socket() as (ssock, saddr, rx, fast, sw):
        socks, eps, outs, xs = [], [], [], []
        rng = np.random.default_rng(5)
        for job_id in (21, 22):
            spec = JobSpec(job_id=job_id, token=7 + job_id, num_workers=n, window=window,
                           elements_per_packet=k)
            for rank in range(n):
                s, w = _joined_worker(spec, rank, saddr, sw)
                socks.append(s)
                eps.append(w)
                xs.append(rng.integers(-10**6, 10**6, numel).astype(np.int32))
                outs.append(np.zeros(numel, np.int32))
        for i, w in enumerate(eps):
            w.start_allreduce(xs[i], outs[i], 0.0)
        calls = []
        try:
            for round_ in range(3):
                # Every rank's window of requests, interleaved one datagram at a time.
                queued = [[bytes(d) for d, _ in w.datagrams_to_send(0.0)] for w in eps]
                assert all(len(q) == window for q in queued)
                for j in range(window):
                    for i, s in enumerate(socks):
                        s.sendto(queued[i][j], saddr)
                if round_ == 0:  # Python admits each member (and learns its sender number)
                    _python_path(ssock, rx, sw)
                else:
                    state = sw.fast_path_state()
                    assert state is not None and len(state[0]) == 2
                    why, _at, _nseg, _code, _k = fast.run(*state)
                    calls.append((why, fast.taken[:2].tolist()))
                for i, s in enumerate(socks):
                    for _ in range(window):
                        eps[i].receive_datagram(s.recv(65536), saddr, 0.0)
        finally:
            for s in socks:
                s.close()
    assert calls == [(fastpath.FP.WAKE, [n * window, n * window])] * 2
    for job in range(2):
        total = xs[2 * job].astype(np.int64) + xs[2 * job + 1]
        for rank in range(n):
            np.testing.assert_array_equal(outs[2 * job + rank], total.astype(np.int32))


def test_the_loop_answers_more_resends_in_a_batch_than_its_reply_rows_hold():
    """A rank re-sends a whole window into complete rounds, more than the kernel's reply rows
    (``REPLIES_PER_CALL``): one call of the loop answers every one (the stored result,
    RESENT) and returns only when idle."""
    from switchml.protocol import kernels as K
    from switchml.protocol.config import JobSpec
    from switchml.protocol.wire import unpack_header

    window, k = K.REPLIES_PER_CALL + 16, 8
    spec = JobSpec(job_id=31, token=77, num_workers=2, window=window, elements_per_packet=k)
    with _switch_socket() as (ssock, saddr, rx, fast, sw):
        socks, sent = [], []
        try:
            for rank in range(2):
                s, w = _joined_worker(spec, rank, saddr, sw)
                socks.append(s)
                x = np.arange(window * k, dtype=np.int32) * (rank + 1)
                w.start_allreduce(x, np.zeros_like(x), 0.0)
                sent.append([bytes(d) for d, _ in w.datagrams_to_send(0.0)])
                assert len(sent[-1]) == window
            for r, s in enumerate(socks):  # every round completes (Python admits the ranks)
                for d in sent[r]:
                    s.sendto(d, saddr)
            _python_path(ssock, rx, sw)
            results = {}
            for d in (socks[0].recv(65536) for _ in range(window)):
                results[unpack_header(d).chunk] = d
            for d in sent[0]:  # rank 0 re-sends its whole window
                socks[0].sendto(d, saddr)
            time.sleep(0.05)
            why, *_ = fast.run(*sw.fast_path_state())
            assert why == fastpath.FP.WAKE and fast.taken[0] == window
            for _ in range(window):
                d = socks[0].recv(65536)
                h = unpack_header(d)
                assert h.flags & Flags.RESENT
                original = bytearray(results[h.chunk])
                original[4] |= Flags.RESENT
                assert d == bytes(original)
        finally:
            for s in socks:
                s.close()
