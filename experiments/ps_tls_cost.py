"""What mutual TLS costs the parameter servers, on loopback: training and raw all-reduce,
plain TCP against TLS 1.3, interleaved in one run (figures are ratios to the plain runs of the
same run), with the machine's busy CPU (/proc/stat) beside each time.

    python experiments/ps_tls_cost.py --repeats 3 --json tls_cost.json

Rows: ``switchml ps train`` of the CNN (560k parameters, 2 servers, 4 workers, processes),
and a 2-worker all-reduce of ``--mib`` MiB float32 through one summing server (threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from switchml.bench.cpu import machine_busy_s
from switchml.links import LinkSecurity, make_credentials
from switchml.ps.allreduce import PSAllreduce, sum_server
from switchml.ps.launch import PSRunConfig, run_ps_training


def train(cfg: PSRunConfig) -> tuple[float, float]:
    c0 = machine_busy_s()
    r = run_ps_training(cfg)
    return r["elapsed_s"], machine_busy_s() - c0


def allreduce(security: LinkSecurity | None, mib: int, iters: int) -> tuple[float, float]:
    numel = mib * 2**20 // 4
    server = sum_server(port=0, workers=2, host="127.0.0.1", security=security)
    times: dict[int, float] = {}

    def worker(w: int) -> None:
        x = np.full(numel, w + 1.0, np.float32)
        out = np.empty_like(x)
        ar = PSAllreduce([server.address], worker=w, numel=numel, workers=2,
                         security=security)
        ar(x, out)  # warm-up
        t0 = time.perf_counter()
        for _ in range(iters):
            ar(x, out)
        times[w] = time.perf_counter() - t0
        assert out[0] == 3.0
        ar.close()

    c0 = machine_busy_s()
    ts = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    busy = machine_busy_s() - c0
    server.wait_finished(30)
    server.stop()
    return max(times.values()) / iters, busy / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in (
        "train plain", "train tls", "allreduce plain", "allreduce tls")}
    with tempfile.TemporaryDirectory() as d:
        sec = make_credentials(f"{d}/tls")
        cfg = PSRunConfig(model="cnn", steps=a.steps, servers=2, workers=4)
        for rep in range(a.repeats):
            rows["train plain"].append(train(cfg))
            rows["train tls"].append(train(replace(cfg, tls_dir=f"{d}/tls")))
            rows["allreduce plain"].append(allreduce(None, a.mib, a.iters))
            rows["allreduce tls"].append(allreduce(sec, a.mib, a.iters))
            print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1][0]:.3f} s" for k, v in rows.items()),
                  flush=True)
    med = {k: (statistics.median(t for t, _ in v), statistics.median(c for _, c in v))
           for k, v in rows.items()}
    print(f"{'row':18s} {'time (s)':>10s} {'busy CPU-s':>11s} {'time vs plain':>14s} "
          f"{'CPU vs plain':>13s}")
    for k, (t, c) in med.items():
        base = med[k.replace("tls", "plain")]
        print(f"{k:18s} {t:10.3f} {c:11.3f} {t / base[0]:13.2f}x {c / base[1]:12.2f}x")
    mb = 2 * a.mib * 2 * 2**20 / 1e6  # each worker pushes and pulls a.mib MiB per step
    print(f"all-reduce goodput: plain {mb / med['allreduce plain'][0]:.0f} MB/s, TLS "
          f"{mb / med['allreduce tls'][0]:.0f} MB/s (both workers, both ways)")
    if a.json:
        a.json.write_text(json.dumps({"repeats": rows, "median": med}, indent=1))


if __name__ == "__main__":
    main()
