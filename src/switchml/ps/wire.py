"""The parameter servers' framed TCP protocol: a fixed header, then ``nbytes`` of payload.

Every message is ``HEADER`` (big-endian: magic ``SMPS``, type, flags, worker, shard, step,
payload length) followed by the payload. Gradients and parameters travel as raw float32 in the
host's byte order (both ends are this package on the same kind of machine); Gaia's sparse
updates as int32 indices followed by float32 values. TCP gives order and reliability, so the
protocol has no sequence numbers: one request, at most one reply, per shard and step.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass
from enum import IntEnum

from switchml.protocol.errors import SwitchMLError

__all__ = ["CONTROL_PAYLOAD_BYTES", "HEADER", "MAX_PAYLOAD_BYTES", "Deadline", "Header",
           "MessageType",
           "PSError", "pack_header", "recv_header", "recv_message", "recv_payload",
           "send_message", "unpack_header"]

HEADER = struct.Struct("!4sBBHIIQ")
MAGIC = b"SMPS"
MAX_PAYLOAD_BYTES = 1 << 34
"""A header announcing more than this is garbage (16 GiB: far above any shard). Receivers
bound each message far lower, by what they expect (``recv_payload``'s ``limit``)."""
CONTROL_PAYLOAD_BYTES = 4096
"""The most a HELLO, PULL, STATS request, BYE or CLOCK may carry."""


class PSError(SwitchMLError):
    """A parameter server or worker failed, died, or broke the protocol; the message names it."""


class MessageType(IntEnum):
    HELLO = 1    # worker -> server: worker id in ``worker``, payload: JSON options
    INIT = 2     # worker -> server: initial values of a shard (the first one wins)
    PUSH = 3     # worker -> server: gradient of a shard for ``step``
    PULL = 4     # worker -> server: parameters of a shard once its version >= ``step``
    PARAMS = 5   # server -> worker: parameters of a shard; ``step`` is their version
    ERROR = 6    # either way: UTF-8 message; the connection is then closed
    STATS = 7    # worker -> server: ask for counters; server -> worker: JSON counters
    BYE = 8      # worker -> server: orderly goodbye (a close without it is a death)
    SPARSE = 9   # Gaia, data centre -> data centre: int32 indices + float32 values
    CLOCK = 10   # Gaia: the sender finished clock ``step`` (announce: ``flags`` = 1)


@dataclass(frozen=True, slots=True)
class Header:
    type: MessageType
    flags: int
    worker: int
    shard: int
    step: int
    nbytes: int


def pack_header(h: Header) -> bytes:
    return HEADER.pack(MAGIC, int(h.type), h.flags, h.worker, h.shard, h.step, h.nbytes)


def unpack_header(data: bytes) -> Header:
    """Parse a header; raises PSError on a bad magic, unknown type or absurd length."""
    magic, mtype, flags, worker, shard, step, nbytes = HEADER.unpack(data)
    if magic != MAGIC:
        raise PSError(f"bad magic {magic!r}: not a switchml parameter-server peer")
    try:
        kind = MessageType(mtype)
    except ValueError:
        raise PSError(f"unknown message type {mtype}") from None
    if nbytes > MAX_PAYLOAD_BYTES:
        raise PSError(f"payload of {nbytes} bytes announced; the limit is {MAX_PAYLOAD_BYTES}")
    return Header(kind, flags, worker, shard, step, nbytes)


def send_message(sock: socket.socket, mtype: MessageType, *, worker: int = 0, shard: int = 0,
                 step: int = 0, flags: int = 0, payload: bytes | memoryview = b"") -> int:
    """Write one message; returns the bytes written (header included)."""
    view = memoryview(payload).cast("B")
    head = pack_header(Header(mtype, flags, worker, shard, step, view.nbytes))
    if view.nbytes <= 65536:
        sock.sendall(head + view.tobytes())
    else:
        sock.sendall(head)
        sock.sendall(view)
    return HEADER.size + view.nbytes


class Deadline:
    """A socket whose receives are bounded together: each waits at most until ``deadline``
    (``time.monotonic()``), so a peer that dribbles a byte at a time cannot stretch a bound
    meant for a whole message (a socket's own timeout bounds each receive alone). It offers
    what the readers here use: ``recv_into``, which raises TimeoutError once the deadline
    has passed."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def recv_into(self, buf: memoryview) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline for this message passed")
        self.sock.settimeout(left)
        return self.sock.recv_into(buf)


def _recv_exact(sock: socket.socket | Deadline, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def recv_header(sock: socket.socket | Deadline) -> Header:
    """Read and check one message's header (the payload follows: :func:`recv_payload`)."""
    head = bytearray(HEADER.size)
    _recv_exact(sock, memoryview(head))
    return unpack_header(bytes(head))


def recv_payload(sock: socket.socket | Deadline, h: Header, into: memoryview | None = None,
                 *, limit: int = MAX_PAYLOAD_BYTES) -> memoryview:
    """Read the payload ``h`` announced, into ``into`` when given and large enough (no
    copy), else a fresh buffer. Raises PSError, before reading or allocating anything, when
    it announced more than ``limit`` bytes (a receiver bounds it by what it expects)."""
    if h.nbytes > limit:
        raise PSError(f"{h.type.name} of {h.nbytes} bytes announced; at most {limit} "
                      "expected here")
    if into is not None and into.nbytes >= h.nbytes:
        buf = into.cast("B")[:h.nbytes]
    else:
        buf = memoryview(bytearray(h.nbytes))
    _recv_exact(sock, buf)
    return buf


def recv_message(sock: socket.socket, into: memoryview | None = None, *,
                 limit: int = MAX_PAYLOAD_BYTES) -> tuple[Header, memoryview]:
    """Read one message (:func:`recv_header`, :func:`recv_payload`). Raises ConnectionError
    when the peer closed, socket.timeout when the socket's timeout expired, PSError on
    garbage or a payload above ``limit``."""
    h = recv_header(sock)
    return h, recv_payload(sock, h, into, limit=limit)
