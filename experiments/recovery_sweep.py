"""Loss recovery in the exact simulator: ATE/s, re-sends by kind and NACKs against the link
rate, the timeout's floor in round trips, the minimum timeout and the seed.

n = 4 workers all-reduce 16 MiB at MTU 1500 over links with the same loss each way, through
the real worker and switch objects (``switchml sim --mode exact``), with settings the CLI does
not expose. Cited in docs/benchmarks.md ("Loss", what changed):

    python experiments/recovery_sweep.py --rate 200 --srtts 1 3 --min-rto-ms 20
    python experiments/recovery_sweep.py --rate 200 300 1000 --seeds 0 1 2
"""

from __future__ import annotations

import argparse

from switchml.sim.config import SimConfig
from switchml.sim.run import access_link, run_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, nargs="+", default=[200.0], help="Mbit/s")
    ap.add_argument("--loss", type=float, default=0.01, help="per link (default 0.01)")
    ap.add_argument("--srtts", type=float, nargs="+", default=[3.0],
                    help="WorkerConfig.min_rto_srtts values (default 3)")
    ap.add_argument("--min-rto-ms", type=float, default=10.0, help="min_rto_s in ms")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--mib", type=int, default=16)
    a = ap.parse_args()
    for rate in a.rate:
        for srtts in a.srtts:
            for seed in a.seeds:
                c = SimConfig(workers=4, size_bytes=a.mib << 20, seed=seed,
                              access=access_link(rate, delay_us=0, queue_ms=20, loss=a.loss),
                              min_rto_s=a.min_rto_ms * 1e-3, min_rto_srtts=srtts)
                r = run_config(c, "exact", verbose=False)
                rec = r.extra["recovery"]
                print(f"{rate:g} Mbit/s, loss {a.loss:g}, min_rto_srtts {srtts:g}, seed {seed}: "
                      f"{100 * r.fraction_of_line_rate:.1f}% of B/32, "
                      f"{r.retransmissions} re-sends ({rec['nack_retransmissions']} NACK, "
                      f"{rec['timer_retransmissions']} timer), {r.extra['nacks']} NACKs "
                      f"({r.extra['nacks_needless']} needless), ok={r.ok}", flush=True)


if __name__ == "__main__":
    main()
