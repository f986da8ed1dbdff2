"""Batched UDP system calls: GSO on send, GRO and recvmmsg on receive (Linux), with a plain
fallback.

A Python loop pays a few microseconds per system call, so small datagrams (the 1-9 KiB that
1500- and 9000-byte MTUs allow) are bounded by system calls, not by the network. Linux offers
three batching mechanisms:

* **UDP GSO** (``UDP_SEGMENT``, Linux 4.18): one ``sendmsg`` carries up to 64 equal-sized
  datagrams (the last may be shorter) to one destination, here as a list of buffers the kernel
  gathers; the kernel cuts them into datagrams.
* **UDP GRO** (``UDP_GRO``, Linux 5.0): a receiving socket may get several datagrams of one
  sender in one buffer, with the segment size in a control message, where the device
  coalesced them (a GSO run over loopback or a veth).
* **recvmmsg(2)**: every datagram queued at a socket, of any senders, in one call (through
  ``ctypes``: the standard library has no binding); each may be a GRO buffer.

:class:`BatchSender` sends runs of equal size with one system call each (``send_runs`` for
lists already grouped per destination); :class:`MultiReceiver` receives with recvmmsg, and
:func:`receive_segments` with one ``recvmsg`` where recvmmsg is missing. All degrade to one
datagram per call where the kernel refuses. Measured effect: docs/benchmarks.md and
docs/design.md ("Batched system calls, both ways").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import socket
import struct
import sys
from collections.abc import Iterator

import numpy as np

from switchml.protocol.address import Address
from switchml.protocol.kernels import gro_segments, split_mmsg
from switchml.protocol.wire import Datagram

__all__ = ["BatchSender", "MultiReceiver", "SegmentReceiver", "enable_gro", "gso_supported",
           "open_receiver", "receive_segments", "recvmmsg_supported", "segments",
           "sender_key", "write_sockaddr", "RECV_BUFFER_BYTES"]

log = logging.getLogger(__name__)

SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = 103  # linux/udp.h
UDP_GRO = 104
MAX_SEGMENTS = 64  # UDP_MAX_SEGMENTS in the kernel
MAX_GSO_BYTES = 65000  # payload bytes per GSO send (under the 65507-byte UDP limit)
BATCH_MAX_DATAGRAM = MAX_GSO_BYTES // 2  # larger datagrams can't share a send: sent alone
RECV_BUFFER_BYTES = 1 << 16  # a GRO buffer holds up to 64 KiB
_ANC_SPACE = socket.CMSG_SPACE(4)
_GSO_REFUSALS = {errno.EINVAL, errno.EIO, errno.EMSGSIZE, errno.EOPNOTSUPP}
_SEG = struct.Struct("=H")
_GRO_INT = struct.Struct("=i")


def gso_supported(sock: socket.socket) -> bool:
    """Whether ``sock`` accepts UDP_SEGMENT."""
    try:
        sock.setsockopt(SOL_UDP, UDP_SEGMENT, 0)  # 0 = no segmentation unless asked per send
        return True
    except OSError:
        return False


def enable_gro(sock: socket.socket) -> bool:
    """Ask for UDP GRO on ``sock``; returns whether the kernel allows."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
        return True
    except OSError:
        return False


def receive_segments(sock: socket.socket, buf: bytearray, view: memoryview
                     ) -> tuple[int, int, Address | None, bool]:
    """One ``recvmsg_into``: returns (bytes, segment size, sender, truncated).

    The datagrams are ``view[start:end]`` for each ``(start, end)`` of :func:`segments` (the
    last may be shorter); without GRO, ``seg == nbytes``. ``truncated``: the kernel cut the
    buffer (it did not fit ``buf``): drop it. Raises what ``recvmsg_into`` raises.
    """
    nbytes, ancdata, flags, addr = sock.recvmsg_into([buf], _ANC_SPACE)
    seg = nbytes
    for level, kind, data in ancdata:
        if level == SOL_UDP and kind == UDP_GRO:
            seg = (_GRO_INT.unpack(data[:4])[0] if len(data) >= 4
                   else _SEG.unpack(data[:2])[0])
    return nbytes, seg or nbytes, addr, bool(flags & socket.MSG_TRUNC)


def segments(nbytes: int, seg: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each datagram in a received buffer; an empty datagram is one (0, 0)
    (it still reaches the endpoint, which counts it as malformed)."""
    if not nbytes:
        yield 0, 0
        return
    for off in range(0, nbytes, seg):
        yield off, min(off + seg, nbytes)


class BatchSender:
    """Queue datagrams, then send them grouped: one ``sendmsg`` per run of equal size.

    ``connected``: the socket is connected (a worker's): destinations are ignored. Datagrams
    larger than half a GSO buffer are sent at once (nothing to batch them with); smaller ones
    are queued *by reference* until :meth:`flush`, which hands the kernel the list of buffers
    (``sendmsg`` gathers them: no copy in Python). So a queued buffer must not change before
    ``flush``: the endpoints' buffers (slot memory, a worker lane's transmit buffer) stay valid
    until their next receive, and the pumps flush before that. Without GSO every datagram is
    sent at once.

    Counters: ``calls`` (system calls made), ``datagrams``, ``errors`` (send failures, each
    a lost datagram: retransmission recovers), ``blocked`` (the socket buffer was full),
    ``refused`` (ICMP port unreachable reported on a connected socket).
    """

    def __init__(self, sock: socket.socket, *, gso: bool, connected: bool = False,
                 raise_errors: bool = False) -> None:
        self.sock = sock
        self.gso = gso
        self.connected = connected
        self.raise_errors = raise_errors
        """Re-raise send errors other than a full buffer or ICMP port unreachable (a worker:
        e.g. ENETUNREACH should fail at once, not by timeout); else count them."""
        self._queue: dict[Address | None, list[Datagram]] = {}
        self.calls = 0
        self.datagrams = 0
        self.errors = 0
        self.blocked = 0
        self.refused = 0

    def add(self, data: Datagram, addr: Address | None) -> None:
        if not self.gso or len(data) > BATCH_MAX_DATAGRAM:
            self._send_one(data, addr)
            return
        key = None if self.connected else addr
        q = self._queue.get(key)
        if q is None:
            self._queue[key] = [data]
        else:
            q.append(data)

    def flush(self) -> None:
        if not self._queue:
            return
        queued, self._queue = self._queue, {}
        for addr, datagrams in queued.items():
            i, total = 0, len(datagrams)
            while i < total:
                size = len(datagrams[i])
                j = i + 1
                limit = min(total, i + MAX_SEGMENTS, i + max(1, MAX_GSO_BYTES // max(size, 1)))
                while j < limit and len(datagrams[j]) == size:
                    j += 1
                # A shorter datagram may end a run (the kernel allows a short last segment).
                if j < total and j < limit and len(datagrams[j]) < size:
                    j += 1
                if j - i == 1 or not self.gso:  # GSO may have been turned off meanwhile
                    for d in datagrams[i:j]:
                        self._send_one(d, addr)
                else:
                    self._send_run(datagrams[i:j], size, addr)
                i = j

    def send_runs(self, runs: dict[Address, list[memoryview]]) -> None:
        """Send datagrams grouped per destination (each list in order), after what is queued.

        The common case, every datagram of a list the same size, costs no Python per
        datagram: the list is cut into GSO runs of up to 64 by slicing."""
        self.flush()
        for addr, datagrams in runs.items():
            n = len(datagrams)
            if not n:
                continue
            size = len(datagrams[0])
            if (not self.gso or size > BATCH_MAX_DATAGRAM
                    or len(set(map(len, datagrams))) != 1):
                for d in datagrams:
                    self.add(d, addr)
                self.flush()
                continue
            step = min(MAX_SEGMENTS, max(1, MAX_GSO_BYTES // size))
            for i in range(0, n, step):
                run = datagrams[i:i + step]
                if len(run) == 1:
                    self._send_one(run[0], addr)
                else:
                    self._send_run(run, size, addr)
                if not self.gso:  # the path refused GSO: the rest one by one
                    for d in datagrams[i + step:]:
                        self._send_one(d, addr)
                    break

    def send_run(self, buffers: list[Datagram], size: int,
                 addr: Address | None) -> None:
        """Send one GSO run, after what is queued: ``buffers``, gathered, are datagrams of
        ``size`` bytes (the last may be shorter), at most 64 and ``MAX_GSO_BYTES`` in all
        (``poll_transmit`` plans them so). One datagram, or no GSO: sent one
        by one."""
        self.flush()
        if len(buffers) == 1 and len(buffers[0]) <= size:
            self._send_one(buffers[0], addr)
        elif self.gso:
            self._send_run(buffers, size, addr)
        else:
            for d in _cut(buffers, size):
                self._send_one(d, addr)

    def _send_one(self, data: Datagram, addr: Address | None) -> None:
        self.calls += 1
        self.datagrams += 1
        try:
            if self.connected or addr is None:
                self.sock.send(data)
            else:
                self.sock.sendto(data, addr)
        except BlockingIOError:
            self.blocked += 1
        except ConnectionRefusedError:
            self.refused += 1
        except OSError:
            if self.raise_errors:
                raise
            self.errors += 1

    def _send_run(self, run: list[Datagram], size: int,
                  addr: Address | None) -> None:
        """One ``sendmsg`` with UDP_SEGMENT: ``run``'s buffers, gathered, cut into datagrams
        of ``size`` bytes by the kernel."""
        count = _count(run, size)
        self.calls += 1
        self.datagrams += count
        anc = [(SOL_UDP, UDP_SEGMENT, _SEG.pack(size))]
        try:
            if self.connected or addr is None:
                self.sock.sendmsg(run, anc)
            else:
                self.sock.sendmsg(run, anc, 0, addr)
        except BlockingIOError:
            self.blocked += count
        except ConnectionRefusedError:
            self.refused += 1
        except OSError as exc:
            if exc.errno not in _GSO_REFUSALS:
                if self.raise_errors:
                    raise
                self.errors += count
                return
            # The path refused segmentation (a device without it): send plainly from now on.
            log.warning("UDP GSO send failed (%s); sending one datagram per call from now on",
                        exc)
            self.gso = False
            self.calls -= 1
            self.datagrams -= count
            for d in _cut(run, size):
                self._send_one(d, addr)


def _count(buffers: list[Datagram], size: int) -> int:
    """How many datagrams of ``size`` bytes the buffers hold (each buffer whole datagrams,
    the last datagram of each possibly shorter)."""
    if len(buffers) == 1:  # a planned contiguous run (the common case): no generator
        return -(-len(buffers[0]) // size) if size else 1
    return sum(-(-len(b) // size) for b in buffers) if size else len(buffers)


def _cut(buffers: list[Datagram], size: int
         ) -> Iterator[Datagram]:
    """The datagrams of a GSO run, one by one (views, no copies)."""
    for b in buffers:
        if len(b) <= size:
            yield b
            continue
        view = memoryview(b)
        for off in range(0, len(view), size):
            yield view[off:off + size]


# -- recvmmsg: many datagrams of many senders per system call ---------------------------------

class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.c_void_p), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


MSG_WAITFORONE = 0x10000
_SLOT_BYTES = 1 << 16  # any UDP datagram fits
_LIBC = None


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.recvmmsg.restype = ctypes.c_int
            lib.recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int,
                                     ctypes.c_void_p]
            _LIBC = lib
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC or None


def recvmmsg_supported() -> bool:
    """Whether this platform's C library has ``recvmmsg`` (Linux)."""
    return sys.platform.startswith("linux") and _libc() is not None


class MultiReceiver:
    """``recvmmsg(2)`` through ctypes: up to ``count`` buffers, of any senders, per call, each
    a datagram or a UDP GRO buffer of several.

    GRO merges only datagrams that the network device coalesced (a GSO run over loopback or a
    veth); datagrams that queue up at a socket one by one (a receiver that fell behind a paced
    link) still cost one ``recvmsg`` each. ``recvmmsg`` takes whatever is queued in one call,
    so the busier a pump gets, the fewer system calls it makes per datagram. The datagrams land
    in one preallocated buffer: after :meth:`receive` returned ``n`` datagrams, datagram ``i``
    is ``buf[starts[i] : starts[i] + lens[i]]`` and ``senders[i]`` numbers its source address
    (``address_of`` turns the number back into ``(host, port)``). IPv4 only.
    """

    def __init__(self, sock: socket.socket, count: int = MAX_SEGMENTS) -> None:
        lib = _libc()
        if lib is None:
            raise OSError("recvmmsg is not available")
        self._lib = lib
        self.sock = sock
        self.count = count
        self.buf = np.zeros(count * _SLOT_BYTES, np.uint8)
        self._names = np.zeros((count, 16), np.uint8)
        self._control = np.zeros((count, _ANC_SPACE), np.uint8)
        self.gro = enable_gro(sock)
        self._iovs = (_Iovec * count)()
        self._msgs = (_Mmsghdr * count)()
        base, names = self.buf.ctypes.data, self._names.ctypes.data
        for i in range(count):
            self._iovs[i].iov_base = base + i * _SLOT_BYTES
            self._iovs[i].iov_len = _SLOT_BYTES
            hdr = self._msgs[i].msg_hdr
            hdr.msg_name = names + 16 * i
            hdr.msg_namelen = 16
            hdr.msg_iov = ctypes.addressof(self._iovs[i])
            hdr.msg_iovlen = 1
            if self.gro:
                hdr.msg_control = self._control.ctypes.data + _ANC_SPACE * i
        self._raw = np.frombuffer(self._msgs, np.uint8).reshape(count, ctypes.sizeof(_Mmsghdr))
        self._msg_len_at = _Mmsghdr.msg_len.offset
        self._controllen_at = _Msghdr.msg_controllen.offset
        self._raw[:, self._controllen_at:self._controllen_at + 8].view(np.uint64)[:] = (
            _ANC_SPACE if self.gro else 0)
        limit = count * MAX_SEGMENTS  # a GRO buffer holds at most 64 datagrams
        self.starts = np.zeros(limit, np.int64)
        self.lens = np.zeros(limit, np.int64)
        self.senders = np.zeros(limit, np.int64)
        self._addresses: dict[int, Address] = {}
        self.truncated = 0  # (a 64 KiB buffer holds any datagram: always 0)
        self.drained = False
        """The last call took fewer buffers than it had room for: the socket was empty then
        (a caller need not ask again before waiting)."""
        self.fd_msgs_address = ctypes.addressof(self._msgs)  # for the compiled loop
        self.slot_bytes = _SLOT_BYTES

    def receive(self, *, block: bool = False) -> int:
        """Receive up to ``count`` datagrams; return how many (0: none was waiting).

        ``block``: wait for the first one (``MSG_WAITFORONE``), then take what is queued.
        Raises ``ConnectionRefusedError`` (ICMP port unreachable on a connected socket) and
        other ``OSError`` as ``recvmsg`` would."""
        flags = MSG_WAITFORONE if block else socket.MSG_DONTWAIT
        while True:
            n = self._lib.recvmmsg(self.sock.fileno(), self._msgs, self.count, flags, None)
            if n >= 0:
                break
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return 0
            raise OSError(err, os.strerror(err)) if err != errno.ECONNREFUSED else \
                ConnectionRefusedError(err, os.strerror(err))
        self.drained = n < self.count
        if n == 0:
            return 0
        return int(split_mmsg(self._raw, self._msg_len_at, self._controllen_at, self._names,
                              self._control, n, _SLOT_BYTES, self.gro, SOL_UDP, UDP_GRO,
                              self.starts, self.lens, self.senders))

    def address_of(self, key: int) -> Address:
        """The ``(host, port)`` of a sender number."""
        addr = self._addresses.get(key)
        if addr is None:
            if len(self._addresses) > 65536:  # anyone can send: keep the cache bounded
                self._addresses.clear()
            addr = (socket.inet_ntoa((key >> 16).to_bytes(4, "big")), key & 0xFFFF)
            self._addresses[key] = addr
        return addr


def sender_key(address: Address) -> int:
    """The sender number ``split_mmsg`` gives a datagram from ``address`` (IPv4 ``host``,
    ``port``): the address, big-endian, above the port; :meth:`MultiReceiver.address_of`
    inverts it."""
    host, port = address
    return int.from_bytes(socket.inet_aton(host), "big") << 16 | port


def write_sockaddr(names: np.ndarray, i: int, host: str, port: int) -> None:
    """Row ``i`` of ``names`` (uint8, 16 columns) as the ``struct sockaddr_in`` of ``host``
    (IPv4) and ``port``, for a compiled ``sendmsg``."""
    names[i, 0:2] = (socket.AF_INET, 0)  # sin_family, little-endian
    names[i, 2:4] = (port >> 8, port & 0xFF)  # network order
    names[i, 4:8] = np.frombuffer(socket.inet_aton(host), np.uint8)
    names[i, 8:16] = 0


class SegmentReceiver:
    """:class:`MultiReceiver`'s interface where ``recvmmsg`` is missing (or batching is off):
    one ``recvmsg`` per call, which may bring a UDP GRO buffer of several datagrams of one
    sender. ``truncated`` counts buffers the kernel had to cut (dropped: larger than any
    datagram of the protocol)."""

    def __init__(self, sock: socket.socket, *, gro: bool) -> None:
        self.sock = sock
        self.gro = gro and enable_gro(sock)
        self._raw = bytearray(RECV_BUFFER_BYTES)
        self._view = memoryview(self._raw)
        self.buf = np.frombuffer(self._raw, np.uint8)
        self.starts = np.zeros(MAX_SEGMENTS, np.int64)
        self.lens = np.zeros(MAX_SEGMENTS, np.int64)
        self.senders = np.zeros(MAX_SEGMENTS, np.int64)
        self.truncated = 0
        self.drained = False  # one recvmsg says nothing about what is left
        self._addr: Address = ("", 0)

    def receive(self, *, block: bool = False) -> int:
        """One buffer's datagrams; 0 if none is waiting (a non-blocking socket) or it was
        truncated. ``block`` is the socket's own mode. Raises what ``recvmsg`` raises."""
        try:
            nbytes, seg, addr, truncated = receive_segments(self.sock, self._raw, self._view)
        except BlockingIOError:
            return 0
        if truncated:
            self.truncated += 1
            return 0
        self._addr = addr
        if nbytes == 0:  # an empty datagram is one (malformed) datagram
            self.starts[0] = self.lens[0] = 0
            return 1
        return int(gro_segments(nbytes, seg, self.starts, self.lens))

    def address_of(self, key: int) -> Address:
        """The sender of the last buffer (all its datagrams have one)."""
        return self._addr


def open_receiver(sock: socket.socket, *, batching: bool) -> MultiReceiver | SegmentReceiver:
    """The best receiver this platform offers for ``sock``: ``recvmmsg`` (each buffer may be a
    GRO buffer) where batching is on and it exists, else one ``recvmsg`` per call (with GRO
    where batching is on)."""
    if batching and recvmmsg_supported():
        return MultiReceiver(sock)
    return SegmentReceiver(sock, gro=batching)
