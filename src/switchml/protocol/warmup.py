"""Compile (or load from numba's cache) every kernel for the types switchml uses.

The first process on a fresh install compiles the kernels (about half a minute on a 2-core
machine) and caches them next to the source; every later process loads them in well under a
second. Run ``python -m switchml.protocol.warmup`` once after installing (``.ci/run`` and the
README's set-up do), so that no operation waits for the compiler.

Numba's cache is keyed on each kernel's own source file, not on the kernels it calls in the
package's other files: a change to ``kernels/frames.py`` would leave ``kernels/aggregate.py``'s
cached code stale. :func:`clear_stale_cache` keeps a digest of every kernel source next to the
cache and removes the package's cached kernels when it differs; :func:`warm_up` calls it first.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from switchml.protocol.config import JobSpec
from switchml.protocol.endpoint import exchange
from switchml.protocol.events import OperationCompleted
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.worker import WorkerEndpoint

__all__ = ["KERNEL_SOURCES", "KINDS", "clear_stale", "clear_stale_cache", "warm_up"]

_KERNELS = Path(__file__).resolve().parent / "kernels"


KERNEL_SOURCES = sorted(_KERNELS.glob("*.py"))
"""The kernels' sources: a kernel elsewhere that calls them (``transport/fastpath.py``) is
stale when any of them changed."""


KINDS: tuple[tuple[type, int, bool], ...] = (
    (np.float32, 32, False), (np.float64, 32, False), (np.int32, 32, False),
    (np.float16, 32, False), (np.float32, 16, True), (np.float64, 16, True),
    (np.float32, 16, False))
"""Every kind of operation a worker runs: (element type, bits on the wire, with a residual)."""


def clear_stale(sources: list[Path], cache: Path, prefix: str = "", stamp_name: str = "") -> bool:
    """Remove the numba cache files ``cache/<prefix>*.nbi|nbc`` if any of ``sources`` changed
    since they were written (returns whether it did). Only the cache next to the sources
    (numba's default) is looked at; nothing happens where that folder is not writable."""
    digest = hashlib.sha256()
    for src in sources:
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    stamp = cache / (stamp_name or "kernel-sources.sha256")
    try:
        if stamp.exists() and stamp.read_text() == digest.hexdigest():
            return False
        cleared = False
        for f in [*cache.glob(f"{prefix}*.nbi"), *cache.glob(f"{prefix}*.nbc")]:
            f.unlink()
            cleared = True
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest.hexdigest())
        return cleared
    except OSError:
        return False


def clear_stale_cache() -> bool:
    """Remove the kernels' numba cache if any kernel source changed since it was written."""
    return clear_stale(KERNEL_SOURCES, _KERNELS / "__pycache__")


def warm_up() -> None:
    """Run one tiny operation of every kind through a switch and a worker, in memory (after
    clearing a stale cache)."""
    clear_stale_cache()
    addr, sw_addr = ("127.0.0.1", 1), ("127.0.0.1", 2)
    sw = SwitchDataplane()
    spec = JobSpec(job_id=1, token=2, num_workers=1, window=2, elements_per_packet=4)
    w = WorkerEndpoint(spec=spec, rank=0, switch_address=sw_addr)
    eps = {addr: w, sw_addr: sw}
    w.join(0.0)
    exchange(eps, 0.0)
    for dtype, bits, residual in KINDS:
        x = np.arange(10, dtype=dtype)
        out = np.empty_like(x)
        res = np.empty(x.size, dtype) if residual else None
        w.start_allreduce(x, out, 0.0, bits=bits, residual=res)
        exchange(eps, 0.0)
        while (ev := w.next_event()) is not None:
            if isinstance(ev, OperationCompleted):
                break
    _warm_tree()


def _warm_tree() -> None:
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


if __name__ == "__main__":
    warm_up()
    print("switchml kernels compiled and cached")
