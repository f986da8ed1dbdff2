"""The floor of data movement: what moving switchml's bytes costs with no protocol at all.

Each worker moves the bytes of an all-reduce through a hub and back, in datagrams of
switchml's size for the MTU (a 40-byte header and the chunk's data), sent with UDP GSO
(``segments`` per call) and received with GRO, keeping ``window`` bytes in flight; the hub
echoes every GRO batch back to its sender with one GSO send. No aggregation, no number work,
no loss recovery (a receive that times out gives the window back: a floor, not a protocol).
Its CPU per element is the part of switchml's that no protocol can avoid on this kernel path;
``switchml bench allreduce --testbed --systems floor,switchml,gloo`` measures it beside
switchml and gloo (the system ``floor``), as ``shared/floor/floor.sh`` does by hand.
"""

from __future__ import annotations

import select
import socket
import sys
import time
from typing import Any

from switchml.transport.batching import MAX_GSO_BYTES, SOL_UDP, UDP_GRO, UDP_SEGMENT

__all__ = ["FLOOR_HEADER_BYTES", "hub", "worker"]

FLOOR_HEADER_BYTES = 40  # switchml's header


def _socket(rcvbuf: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        s.setsockopt(socket.SOL_SOCKET, opt, rcvbuf)
    s.setsockopt(SOL_UDP, UDP_GRO, 1)
    return s


def _gro_size(ancdata: list[tuple[int, int, bytes]], nbytes: int) -> int:
    for level, kind, data in ancdata:
        if level == SOL_UDP and kind == UDP_GRO:
            return int.from_bytes(data[:4] if len(data) >= 4 else data[:2], "little") or nbytes
    return nbytes


def hub(port: int, stop: Any = sys.stdin) -> int:
    """Echo every received batch to its sender (one GSO send per GRO batch) until ``stop``
    (a readable file: stdin) is readable or closed; returns the bytes echoed."""
    s = _socket(64 << 20)
    s.bind(("0.0.0.0", port))
    buf = bytearray(1 << 17)
    view = memoryview(buf)
    echoed = 0
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([s, stop], [], [], 1.0)
        if stop in ready:
            break
        if s not in ready:
            continue
        nbytes, anc, _, addr = s.recvmsg_into([buf], socket.CMSG_SPACE(4))
        seg = _gro_size(anc, nbytes)
        if nbytes > seg:
            s.sendmsg([view[:nbytes]], [(SOL_UDP, UDP_SEGMENT, seg.to_bytes(2, "little"))], 0,
                      addr)
        else:
            s.sendto(view[:nbytes], addr)
        echoed += nbytes
    s.close()
    return echoed


def worker(hub_addr: tuple[str, int], data_bytes: int, *, datagram_bytes: int,
           window_bytes: int, timeout_s: float = 2.0) -> dict[str, Any]:
    """Move ``data_bytes`` of data through the hub and back; returns the datagrams' count,
    the receive timeouts and the elapsed time."""
    s = _socket(32 << 20)
    s.connect(hub_addr)
    s.settimeout(timeout_s)
    per_call = max(1, min(64, MAX_GSO_BYTES // datagram_bytes))
    payload = bytes(datagram_bytes * per_call)
    seg_ctl = [(SOL_UDP, UDP_SEGMENT, datagram_bytes.to_bytes(2, "little"))]
    data = datagram_bytes - FLOOR_HEADER_BYTES
    total = -(-data_bytes // data) * datagram_bytes  # wire bytes that carry the data
    buf = bytearray(1 << 17)
    sent = got = timeouts = 0
    t0 = time.perf_counter()
    while got < total:
        while sent < total and sent - got < window_bytes:
            s.sendmsg([payload], seg_ctl)
            sent += len(payload)
        try:
            got += s.recv_into(buf)
        except TimeoutError:  # a drop: give the window back
            timeouts += 1
            got = sent
    s.close()
    return {"datagrams": total // datagram_bytes, "timeouts": timeouts,
            "elapsed_s": time.perf_counter() - t0}
