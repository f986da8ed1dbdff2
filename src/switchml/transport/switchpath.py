"""The switch's receive-aggregate-send loop, compiled, and its send of results.

The budget of a testbed run (docs/decisions/0002-cpu-budget.md) put the interpreter at about three
times the compiled aggregation in the switch process: per wake-up, ``recvmmsg`` through ctypes,
the batch, the dataplane's Python around its kernel, the results' send. While jobs stream,
every wake-up is the same, so the compiled loop (``src/switchml/csrc/switch.c``'s
``switch_pump``, built with the package) runs it in one call that holds no GIL: ``recvmmsg``,
cut the batch (``split_mmsg``), take the requests (``kernels.switch_requests``: the one
implementation of the per-request rules), send the replies it wrote (NACKs, RESENT results,
WAITING) and the rounds it completed (``send_results``, GSO runs to every member), and wait in
``poll`` when the socket is empty. It returns to Python (``SwitchDataplane.resume``) for
anything the kernel leaves to it: a datagram of another job or a stranger, a control message,
disagreeing ranks; or after ``max_wait_s`` idle, or at a wake-up.
It runs for the dataplane's hot jobs (``SwitchDataplane.fast_path_state``: the last ones to
take requests, up to ``HOT_JOBS``, whose datagrams may interleave in a batch): a plain switch
(not a rack of a tree), stable sender numbers (``recvmmsg``), and nothing queued in Python.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from switchml import _switch as C
from switchml.protocol.kernels.layout import MAX_BATCH, SP, XC
from switchml.protocol.switch import HOT_JOBS
from switchml.transport.batching import write_sockaddr

__all__ = ["SC", "SP", "ResultSender", "SwitchFastPath"]

SC = XC
"""Counters the result sender adds to (``layout.XC``)."""


_JOB_ARRAYS = ("jobv", "st", "seen", "conflict", "bufs", "clog", "cursor", "mkeys", "heard")
"""A job's arrays the compiled loop takes, with its members' addresses, per hot job."""


class ResultSender:
    """The compiled send of results (``send_results``: one ``sendmsg`` per GSO run and
    member) for a switch socket, and each job's members as ``struct sockaddr_in`` rows by rank
    (rebuilt when its membership changes)."""

    def __init__(self, sock: Any, *, max_segments: int, max_bytes: int) -> None:
        self.fd = sock.fileno()
        self.max_segments, self.max_bytes = max_segments, max_bytes
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
                write_sockaddr(names, rank, *member)
        if len(self._names) > 4096:  # jobs come and go: keep it bounded
            self._names.clear()
        self._names[job.job_id] = (key, names)
        return names

    def send(self, job: Any, n: int) -> None:
        """Send the job's ``n`` queued results to every member."""
        if len(self.runs) < n:
            self.runs = np.empty((n, 4), np.int64)
        C.send_results(self.fd, job.pend, n, job.bufs, self.names(job), self.max_segments,
                       self.max_bytes, self.runs, self.stats)


class SwitchFastPath:
    """The compiled loop's fixed arguments for a switch socket and its receiver."""

    def __init__(self, rx: Any, results: ResultSender, *, wake_fd: int = -1,
                 max_wait_s: float = 0.2, asks: np.ndarray | None = None) -> None:
        from switchml.transport.batching import SOL_UDP, UDP_GRO
        self.results = results
        self.wake_fd = wake_fd
        self.max_wait_s = float(max_wait_s)
        self.asks = np.zeros(1, np.int64) if asks is None else asks
        self.stats = np.zeros(SP.N, np.int64)
        self.runs = np.empty((MAX_BATCH, 4), np.int64)
        self.taken = np.zeros(HOT_JOBS, np.int64)
        self._rx_args = (rx.fd_msgs_address, rx.count, rx._raw, rx._msg_len_at,
                         rx._controllen_at, rx._names, rx._control, rx.slot_bytes, int(rx.gro),
                         SOL_UDP, UDP_GRO, rx.buf, rx.starts, rx.lens, rx.senders)

    def run(self, jobs: list[Any], shared: tuple) -> tuple[int, int, int, int, int]:
        """One call of the compiled loop for ``jobs`` with the kernel's ``shared`` arguments
        (``SwitchDataplane.fast_path_state``: rules, counters, done, replies, reply_meta):
        ``(why, at, nseg, code, k)``: with ``FP.STOPPED``, the kernel returned ``code``
        (``kernels.SS``) for ``jobs[k]`` at datagram ``at`` of the ``nseg`` the last batch
        cut into (``starts``/``lens``/``senders``); what came before is taken and sent.
        ``self.taken[k]``: the datagrams it took for ``jobs[k]``."""
        res = self.results
        hot = [(*(getattr(j, f) for f in _JOB_ARRAYS), res.names(j)) for j in jobs[:HOT_JOBS]]
        self.taken[:] = 0
        return C.switch_pump(res.fd, self.wake_fd, self.max_wait_s, self.asks, self.stats,
                             self.taken, res.stats, hot, *shared, res.max_segments,
                             res.max_bytes, self.runs, *self._rx_args)
