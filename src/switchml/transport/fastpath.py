"""The worker's receive-and-send loop, compiled.

A Python pump pays per wake-up: ``recvmmsg`` through ctypes, a dozen calls around the kernels,
one ``sendmsg`` per GSO run; measured on the testbed (n = 4, 1 Gbit/s, MTU 1500), the
interpreter was the largest share of a worker's CPU, more than the kernels and the system
calls. While an operation is in flight the steady state is always the same, so :func:`pump`
runs it in one call into the compiled data plane (``src/switchml/csrc/worker.c``'s ``pump``,
built with the package), which holds no GIL: ``recvmmsg``, cut the batch (``split_mmsg``), take
the results (``worker_results``: the one implementation of the per-datagram rules), plan the
released requests into GSO runs (``plan_runs``), ``sendmsg`` each, re-send what the timers say
is due (``fire_timers``: timeouts and the idle probe), and, when the socket is empty, wait in
``poll`` on it and the inbox's wake-up pipe until the next deadline. It returns to Python,
saying where it stopped, for a datagram the kernel leaves to Python (control, WAITING, the
operation's last result, a full send queue), the operation's own timeout, a command, a failed
system call (with its errno), or after 1 s idle (``MAX_WAIT_S`` in csrc/worker.c); Python goes
on exactly as it would have. For one switch (a connected socket: the kernel drops anyone
else's datagrams) or a sharded one (each GSO run to its lanes' shard; a datagram from none of
the shards goes back to Python, which drops and counts it); not with RACK (its transmission
log is Python's), where the Python pump runs alone. ``switchpath.py`` is
the switch's counterpart.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from switchml import _worker as C
from switchml.protocol.address import Address
from switchml.protocol.kernels.layout import FP, ST

__all__ = ["FP", "FastPath", "ST", "available"]


def available() -> bool:
    """Whether the compiled loop can run: Linux (``recvmmsg``, ``sendmsg`` with UDP GSO)."""
    return sys.platform.startswith("linux")


class FastPath:
    """The compiled loop's fixed arguments for one worker socket and receiver: its socket,
    the inbox's wake-up pipe, the receiver's ``recvmmsg`` buffers (``struct mmsghdr``
    array, names, control messages, the batch arrays), and, for a sharded switch
    (``shards``: its S addresses, IPv4), where each lane's requests go (shard ``i mod S``)
    and whom results may come from (the socket is not connected: a datagram of anyone else
    goes back to Python, which drops and counts it)."""

    def __init__(self, sock: Any, rx: Any, wake_fd: int, *, max_segments: int,
                 max_bytes: int, shards: Sequence[Address] = ()) -> None:
        from switchml.transport.batching import SOL_UDP, UDP_GRO, sender_key, write_sockaddr
        self.dests = np.zeros((len(shards) if len(shards) > 1 else 0, 16), np.uint8)
        for i, (host, port) in enumerate(shards if len(shards) > 1 else ()):
            write_sockaddr(self.dests, i, host, port)
        self.allowed = np.array([sender_key(a) for a in shards] if len(shards) > 1 else [],
                                np.int64)
        self.fd = sock.fileno()
        self.wake_fd = wake_fd
        self.max_segments, self.max_bytes = max_segments, max_bytes
        self.stats = np.zeros(ST.N, np.int64)
        self._rx_args = (wake_fd, rx.fd_msgs_address, rx.count, rx._raw, rx._msg_len_at,
                         rx._controllen_at, rx._names, rx._control, rx.slot_bytes, int(rx.gro),
                         SOL_UDP, UDP_GRO, rx.buf, rx.starts, rx.lens, rx.senders)

    def run(self, op: Any, op_timeout_s: float) -> tuple[int, int, int, int]:
        """One call of the compiled loop for the operation in flight (its ``op.state``):
        ``(why, at, nseg, code)``. With ``FP.STOPPED``, the results kernel returned ``code``
        (``WS``) at datagram ``at`` of the ``nseg`` the last batch cut into (``starts``/
        ``lens``/``senders``): Python does what it asks
        (``WorkerEndpoint.after_results_kernel``) and goes on from there."""
        return C.pump(op.state, self.fd, self.max_segments, self.max_bytes, self.stats,
                      float(op_timeout_s), *self._rx_args, self.dests, self.allowed)

    def send(self, state: Any) -> bool:
        """Send an operation's queued requests (its ``kernels.OpState``: a worker's
        ``Transmit.compiled``) as the loop does (``plan_runs``, one ``sendmsg`` per GSO run),
        without the interpreter per run: what Python queued (an operation's first window as it
        starts, what its receive or timers released). False at a failed ``sendmsg``
        (``stats[ERRNO]``; the unsent lanes stay queued, in order, for Python's sender)."""
        return bool(C.send_queued(state, self.fd, self.max_segments, self.max_bytes,
                                  self.stats, self.dests, self.allowed))
