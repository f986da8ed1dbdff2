"""A worker takes datagrams from its switch (or the switch's shards) only.

The job's token travels in every datagram, so anyone who saw one can write a RESULT that passes
every check of the header. A worker of a sharded switch receives on an unconnected socket, and
such a forged RESULT, sent from any address, once made rank 0 return 666 while rank 1 returned
the true sum. Here: crafted forgeries, from a stranger's address, in the same batch as the
switch's own results and alone.
"""

from __future__ import annotations

import numpy as np

from switchml.protocol.config import JobSpec, SwitchConfig
from switchml.protocol.endpoint import Batch
from switchml.protocol.events import OperationCompleted
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import HEADER_SIZE, MessageType, unpack_header
from switchml.protocol.worker import WorkerEndpoint

W_ADDR, STRANGER = ("10.0.0.1", 5000), ("10.0.0.66", 48864)
SHARDS = [("10.0.0.2", 48864), ("10.0.0.3", 48864)]


def _forged(result: bytes) -> bytes:
    """The same RESULT with 666 in every element."""
    count = unpack_header(result).count
    return result[:HEADER_SIZE] + np.full(count, 666, "<i4").tobytes()


def _run(x: np.ndarray, deliver) -> tuple[WorkerEndpoint, np.ndarray]:
    """One rank of a one-rank job on two shards; ``deliver(worker, src, result)`` hands the
    worker each RESULT (everything else goes straight through)."""
    spec = JobSpec(job_id=7, token=0x1234, num_workers=1, window=4, elements_per_packet=16)
    w = WorkerEndpoint(spec=spec, rank=0, switch_address=SHARDS)
    eps = {W_ADDR: w, **{a: SwitchDataplane(SwitchConfig(shard_index=i, shard_count=2))
                         for i, a in enumerate(SHARDS)}}
    out = np.zeros_like(x)
    w.join(0.0)
    started = False
    for _ in range(1000):
        moved = False
        for src, ep in eps.items():
            for data, dst in ep.datagrams_to_send(0.0):
                moved = True
                data = bytes(data)
                if dst == W_ADDR and unpack_header(data).type is MessageType.RESULT:
                    deliver(w, src, data)
                else:
                    eps[dst].receive_datagram(data, src, 0.0)
        if not started and w.state.value == "ready":
            w.start_allreduce(x, out, 0.0)
            started = True
        elif not moved:
            break
    events = []
    while (ev := w.next_event()) is not None:
        events.append(ev)
    assert any(isinstance(e, OperationCompleted) for e in events), events
    return w, out


def test_a_forged_result_in_a_batch_with_the_switchs_own_is_dropped_and_counted() -> None:
    x = np.arange(100, dtype=np.int32)
    forged = []

    def deliver(w, src, result):
        forged.append(1)
        w.receive_many(Batch.of_pairs([(STRANGER, _forged(result)), (src, result)]), 0.0)

    w, out = _run(x, deliver)
    np.testing.assert_array_equal(out, x)  # one rank: the sum is its own input
    assert w.drops["foreign_sender"] == len(forged) > 0


def test_a_forged_result_alone_is_dropped_and_counted() -> None:
    x = np.arange(100, dtype=np.int32)
    forged = []

    def deliver(w, src, result):
        forged.append(1)
        w.receive_datagram(_forged(result), STRANGER, 0.0)  # first: it would win
        w.receive_many(Batch.of_datagram(_forged(result), STRANGER), 0.0)
        w.receive_datagram(result, src, 0.0)

    w, out = _run(x, deliver)
    np.testing.assert_array_equal(out, x)
    assert w.drops["foreign_sender"] == 2 * len(forged) > 0
