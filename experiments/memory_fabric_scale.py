"""Wall time of one exact 4 MB all-reduce through ``MemoryCluster`` against the number of
workers (the fabric's cost per event must not grow with n).

    python experiments/memory_fabric_scale.py --workers 16 64 256 [--json PATH]

Checks every rank's result against the float64 sum and prints one line per n.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from switchml.transport.memory import MemoryCluster


def run(n: int, elements: int) -> dict:
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(elements).astype(np.float32) for _ in range(n)]
    ref = np.sum(np.stack(xs).astype(np.float64), axis=0)
    c = MemoryCluster(num_workers=n)
    c.join()
    t0 = time.perf_counter()
    outs = c.allreduce(xs)
    wall = time.perf_counter() - t0
    err = max(float(np.max(np.abs(o - ref))) for o in outs)
    return {"workers": n, "elements": elements, "wall_s": wall, "virtual_s": c.fabric.now,
            "delivered": c.fabric.stats["delivered"], "max_abs_error": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--elements", type=int, default=1 << 20, help="float32 elements (4 MB)")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    rows = []
    for n in args.workers:
        row = run(n, args.elements)
        rows.append(row)
        print(f"n={n:5d}  wall {row['wall_s']:8.2f} s  deliveries {row['delivered']:,}  "
              f"{1e6 * row['wall_s'] / row['delivered']:.1f} us each  "
              f"max |error| {row['max_abs_error']:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
