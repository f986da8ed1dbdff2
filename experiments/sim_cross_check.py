"""Timing mode against exact mode (the real endpoints) on the same simulated links.

    python experiments/sim_cross_check.py [--loss-only]

Prints one line per configuration: completion time in both modes, their ratio, and the
retransmissions each counted (docs/simulator.md, "Timing mode against exact mode").
"""

from __future__ import annotations

import argparse

from switchml.sim.config import SimConfig, SimLink, Stragglers
from switchml.sim.exact import run_exact
from switchml.sim.timing import run_timing

MIB = 1 << 20
CLEAN = [
    ("star n=4", dict(workers=4, size_bytes=2 * MIB)),
    ("star n=3, 400 Mbit/s", dict(workers=3, size_bytes=2 * MIB, access=SimLink(rate_bps=4e8))),
    ("tree 2x4", dict(workers=8, racks=2, size_bytes=2 * MIB)),
    ("straggler 2x, 2 ms late", dict(workers=4, size_bytes=2 * MIB,
                                     stragglers=Stragglers(1, 2.0, 0.002))),
    ("200 us links, no host cost", dict(workers=4, size_bytes=2 * MIB,
                                        access=SimLink(delay_s=200e-6), host_cost_s=0.0)),
    ("MTU 9000", dict(workers=4, size_bytes=2 * MIB, mtu=9000)),
]
LOSSY = [
    ("n=4, 0.1%, 4 MiB", dict(workers=4, size_bytes=4 * MIB, access=SimLink(loss_rate=0.001))),
    ("n=16, 0.1%, 1 MiB", dict(workers=16, size_bytes=MIB, access=SimLink(loss_rate=0.001))),
    ("n=64, 0.1%, 1 MiB", dict(workers=64, size_bytes=MIB, access=SimLink(loss_rate=0.001))),
    ("n=64, 1%, 1 MiB", dict(workers=64, size_bytes=MIB, access=SimLink(loss_rate=0.01))),
    ("tree 8x8, 1%, 1 MiB", dict(workers=64, racks=8, size_bytes=MIB,
                                 access=SimLink(loss_rate=0.01))),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loss-only", action="store_true")
    args = ap.parse_args()
    cases = LOSSY if args.loss_only else CLEAN + LOSSY
    for name, kw in cases:
        c = SimConfig(seed=1, **kw)
        t, e = run_timing(c), run_exact(c)
        print(f"{name:28} timing {t.elapsed_s * 1e3:9.2f} ms  exact {e.elapsed_s * 1e3:9.2f} ms"
              f"  timing/exact {t.elapsed_s / e.elapsed_s:6.3f}  re-sends {t.retransmissions}"
              f"+{t.rack_retransmissions} / {e.retransmissions}+{e.rack_retransmissions}"
              f"  exact ok={e.ok}", flush=True)


if __name__ == "__main__":
    main()
