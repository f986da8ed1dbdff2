"""The switch's receive-aggregate-send loop, compiled, and its send of results.

The budget of a testbed run (docs/benchmarks.md, section 0) put the interpreter at about
three times the compiled aggregation in the switch process: per wake-up, ``recvmmsg`` through
ctypes, the batch, the dataplane's Python around its kernel, the results' send. While jobs
stream, every wake-up is the same, so :func:`switch_pump` runs it in one compiled call that
holds no GIL: ``recvmmsg``, cut the batch (``split_mmsg``), take the requests
(``kernels.switch_requests``: the one implementation of the per-request rules), send the
replies it wrote (NACKs, RESENT results, WAITING) and the rounds it completed
(:func:`send_results`, GSO runs to every member), and wait in ``poll`` when the socket is
empty. It returns to Python (``SwitchDataplane.resume``) for anything the kernel leaves to it:
a datagram of another job or a stranger, a control message, disagreeing ranks; or after
``max_wait_s`` idle, or at a wake-up.
It runs for the dataplane's hot jobs (``SwitchDataplane.fast_path_state``: the last ones to
take requests, up to ``HOT_JOBS``, whose datagrams may interleave in a batch): a plain switch
(not a rack of a tree), stable sender numbers (``recvmmsg``), and nothing queued in Python.
"""

from __future__ import annotations

import socket
from enum import IntEnum
from typing import Any

import numpy as np
from numba import types

from switchml.protocol import kernels as K
from switchml.protocol.jobs import Job
from switchml.protocol.kernels.frames import (  # (numba's: this loop is compiled by numba)
    H_JOB,
    HDR,
    INLINE,
    NO_RC,
    njit,
    split_mmsg,
    u32,
)
from switchml.protocol.kernels.layout import FP
from switchml.protocol.switch import HOT_JOBS

MSG_DONTWAIT = 0x40
CLOCK_MONOTONIC = 1
EAGAIN = 11
POLLIN = 1
# libc's calls, declared to numba as external symbols (resolved in the process, like any C
# function the JIT links; cacheable, unlike ctypes function objects, whose typing per call
# cost more than the loop saved). Pointers travel as integers (the same registers).
_recvmmsg = types.ExternalFunction("recvmmsg", types.int32(
    types.int32, types.intp, types.uint32, types.int32, types.intp))
_sendmsg = types.ExternalFunction("sendmsg", types.intp(types.int32, types.intp, types.int32))
_clock_gettime = types.ExternalFunction("clock_gettime", types.int32(types.int32, types.intp))
_poll = types.ExternalFunction("poll", types.int32(types.intp, types.uint64, types.int32))
_errno = types.ExternalFunction("__errno_location", types.CPointer(types.int32)())


@njit(**NO_RC)
def _now(ts):
    _clock_gettime(CLOCK_MONOTONIC, ts.ctypes.data)
    return np.float64(ts[0]) + np.float64(ts[1]) * 1e-9


@njit(**INLINE)
def _set_run(hdr, iov, niov, cmsg, count, size):
    """Point the ``struct msghdr`` at ``niov`` iovecs and, for more than one datagram, at the
    UDP_SEGMENT control message that has the kernel cut them into datagrams of ``size``."""
    hdr[2] = iov.ctypes.data
    hdr[3] = niov
    if count > 1:
        cmsg[2] = size
        hdr[4] = cmsg.ctypes.data
        hdr[5] = 24  # CMSG_SPACE(2)
    else:
        hdr[4] = 0
        hdr[5] = 0

__all__ = ["SC", "SP", "ResultSender", "SwitchFastPath", "send_results", "switch_pump",
           "warm_up"]


class SC(IntEnum):
    """Counters :func:`send_results` adds to."""

    SEND_CALLS = 0
    DATAGRAMS_SENT = 1
    BLOCKED = 2  # datagrams a full socket buffer refused (lost: retransmission recovers)
    ERRORS = 3  # datagrams another send error lost
    N = 4


class SP(IntEnum):
    """Counters :func:`switch_pump` adds to (beside ``SC``'s)."""

    RECV_CALLS = 0
    TAKEN = 1  # datagrams received and taken by the kernel
    RESULTS = 2  # result datagrams sent (or lost to a full buffer)
    REPLIES = 3  # replies sent (NACK, RESENT, WAITING)
    ERRNO = 4  # the errno of a failed recvmmsg or poll; not a counter
    N = 5


@njit(**NO_RC)
def send_results(fd, pend, n, bufs, stride, names, max_segments, max_bytes, runs, hdr, iov,
                 cmsg, stats):
    """The switch's send of a job's completed rounds (``pend[:n]``, rows ``(set, slot,
    length)``; results in ``bufs[set, slot]``) to each joined member (``names[rank]``: a
    ``struct sockaddr_in``; family 0: no member): the GSO runs ``kernels.plan_result_runs``
    plans, one ``sendmsg`` per run and member, from the slots' memory. A failed send loses
    that run for that member (counted; the workers' retransmissions recover it, as for any
    loss). Returns the result datagrams it handed to the kernel or lost."""
    nr = K.plan_result_runs(pend, n, stride, max_segments, max_bytes, runs)
    base = bufs.ctypes.data
    set_bytes = bufs.shape[1] * stride
    out = 0
    for r in range(nr):
        first, count, size, contiguous = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
        if contiguous:
            iov[0] = base + pend[first, 0] * set_bytes + pend[first, 1] * stride
            iov[1] = (count - 1) * stride + pend[first + count - 1, 2]
            niov = 1
        else:
            for j in range(count):
                iov[2 * j] = base + pend[first + j, 0] * set_bytes + pend[first + j, 1] * stride
                iov[2 * j + 1] = pend[first + j, 2]
            niov = count
        _set_run(hdr, iov, niov, cmsg, count, size)
        for m in range(names.shape[0]):
            if names[m, 0] == 0:
                continue
            hdr[0] = names.ctypes.data + 16 * m
            hdr[1] = 16  # sizeof(struct sockaddr_in)
            out += count
            if _sendmsg(fd, hdr.ctypes.data, 0) < 0:
                stats[SC.BLOCKED if _errno()[0] == EAGAIN else SC.ERRORS] += count
            else:
                stats[SC.SEND_CALLS] += 1
                stats[SC.DATAGRAMS_SENT] += count
    return out


@njit(**NO_RC)
def _send_replies(fd, replies, reply_meta, nreply, names, hdr, iov, cmsg, stats):
    """The replies the kernel wrote (``replies[k, :reply_meta[k, 1]]``, to
    ``names[reply_meta[k, 0]]``), one ``sendmsg`` each."""
    base = replies.ctypes.data
    row = replies.shape[1]
    for k in range(nreply):
        iov[0] = base + k * row
        iov[1] = reply_meta[k, 1]
        _set_run(hdr, iov, 1, cmsg, 1, reply_meta[k, 1])
        hdr[0] = names.ctypes.data + 16 * reply_meta[k, 0]
        hdr[1] = 16
        if _sendmsg(fd, hdr.ctypes.data, 0) < 0:
            stats[SC.BLOCKED if _errno()[0] == EAGAIN else SC.ERRORS] += 1
        else:
            stats[SC.SEND_CALLS] += 1
            stats[SC.DATAGRAMS_SENT] += 1


@njit(**INLINE)
def _job_at(buf, starts, lens, i, jobvs, njobs):
    """The index of the hot job datagram ``i`` names, or -1."""
    o = starts[i]
    if lens[i] < HDR:
        return -1
    job = u32(buf, o + H_JOB)
    for k in range(njobs):
        if jobvs[k][K.J.JOB] == job:
            return k
    return -1


@njit(**NO_RC)
def switch_pump(fd, wake_fd, pfd, msgs_addr, count, raw, msg_len_at, controllen_at, rx_names,
                control, slot_bytes, gro, sol_udp, udp_gro, buf, starts, lens, senders,
                njobs, jobvs, sts, seens, conflicts, bufss, clogs, cursors, mkeyss, heards,
                namess, strides, rules, cnt, done, replies, reply_meta, max_segments,
                max_bytes, runs, hdr, iov, cmsg, max_wait_s, asks, ts, stats, taken_by, sstats):
    """Receive, aggregate the requests of the hot jobs (the first ``njobs`` of the tuples of
    their arrays, ``SwitchDataplane.fast_path_state``) and send their results and replies,
    and wait in ``poll`` (on the socket and ``wake_fd``; -1: none) when there is nothing to
    receive, until something needs Python, or another thread asks for the dataplane
    (``asks[0]`` nonzero). Datagrams of the hot jobs may interleave: where the kernel stops at
    a datagram that names another hot job, that job's kernel call goes on from it (and checks
    its sender itself). ``taken_by[k]``: the datagrams taken for job ``k``.

    Returns ``(why, at, nseg, code, k)`` (``FP``): with ``STOPPED``, the kernel returned
    ``code`` (``kernels.SS``) for job ``k`` at datagram ``at`` of the ``nseg`` the last batch
    cut into (``starts``/``lens``/``senders``); what came before is taken and sent."""
    idle_since = _now(ts)
    while True:
        if asks[0] != 0:
            return FP.WAKE.value, 0, 0, 0, 0
        n = _recvmmsg(fd, msgs_addr, count, MSG_DONTWAIT, 0)
        if n <= 0:
            if n < 0:
                e = _errno()[0]
                if e != EAGAIN:
                    stats[SP.ERRNO] = e
                    return FP.RECV_FAILED.value, 0, 0, 0, 0
            now = _now(ts)
            if now - idle_since >= max_wait_s:
                return FP.WAKE.value, 0, 0, 0, 0
            pfd[0] = fd | (POLLIN << 32)
            pfd[1] = wake_fd | (POLLIN << 32)
            r = _poll(pfd.ctypes.data, 2, np.int32((idle_since + max_wait_s - now) * 1e3) + 1)
            if r < 0:
                stats[SP.ERRNO] = _errno()[0]
                return FP.RECV_FAILED.value, 0, 0, 0, 0  # (EINTR: Python's turn)
            if wake_fd >= 0 and (pfd[1] >> 48) & POLLIN:
                return FP.WAKE.value, 0, 0, 0, 0
            continue
        stats[SP.RECV_CALLS] += 1
        nseg = split_mmsg(raw, msg_len_at, controllen_at, rx_names, control, n, slot_bytes,
                            gro, sol_udp, udp_gro, starts, lens, senders)
        now = _now(ts)
        idle_since = now
        at = 0
        k = _job_at(buf, starts, lens, 0, jobvs, njobs) if nseg > 0 else 0
        k = 0 if k < 0 else k
        while True:
            start = at
            at, ndone, nreply, code = K.switch_requests(
                buf, starts, lens, senders, nseg, start, now, jobvs[k], sts[k], seens[k],
                conflicts[k], bufss[k], clogs[k], cursors[k], mkeyss[k], heards[k], rules, cnt,
                done, replies, reply_meta)
            stats[SP.TAKEN] += at - start
            taken_by[k] += at - start
            if nreply:
                _send_replies(fd, replies, reply_meta, nreply, namess[k], hdr, iov, cmsg,
                              sstats)
                stats[SP.REPLIES] += nreply
            if ndone:
                stats[SP.RESULTS] += send_results(fd, done, ndone, bufss[k], strides[k],
                                                  namess[k], max_segments, max_bytes, runs,
                                                  hdr, iov, cmsg, sstats)
            if code == K.SS.DONE.value:
                break
            if code == K.SS.REPLIES_FULL.value:
                continue  # (sent above: the rows are free again)
            if code == K.SS.OTHER.value:
                # Another hot job's datagram: its kernel call goes on from here (and if
                # that job's call stops at it too, Python looks at it).
                k2 = _job_at(buf, starts, lens, at, jobvs, njobs)
                if k2 >= 0 and k2 != k:
                    k = k2
                    continue
            return FP.STOPPED.value, at, nseg, code, k


_JOB_ARRAYS = ("jobv", "st", "seen", "conflict", "bufs", "clog", "cursor", "mkeys", "heard")
"""A job's arrays that ``switch_pump`` takes, each as a tuple over the hot jobs."""


def _sockaddr(names: np.ndarray, i: int, host: str, port: int) -> None:
    names[i, 0:2] = (2, 0)  # AF_INET, little-endian
    names[i, 2:4] = (port >> 8, port & 0xFF)  # network order
    names[i, 4:8] = np.frombuffer(socket.inet_aton(host), np.uint8)


class ResultSender:
    """:func:`send_results`'s fixed arguments for a switch socket, and each job's members as
    ``struct sockaddr_in`` rows by rank (rebuilt when its membership changes)."""

    def __init__(self, sock: Any, *, max_segments: int, max_bytes: int) -> None:
        from switchml.transport.batching import SOL_UDP, UDP_SEGMENT
        self.fd = sock.fileno()
        self.max_segments, self.max_bytes = max_segments, max_bytes
        self.hdr = np.zeros(7, np.int64)
        self.iov = np.zeros(2 * max_segments, np.int64)
        self.cmsg = np.array([18, SOL_UDP | (UDP_SEGMENT << 32), 0], np.int64)
        self.stats = np.zeros(SC.N, np.int64)
        self.runs = np.empty((1024, 4), np.int64)
        self._names: dict[int, tuple[tuple, np.ndarray]] = {}

    def names(self, job: Any) -> np.ndarray:
        """The job's members by rank, as sockaddr_in rows (IPv4; family 0 where none)."""
        key = tuple(job.members)
        cached = self._names.get(job.job_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        names = np.zeros((len(job.members), 16), np.uint8)
        for rank, member in enumerate(job.members):
            if member is not None:
                _sockaddr(names, rank, *member)
        if len(self._names) > 4096:  # jobs come and go: keep it bounded
            self._names.clear()
        self._names[job.job_id] = (key, names)
        return names

    def send(self, job: Any, n: int) -> None:
        """Send the job's ``n`` queued results to every member."""
        if len(self.runs) < n:
            self.runs = np.empty((n, 4), np.int64)
        send_results(self.fd, job.pend, n, job.bufs, job.stride, self.names(job),
                     self.max_segments, self.max_bytes, self.runs, self.hdr, self.iov,
                     self.cmsg, self.stats)


class SwitchFastPath:
    """:func:`switch_pump`'s fixed arguments for a switch socket and its receiver."""

    def __init__(self, rx: Any, results: ResultSender, *, wake_fd: int = -1,
                 max_wait_s: float = 0.2, asks: np.ndarray | None = None) -> None:
        from switchml.transport.batching import SOL_UDP, UDP_GRO
        self.results = results
        self.wake_fd = wake_fd
        self.max_wait_s = float(max_wait_s)
        self.asks = np.zeros(1, np.int64) if asks is None else asks
        self.pfd = np.zeros(2, np.int64)  # struct pollfd[2]: fd | events << 32 | revents << 48
        self.ts = np.zeros(2, np.int64)
        self.stats = np.zeros(SP.N, np.int64)
        self.runs = np.empty((K.MAX_BATCH, 4), np.int64)
        self.strides = np.zeros(HOT_JOBS, np.int64)
        self.taken = np.zeros(HOT_JOBS, np.int64)
        self._dummy: Job | None = None
        self._dummy_names = np.zeros((1, 16), np.uint8)
        self._rx_args = (rx.fd_msgs_address, rx.count, rx._raw, rx._msg_len_at,
                         rx._controllen_at, rx._names, rx._control, rx.slot_bytes, rx.gro,
                         SOL_UDP, UDP_GRO, rx.buf, rx.starts, rx.lens, rx.senders)

    def run(self, jobs: list[Any], shared: tuple) -> tuple[int, int, int, int, int]:
        """One call of :func:`switch_pump` for ``jobs`` with the kernel's ``shared``
        arguments (``SwitchDataplane.fast_path_state``): ``(why, at, nseg, code, k)``;
        ``self.taken[k]``: the datagrams it took for ``jobs[k]``."""
        res = self.results
        if self._dummy is None:  # fills the tuples' unused places (its id matches no job)
            self._dummy = Job(0, 0, 1, 0, 1, 1, [None])
            self._dummy.jobv[K.J.JOB] = -1
        pad = [*jobs[:HOT_JOBS], *[self._dummy] * (HOT_JOBS - len(jobs))]
        arrays = tuple(tuple(getattr(j, f) for j in pad) for f in _JOB_ARRAYS)
        names = tuple(self._dummy_names if j is self._dummy else res.names(j) for j in pad)
        for k, j in enumerate(pad):
            self.strides[k] = j.stride
        self.taken[:] = 0
        return switch_pump(res.fd, self.wake_fd, self.pfd, *self._rx_args, min(len(jobs),
                           HOT_JOBS), *arrays, names, self.strides, *shared, res.max_segments,
                           res.max_bytes, self.runs, res.hdr, res.iov, res.cmsg,
                           self.max_wait_s, self.asks, self.ts, self.stats, self.taken,
                           res.stats)


def warm_up() -> None:
    """Compile (or load from the cache) :func:`switch_pump` and :func:`send_results`, on an
    idle loopback socket (the pump returns at once: its wake-up pipe is readable). Only the
    switch's kernels: the request is crafted (``protocol.warmup.warm_switch``)."""
    import os

    from switchml.protocol.warmup import warm_switch
    from switchml.transport import fastpath
    from switchml.transport.batching import MAX_GSO_BYTES, MAX_SEGMENTS, MultiReceiver

    if not fastpath.available():
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        try:
            rx = MultiReceiver(sock)
        except OSError:
            return
        sender = ResultSender(sock, max_segments=MAX_SEGMENTS, max_bytes=MAX_GSO_BYTES)
        wake_r, wake_w = os.pipe()
        os.write(wake_w, b"x")  # (the loop returns at once)
        try:
            fast = SwitchFastPath(rx, sender, wake_fd=wake_r)
            sw, _, _ = warm_switch()
            state = sw.fast_path_state()
            if state is not None:
                fast.run(*state)
        finally:
            os.close(wake_r)
            os.close(wake_w)
