"""The Endpoint contract, and the one helper that hands a batch of datagrams to any endpoint.

Every sans-I/O object that a driver pumps (the switch, a rack switch of a tree, a worker, a
worker session, a fault-injecting wrapper) offers the same methods, so that one pump serves
the UDP transports, the in-memory fabric, the simulator and the tests:

* ``receive_datagram(data, addr, now)``: one datagram.
* ``receive_batch(buf, nbytes, seg, addr, now)``: the datagrams ``buf[i*seg : (i+1)*seg]`` of
  one sender (a GRO buffer; ``seg = nbytes`` for one datagram).
* ``receive_many(buf, starts, lens, senders, count, address_of, now)``: ``count`` datagrams
  ``buf[starts[i] : starts[i] + lens[i]]`` of several senders (``recvmmsg``): ``senders[i]``
  numbers the sender and ``address_of`` turns the number into its address.
* ``handle_timer(now)``: the deadline from ``get_timer`` has passed.
* then, after any of these and after any user command that takes ``now``: drain
  ``datagrams_to_send(now)`` (send each, in order) and ``next_event()`` (until None), and re-arm
  the timer from ``get_timer()`` (absolute time, or None).
* a UDP transport with GSO may drain with ``runs_to_send(now, max_segments=, max_bytes=)``
  instead, where an endpoint offers it (the worker, its session, the switch): the same
  datagrams as ``datagrams_to_send``, in the same order per destination, planned into GSO runs
  by a kernel (no Python object per datagram).

Peer input never raises: what is malformed or foreign is dropped and counted. Datagrams
returned by ``datagrams_to_send`` may be views of the endpoint's own buffers, valid until its
next receive call: a driver that keeps them longer copies them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from switchml.protocol.address import Address

__all__ = ["Datagram", "Endpoint", "deliver_datagrams", "exchange", "flatten_runs"]

Datagram = bytes | bytearray | memoryview
"""What an endpoint takes and returns: bytes, or a view of a buffer."""


class Endpoint(Protocol):
    """What a driver needs of a sans-I/O endpoint (module docstring)."""

    def receive_datagram(self, data: Datagram, addr: Address, now: float) -> None: ...

    def receive_batch(self, buf: np.ndarray, nbytes: int, seg: int, addr: Address,
                      now: float) -> None: ...

    def receive_many(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                     senders: np.ndarray, count: int, address_of: Callable[[int], Address],
                     now: float) -> None: ...

    def handle_timer(self, now: float) -> None: ...

    def datagrams_to_send(self, now: float) -> Sequence[tuple[Datagram, Address]]: ...

    def get_timer(self) -> float | None: ...

    def next_event(self) -> Any: ...


def flatten_runs(out: list[tuple[Datagram, Address]],
                 runs: dict[Address, list[memoryview]]) -> list[tuple[Datagram, Address]]:
    """``datagrams_to_send`` from an ``output_runs`` pair (the switch's and a rack switch's:
    replies in order, then each destination's run): ``out`` extended with the runs."""
    for addr, run in runs.items():
        out.extend((d, addr) for d in run)
    return out


def deliver_datagrams(ep: Endpoint, batch: Sequence[tuple[Address, Datagram]],
                      now: float) -> None:
    """Hand ``batch`` (``(sender, datagram)`` pairs, in order) to ``ep`` in one
    ``receive_many`` call, as a host's ``recvmmsg`` would: the in-memory fabric's and the
    simulator's way of delivering what arrives at one instant."""
    if len(batch) == 1:
        src, payload = batch[0]
        ep.receive_datagram(payload, src, now)
        return
    lens = np.fromiter((len(p) for _, p in batch), np.int64, len(batch))
    starts = np.zeros(len(batch), np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    buf = np.frombuffer(bytearray(b"".join(p for _, p in batch)), np.uint8)  # writable
    addrs: list[Address] = []
    index: dict[Address, int] = {}
    senders = np.empty(len(batch), np.int64)
    for i, (src, _) in enumerate(batch):
        j = index.get(src)
        if j is None:
            j = index[src] = len(addrs)
            addrs.append(src)
        senders[i] = j
    ep.receive_many(buf, starts, lens, senders, len(batch), addrs.__getitem__, now)


def exchange(endpoints: Mapping[Address, Endpoint], now: float, *, max_rounds: int = 1000
             ) -> int:
    """Deliver what ``endpoints`` (by address) send one another, at one instant with no loss,
    until nothing moves (or ``max_rounds``): e.g. a worker's JOIN, the switch's CHALLENGE,
    the proven JOIN and JOINED. Datagrams to an address not in ``endpoints`` are dropped.
    Returns how many were delivered. For warm-ups, tools and tests; the in-memory fabric
    (``transport/memory.py``) adds delay, loss and timers."""
    delivered = 0
    for _ in range(max_rounds):
        moved = 0
        for src, ep in endpoints.items():
            for data, dst in ep.datagrams_to_send(now):
                peer = endpoints.get(dst)
                if peer is not None:
                    peer.receive_datagram(bytes(data), src, now)
                    moved += 1
        delivered += moved
        if not moved:
            break
    return delivered
