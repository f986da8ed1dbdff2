"""Seeded loss injection around any endpoint, for tests and soak runs over real sockets.

:class:`LossyEndpoint` wraps an Endpoint (``protocol/endpoint.py``): each datagram it is given
and each one it returns is dropped with probability ``loss_rate``, drawn from its own
``random.Random(seed)``, so a run can be replayed. The pump drives the wrapper exactly as it
would the endpoint; nothing in the socket code knows about it. (The in-memory fabric has its
own fault model, ``transport.memory.FaultModel``, with duplication and reordering too.)
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from switchml.protocol.address import Address
from switchml.protocol.endpoint import Batch, Datagram, Endpoint, Transmit

__all__ = ["LossyEndpoint"]


class LossyEndpoint:
    """``inner``, losing a seeded fraction of the datagrams it receives and sends.

    Attributes of ``inner`` that the wrapper does not define (``state``, ``counters``,
    ``submit`` ...) are ``inner``'s own. ``injected_losses`` counts the drops, both ways.
    """

    def __init__(self, inner: Endpoint, loss_rate: float, seed: int = 0) -> None:
        if not 0.0 <= loss_rate < 1.0:
            raise ValueError(f"loss_rate must be in [0, 1), got {loss_rate}")
        self.inner = inner
        self.loss_rate = loss_rate
        self._rng = random.Random(seed)
        self.injected_losses = 0

    def _lost(self) -> bool:
        if self._rng.random() < self.loss_rate:
            self.injected_losses += 1
            return True
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def receive_datagram(self, data: Datagram, addr: Address, now: float) -> None:
        if not self._lost():
            self.inner.receive_datagram(data, addr, now)

    def receive_many(self, batch: Batch, now: float) -> None:
        count = batch.count
        keep = np.fromiter((not self._lost() for _ in range(count)), bool, count)
        if keep.any():
            self.inner.receive_many(Batch(batch.buf, batch.starts[:count][keep],
                                          batch.lens[:count][keep], batch.senders[:count][keep],
                                          int(keep.sum()), batch.address_of,
                                          batch.stable_senders, batch.sender), now)

    def handle_timer(self, now: float) -> None:
        self.inner.handle_timer(now)

    def datagrams_to_send(self, now: float) -> list[tuple[Datagram, Address]]:
        return [d for d in self.inner.datagrams_to_send(now) if not self._lost()]

    def poll_transmit(self, now: float, *, gso: tuple[int, int] | None = None,
                      compiled: bool = False) -> Transmit:
        """Losses are per datagram: every datagram goes out on its own (no GSO runs, nothing
        left to a compiled sender)."""
        return Transmit(self.datagrams_to_send(now), {}, [])

    def get_timer(self) -> float | None:
        return self.inner.get_timer()

    def next_event(self) -> Any:
        return self.inner.next_event()
