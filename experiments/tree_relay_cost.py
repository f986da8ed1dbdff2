"""CPU cost per round of a rack switch (``protocol.tree.RackAggregator``) against a flat
switch, in process, without sockets.

Two racks of ``--workers`` workers under a spine, and one flat switch with the same workers,
run the same all-reduce on the in-memory fabric; the time spent inside the rack's (and the flat
switch's) endpoint calls is divided by the rounds (slots completed) each handled. A round at a
rack is ``n`` child requests in, one request up, one parent result in, ``n`` results out; at the
flat switch ``n`` requests in, ``n`` results out. Cited in docs/benchmarks.md.

    python experiments/tree_relay_cost.py --workers 4 --mib 16
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from switchml.sim.cluster import TreeCluster
from switchml.transport.memory import MemoryCluster, MemoryFabric


class Timed:
    """An endpoint whose calls are timed (``seconds``); everything else passes through."""

    _TIMED = ("receive_datagram", "receive_many", "handle_timer",
              "datagrams_to_send", "output_runs", "next_event", "get_timer")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self._TIMED:
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def _inputs(n: int, elements: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal(elements).astype(np.float32) for _ in range(n)]


def tree_cost(workers: int, elements: int, k: int, window: int) -> dict[str, float]:
    fabric = MemoryFabric()
    t = TreeCluster(fabric, racks=2, workers_per_rack=workers, window=window,
                    elements_per_packet=k)
    timed = [Timed(r) for r in t.racks]
    for a, tr in zip(t.rack_addresses, timed):
        fabric.endpoints[a] = tr  # the same endpoint, timed
    t.join()
    for tr in timed:
        tr.seconds = 0.0
    outs = t.allreduce(_inputs(2 * workers, elements))
    assert all(np.array_equal(o, outs[0]) for o in outs)
    rounds = sum(r.counters["parent_results"] for r in t.racks)
    return {"rack_us_per_round": 1e6 * sum(tr.seconds for tr in timed) / rounds,
            "rounds": rounds}


def flat_cost(workers: int, elements: int, k: int, window: int) -> dict[str, float]:
    c = MemoryCluster(num_workers=workers, window=window, elements_per_packet=k)
    timed = Timed(c.switch)
    c.fabric.endpoints[c.SWITCH] = timed
    c.join()
    timed.seconds = 0.0
    c.allreduce(_inputs(workers, elements))
    rounds = c.switch.results_multicast
    return {"switch_us_per_round": 1e6 * timed.seconds / rounds, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="workers per rack (default 4)")
    ap.add_argument("--mib", type=int, default=16, help="MiB per all-reduce (default 16)")
    ap.add_argument("--elements-per-packet", type=int, default=358)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the figures to this file")
    a = ap.parse_args()
    elements = a.mib * 2**20 // 4
    rows = []
    for _ in range(a.repeat):
        row = {**tree_cost(a.workers, elements, a.elements_per_packet, a.window),
               **flat_cost(a.workers, elements, a.elements_per_packet, a.window)}
        row["ratio"] = row["rack_us_per_round"] / row["switch_us_per_round"]
        rows.append(row)
        print(f"rack {row['rack_us_per_round']:.1f} us/round, flat switch "
              f"{row['switch_us_per_round']:.1f} us/round ({row['ratio']:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
