"""The worker's receive-and-send loop, compiled.

A Python pump pays per wake-up: ``recvmmsg`` through ctypes, a dozen calls around the kernels,
one ``sendmsg`` per GSO run; measured on the testbed (n = 4, 1 Gbit/s, MTU 1500), the
interpreter was the largest share of a worker's CPU, more than the kernels and the system
calls. While an operation is in flight the steady state is always the same, so :func:`pump`
runs it in one compiled call that holds no GIL: ``recvmmsg`` (libc's, which numba calls as an
external symbol), cut the batch (``split_mmsg``), take the results (``worker_results``: the one
implementation of the per-datagram rules), plan the released requests into GSO runs
(``plan_runs``), ``sendmsg`` each, re-send what the timers say is due (``fire_timers``:
timeouts and the idle probe), and, when the socket is empty, wait in ``poll`` on it and the
inbox's wake-up pipe until the next deadline. It returns to Python, saying where it stopped,
for a datagram the kernel leaves to Python (control, WAITING, the operation's last result, a
full send queue), the operation's own timeout, a command, a failed system call (with its
errno), or after ``MAX_WAIT_S`` idle; Python goes on exactly as it would have. Only for one
switch address (a connected socket) and without RACK (its transmission log is Python's);
elsewhere the Python pump runs alone. ``switchpath.py`` is the switch's counterpart.
"""

from __future__ import annotations

import ctypes.util
import socket
import sys
from enum import IntEnum
from typing import Any

import numpy as np
from numba import types

from switchml.protocol import kernels as K
from switchml.protocol.kernels.frames import INLINE, NO_RC, njit

__all__ = ["FP", "FastPath", "available", "warm_up"]

MSG_DONTWAIT = 0x40
CLOCK_MONOTONIC = 1


class FP(IntEnum):
    """Why :func:`pump` returned."""

    WAKE = 0  # a command came (the inbox is readable), or MAX_WAIT_S passed idle
    STOPPED = 1  # the results kernel stopped at datagram ``at`` of the batch: Python goes on
    DUE = 2  # the operation's own timeout passed (no progress for op_timeout_s)
    SEND_FAILED = 3  # a sendmsg failed: the unsent requests are still queued
    RECV_FAILED = 4  # recvmmsg or poll failed (not for want of data): ``stats[ERRNO]``


class ST(IntEnum):
    """Counters :func:`pump` adds to (``stats``)."""

    RECV_CALLS = 0
    SEND_CALLS = 1
    DATAGRAMS_SENT = 2
    ERRNO = 3  # the errno of the call that failed (RECV_FAILED, SEND_FAILED); not a counter
    N = 4


# libc's calls, declared to numba as external symbols (resolved in the process, like any C
# function the JIT links; cacheable, unlike ctypes function objects, whose typing per call
# cost more than the loop saved). Pointers travel as integers (the same registers).
_recvmmsg = types.ExternalFunction("recvmmsg", types.int32(
    types.int32, types.intp, types.uint32, types.int32, types.intp))
_sendmsg = types.ExternalFunction("sendmsg", types.intp(types.int32, types.intp, types.int32))
_clock_gettime = types.ExternalFunction("clock_gettime", types.int32(types.int32, types.intp))
_poll = types.ExternalFunction("poll", types.int32(types.intp, types.uint64, types.int32))
_errno = types.ExternalFunction("__errno_location", types.CPointer(types.int32)())
EAGAIN = 11
POLLIN = 1
MAX_WAIT_S = 1.0
"""The longest :func:`pump` waits without anything to do before giving Python a turn."""


def available() -> bool:
    """Whether the compiled loop can run: Linux's libc, and numba compiling (under
    ``NUMBA_DISABLE_JIT=1`` the kernels run as Python, which cannot call libc's symbols: the
    Python pump runs alone)."""
    from numba import config
    return (sys.platform.startswith("linux") and ctypes.util.find_library("c") is not None
            and not config.DISABLE_JIT)


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


@njit(**NO_RC)
def _send_queued(fd, opv, sendq, sendlen, stride, tx8, order, runs, hdr, iov, cmsg,
                 max_segments, max_bytes, stats):
    """Send the queued lanes as GSO runs on the connected socket; False (and the unsent
    lanes left queued, in order) at the first failed ``sendmsg``."""
    nq = opv[K.OP.NQ]
    if nq == 0:
        return True
    nr = K.plan_runs(sendq, nq, sendlen, stride, 1, max_segments, max_bytes, order, runs)
    base = tx8.ctypes.data
    for r in range(nr):
        first, count, size, contiguous = runs[r, 0], runs[r, 1], runs[r, 2], runs[r, 3]
        if contiguous:
            lane0 = sendq[order[first]]
            last = sendq[order[first + count - 1]]
            iov[0] = base + lane0 * stride
            iov[1] = (count - 1) * stride + sendlen[last]
            niov = 1
        else:
            for j in range(count):
                lane = sendq[order[first + j]]
                iov[2 * j] = base + lane * stride
                iov[2 * j + 1] = sendlen[lane]
            niov = count
        _set_run(hdr, iov, niov, cmsg, count, size)
        if _sendmsg(fd, hdr.ctypes.data, 0) < 0:
            stats[ST.ERRNO] = _errno()[0]
            # Keep what is unsent (runs are in queue order: one shard) for Python to send.
            keep = 0
            for q in range(first, nq):
                sendq[keep] = sendq[order[q]]
                keep += 1
            opv[K.OP.NQ] = keep
            return False
        stats[ST.SEND_CALLS] += 1
        stats[ST.DATAGRAMS_SENT] += count
    opv[K.OP.NQ] = 0
    return True


FIRED = -2
NOTHING_DUE = -1


@njit(**NO_RC)
def _timers(fd, now, op_timeout_s, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits, res,
            tx8, tx16, tx32, cnt, sendq, sendlen, picked, stride, order, runs, hdr, iov, cmsg,
            max_segments, max_bytes, stats):
    """What the timers ask at ``now``: ``NOTHING_DUE``; ``FP.DUE`` (the operation timed out:
    Python fails it); or the re-sends they call for (``kernels.fire_timers``), sent:
    ``FIRED``, or ``FP.SEND_FAILED`` at a failed ``sendmsg`` (the rest stays queued)."""
    if now >= rtt[K.R.LAST_PROGRESS] + op_timeout_s:
        return FP.DUE.value
    if now < K.next_deadline(lane, lanef, rtt):
        return NOTHING_DUE
    if not K.fire_timers(now, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits, res, tx8,
                         tx16, tx32, cnt, sendq, sendlen, picked):
        if not _send_queued(fd, opv, sendq, sendlen, stride, tx8, order, runs, hdr, iov, cmsg,
                            max_segments, max_bytes, stats):
            return FP.SEND_FAILED.value
        K.fire_timers(now, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits, res, tx8,
                      tx16, tx32, cnt, sendq, sendlen, picked)
    if not _send_queued(fd, opv, sendq, sendlen, stride, tx8, order, runs, hdr, iov, cmsg,
                        max_segments, max_bytes, stats):
        return FP.SEND_FAILED.value
    return FIRED


@njit(**NO_RC)
def pump(fd, wake_fd, pfd, msgs_addr, count, raw, msg_len_at, controllen_at, names, control,
         slot_bytes, gro, sol_udp, udp_gro, buf, starts, lens, senders, opv, lane, lanef, rtt,
         next_set, exps, nonf, x, xbits, out, res, tx8, tx16, tx32, cnt, sendq, sendlen,
         scratch, picked, stride, order, runs, hdr, iov, cmsg, max_segments, max_bytes,
         op_timeout_s, ts, stats):
    """Receive, take results and send, fire the timers, and wait in ``poll`` (on the socket
    and the inbox's ``wake_fd``) until something needs Python (``FP``). Returns ``(why, at,
    nseg, code)``: with ``STOPPED``, the results kernel returned ``code`` (``WS``) at datagram
    ``at`` of the ``nseg`` the last batch cut into (``starts``/``lens``/``senders``): Python
    does what it asks (``WorkerEndpoint.after_results_kernel``) and goes on from there."""
    idle_since = _now(ts)
    while True:
        n = _recvmmsg(fd, msgs_addr, count, MSG_DONTWAIT, 0)
        if n <= 0:
            if n < 0 and _errno()[0] != EAGAIN:  # (an error is reported once: Python says it)
                stats[ST.ERRNO] = _errno()[0]
                return FP.RECV_FAILED.value, 0, 0, 0
            # Nothing to read: wait in the kernel for a datagram, a command or the deadline.
            now = _now(ts)
            t = _timers(fd, now, op_timeout_s, opv, lane, lanef, rtt, next_set, exps, nonf, x,
                        xbits, res, tx8, tx16, tx32, cnt, sendq, sendlen, picked, stride, order,
                        runs, hdr, iov, cmsg, max_segments, max_bytes, stats)
            if t != NOTHING_DUE:
                if t == FIRED:
                    continue
                return t, 0, 0, 0
            due = min(K.next_deadline(lane, lanef, rtt), rtt[K.R.LAST_PROGRESS] + op_timeout_s)
            if now - idle_since >= MAX_WAIT_S:
                return FP.WAKE.value, 0, 0, 0
            pfd[0] = fd | (POLLIN << 32)
            pfd[1] = wake_fd | (POLLIN << 32)
            wait_ms = np.int32((min(due, idle_since + MAX_WAIT_S) - now) * 1e3) + 1
            r = _poll(pfd.ctypes.data, 2, wait_ms)
            if r < 0:
                stats[ST.ERRNO] = _errno()[0]
                return FP.RECV_FAILED.value, 0, 0, 0  # (EINTR: Python's turn)
            if (pfd[1] >> 48) & POLLIN:
                return FP.WAKE.value, 0, 0, 0
            continue
        stats[ST.RECV_CALLS] += 1
        nseg = K.split_mmsg(raw, msg_len_at, controllen_at, names, control, n, slot_bytes, gro,
                            sol_udp, udp_gro, starts, lens, senders)
        now = _now(ts)
        idle_since = now
        at, code = K.worker_results(  # (limit past the batch: RACK, which stops at ONE, is off)
            buf, starts, lens, nseg, 0, nseg + 1, now, opv, lane, lanef, rtt, next_set, exps,
            nonf, x, xbits, out, res, tx8, tx16, tx32, cnt, sendq, sendlen, scratch)
        if not _send_queued(fd, opv, sendq, sendlen, stride, tx8, order, runs, hdr, iov, cmsg,
                            max_segments, max_bytes, stats):
            if code != K.WS.DONE.value:
                return FP.STOPPED.value, at, nseg, code  # Python sends the rest, goes on
            return FP.SEND_FAILED.value, 0, 0, 0
        if code != K.WS.DONE.value:
            return FP.STOPPED.value, at, nseg, code
        t = _timers(fd, now, op_timeout_s, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits,
                    res, tx8, tx16, tx32, cnt, sendq, sendlen, picked, stride, order, runs, hdr,
                    iov, cmsg, max_segments, max_bytes, stats)
        if t >= 0:
            return t, 0, 0, 0


class FastPath:
    """The compiled loop's fixed arguments for one worker socket and receiver: the libc
    functions, the receiver's buffers and the ``sendmsg`` header, iovecs and UDP_SEGMENT
    control message (laid out as ``struct msghdr``, ``struct iovec[]``, ``struct cmsghdr``)."""

    def __init__(self, sock: Any, rx: Any, wake_fd: int, *, max_segments: int,
                 max_bytes: int) -> None:
        from switchml.transport.batching import SOL_UDP, UDP_GRO, UDP_SEGMENT
        self.fd = sock.fileno()
        self.wake_fd = wake_fd
        self.pfd = np.zeros(2, np.int64)  # struct pollfd[2]: fd | events << 32 | revents << 48
        self.max_segments, self.max_bytes = max_segments, max_bytes
        self.hdr = np.zeros(7, np.int64)  # msghdr: name, namelen, iov, iovlen, control, ...
        self.iov = np.zeros(2 * max_segments, np.int64)
        self.cmsg = np.zeros(3, np.int64)  # cmsg_len, level | type << 32, the segment size
        self.cmsg[0] = 18  # CMSG_LEN(2)
        self.cmsg[1] = SOL_UDP | (UDP_SEGMENT << 32)
        self.ts = np.zeros(2, np.int64)
        self.stats = np.zeros(ST.N, np.int64)
        self._rx_args = (rx.fd_msgs_address, rx.count, rx._raw, rx._msg_len_at,
                         rx._controllen_at, rx._names, rx._control, rx.slot_bytes, rx.gro,
                         SOL_UDP, UDP_GRO, rx.buf, rx.starts, rx.lens, rx.senders)

    def run(self, op: Any, next_set: np.ndarray, cnt: np.ndarray, rtt: np.ndarray,
            op_timeout_s: float) -> tuple[int, int, int, int]:
        """One call of :func:`pump` for the operation in flight: ``(why, at, nseg, code)``."""
        return pump(self.fd, self.wake_fd, self.pfd, *self._rx_args,
                    op.opv, op.lane, op.lanef, rtt, next_set, op.exps, op.nonf, op.xk,
                    op.xbits, op.outk, op.res, op.tx8, op.tx16, op.tx32, cnt, op.sendq,
                    op.sendlen, op.scratch, op.picked, op.stride, op.run_order, op.runs, self.hdr,
                    self.iov, self.cmsg, self.max_segments, self.max_bytes,
                    float(op_timeout_s),  # (an int would compile a second pump)
                    self.ts, self.stats)

    def send(self, op: Any) -> bool:
        """Send ``op``'s queued requests as :func:`pump` does (``plan_runs``, one ``sendmsg``
        per GSO run), without the interpreter per run: what Python queued (an operation's
        first window as it starts, what its receive or timers released). False at a failed
        ``sendmsg`` (``stats[ERRNO]``; the unsent lanes stay queued, in order, for Python's
        sender)."""
        return bool(_send_queued(self.fd, op.opv, op.sendq, op.sendlen, op.stride, op.tx8,
                                 op.run_order, op.runs, self.hdr, self.iov, self.cmsg,
                                 self.max_segments, self.max_bytes, self.stats))


def warm_up(kinds: tuple | None = None) -> None:
    """Compile (or load from the cache) :func:`pump` for each kind of operation (default: all,
    ``protocol.warmup.KINDS``), on an idle loopback socket (it returns at once: nothing to
    receive), and :meth:`FastPath.send`'s kernel once (its arguments' types are the same for
    every kind: the last kind's first window goes to the socket itself, after the last
    pump)."""
    import os

    from switchml.protocol.config import JobSpec
    from switchml.protocol.endpoint import exchange
    from switchml.protocol.switch import SwitchDataplane
    from switchml.protocol.warmup import KINDS
    from switchml.protocol.worker import WorkerEndpoint
    from switchml.transport.batching import MAX_GSO_BYTES, MAX_SEGMENTS, MultiReceiver

    kinds = KINDS if kinds is None else tuple(kinds)
    if not available() or not kinds:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.connect(sock.getsockname())
        sock.setblocking(False)
        try:
            rx = MultiReceiver(sock)
        except OSError:
            return
        wake_r, wake_w = os.pipe()
        os.write(wake_w, b"x")  # (the loop returns at once)
        fast = FastPath(sock, rx, wake_r, max_segments=MAX_SEGMENTS, max_bytes=MAX_GSO_BYTES)
        sw, w_addr, sw_addr = SwitchDataplane(), ("127.0.0.1", 1), ("127.0.0.1", 2)
        w = WorkerEndpoint(spec=JobSpec(job_id=1, token=2, num_workers=1, window=2,
                                        elements_per_packet=4), rank=0, switch_address=sw_addr)
        w.join(0.0)
        exchange({w_addr: w, sw_addr: sw}, 0.0)
        for dtype, bits, residual in kinds:
            x = np.arange(10, dtype=dtype)
            w.start_allreduce(x, np.empty_like(x), 0.0, bits=bits,
                              residual=np.empty(x.size, dtype) if residual else None)
            state = w.fast_path_state()
            if state is not None:
                fast.run(*state)
                if (dtype, bits, residual) == kinds[-1]:
                    fast.send(state[0])
            w.close(0.0)  # (aborts the operation: the next one needs a fresh endpoint)
            w = WorkerEndpoint(spec=w.spec, rank=0, switch_address=sw_addr)
            w.join(0.0)
            exchange({w_addr: w, sw_addr: sw}, 0.0)
        os.close(wake_r)
        os.close(wake_w)
