"""Run every compiled kernel once, in memory, so that numba compiles it (or loads it from its
cache) before an operation needs it: the switch's kernels alone (:func:`warm_switch`), a
worker's for chosen kinds of operation (:func:`warm_kinds`), a rack's (:func:`warm_tree`).

Sans-I/O like the rest of ``protocol/``: crafted datagrams between endpoints in memory, no
sockets and no files. When to call these, and numba's cache on disk, are
``transport/compiled.py``'s and ``switchml/warmup.py``'s.
"""

from __future__ import annotations

import numpy as np

from switchml.protocol.config import JobSpec
from switchml.protocol.endpoint import Batch, exchange
from switchml.protocol.events import OperationCompleted
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import (
    ElementType,
    Flags,
    Header,
    MessageType,
    operation_digest,
    pack_header,
)
from switchml.protocol.worker import WorkerEndpoint

__all__ = ["KINDS", "Kind", "kind_of", "warm_kinds", "warm_switch", "warm_tree", "warm_up"]

Kind = tuple[type, int, bool]
"""A kind of operation: (element type, bits on the wire, with a residual). Each kind is a
compiled specialisation of the worker's kernels."""

KINDS: tuple[Kind, ...] = (
    (np.float32, 32, False), (np.float64, 32, False), (np.int32, 32, False),
    (np.float16, 32, False), (np.float32, 16, True), (np.float64, 16, True),
    (np.float32, 16, False))
"""Every kind of operation a worker runs."""


def kind_of(dtype: np.dtype | type, bits: int = 32, residual: bool = False) -> Kind:
    """The kind an operation on ``dtype`` compiles as (a residual only with 16 bits)."""
    return (np.dtype(dtype).type, int(bits), bool(residual))


def _joined_pair(spec: JobSpec) -> tuple[WorkerEndpoint, dict]:
    addr, sw_addr = ("127.0.0.1", 1), ("127.0.0.1", 2)
    sw = SwitchDataplane()
    w = WorkerEndpoint(spec=spec, rank=0, switch_address=sw_addr)
    eps = {addr: w, sw_addr: sw}
    w.join(0.0)
    exchange(eps, 0.0)
    return w, eps


def warm_kinds(kinds: tuple[Kind, ...] = KINDS) -> None:
    """One tiny operation of each kind through a worker and a switch, in memory."""
    w, eps = _joined_pair(JobSpec(job_id=1, token=2, num_workers=1, window=2,
                                  elements_per_packet=4))
    w.receive_many(Batch.of_datagram(b"", ("127.0.0.1", 2)), 0.0)  # (the senders' check)
    for dtype, bits, residual in kinds:
        x = np.arange(10, dtype=dtype)
        out = np.empty_like(x)
        res = np.empty(x.size, dtype) if residual else None
        w.start_allreduce(x, out, 0.0, bits=bits, residual=res)
        exchange(eps, 0.0)
        while (ev := w.next_event()) is not None:
            if isinstance(ev, OperationCompleted):
                break


def request_for(w: WorkerEndpoint, k: int) -> bytes:
    """The first REQUEST of an int32 operation of ``k`` elements by joined worker ``w``,
    written by the wire module's packer (so that the switch's kernels run without compiling
    the worker's)."""
    spec = w.spec
    header = Header(type=MessageType.REQUEST, job=spec.job_id, rank=w.rank, token=spec.token,
                    seq=0, chunk=0, slot=w.slot_bases[0], set_bit=0, count=k,
                    elem=ElementType.INT32, flags=int(Flags.HAS_DATA),
                    digest=operation_digest(k, False, 32))
    return pack_header(header) + np.arange(k, dtype="<i4").tobytes()


def warm_switch() -> tuple[SwitchDataplane, WorkerEndpoint, bytes]:
    """The switch's kernels: a worker joins (control is Python), then one crafted request
    completes a round. Returns the switch, the worker and the request (the transports' own
    warm-up goes on with them)."""
    w, eps = _joined_pair(JobSpec(job_id=1, token=2, num_workers=1, window=2,
                                  elements_per_packet=4))
    sw = eps[("127.0.0.1", 2)]
    request = request_for(w, 4)
    sw.receive_many(Batch.of_datagram(request, ("127.0.0.1", 1))._replace(stable_senders=True),
                    0.0)
    sw.datagrams_to_send(0.0)
    return sw, w, request


def warm_tree() -> None:
    """One operation through a rack switch under a spine (the relay kernels)."""
    from switchml.protocol.tree import RackAggregator, tree_specs
    spine_addr, rack_addr, w_addr = ("127.0.0.1", 3), ("127.0.0.1", 4), ("127.0.0.1", 5)
    parent, child = tree_specs(JobSpec(job_id=3, token=4, num_workers=1, window=2,
                                       elements_per_packet=4), 1)
    spine = SwitchDataplane()
    rack = RackAggregator(parent_spec=parent, child_spec=child, rack=0,
                          parent_address=spine_addr)
    w = WorkerEndpoint(spec=child, rank=0, switch_address=rack_addr)
    eps = {spine_addr: spine, rack_addr: rack, w_addr: w}
    rack.join(0.0)
    w.join(0.0)
    x = np.arange(10, dtype=np.float32)
    started = False
    for _ in range(1000):
        moved = False
        for src, ep in eps.items():
            for data, dst in ep.datagrams_to_send(0.0):
                eps[dst].receive_datagram(bytes(data), src, 0.0)
                moved = True
        if not started and w.state.value == "ready":
            w.start_allreduce(x, np.empty_like(x), 0.0)
            started = True
        elif not moved:
            return


def warm_up() -> None:
    """Every kernel of the protocol, for every kind of operation."""
    warm_switch()
    warm_kinds(KINDS)
    warm_tree()
