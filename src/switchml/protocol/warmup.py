"""Compile (or load from numba's cache) every kernel for the types switchml uses.

The first process on a fresh install compiles the kernels (about half a minute on a 2-core
machine) and caches them next to the source; every later process loads them in well under a
second. Run ``python -m switchml.protocol.warmup`` once after installing (``.ci/run`` and the
README's set-up do), so that no operation waits for the compiler.
"""

from __future__ import annotations

import numpy as np

from switchml.protocol.config import JobSpec
from switchml.protocol.events import OperationCompleted
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.worker import WorkerEndpoint

__all__ = ["warm_up"]


def _pump(sw: SwitchDataplane, w: WorkerEndpoint, addr: tuple[str, int], sw_addr: tuple[str, int],
          now: float) -> None:
    for _ in range(1000):
        moved = False
        for data, _dst in w.datagrams_to_send(now):
            sw.receive_datagram(bytes(data), addr, now)
            moved = True
        for data, _dst in sw.datagrams_to_send(now):
            w.receive_datagram(bytes(data), sw_addr, now)
            moved = True
        if not moved:
            return


def warm_up() -> None:
    """Run one tiny operation of every kind through a switch and a worker, in memory."""
    addr, sw_addr = ("127.0.0.1", 1), ("127.0.0.1", 2)
    sw = SwitchDataplane()
    spec = JobSpec(job_id=1, token=2, num_workers=1, window=2, elements_per_packet=4)
    w = WorkerEndpoint(spec=spec, rank=0, switch_address=sw_addr)
    w.join(0.0)
    _pump(sw, w, addr, sw_addr, 0.0)
    for dtype, bits, residual in ((np.float32, 32, False), (np.float64, 32, False),
                                  (np.int32, 32, False), (np.float16, 32, False),
                                  (np.float32, 16, True), (np.float64, 16, True),
                                  (np.float32, 16, False)):
        x = np.arange(10, dtype=dtype)
        out = np.empty_like(x)
        res = np.empty(x.size, dtype) if residual else None
        w.start_allreduce(x, out, 0.0, bits=bits, residual=res)
        _pump(sw, w, addr, sw_addr, 0.0)
        while (ev := w.next_event()) is not None:
            if isinstance(ev, OperationCompleted):
                break


if __name__ == "__main__":
    warm_up()
    print("switchml kernels compiled and cached")
