"""What a sharded switch costs per datagram, per shard, and how evenly a job spreads over shards.

Starts ``switchml switch --shards S`` (S = 1, 2, ...) on loopback, runs ``--workers`` worker
processes that all-reduce ``--size`` float32 elements ``--iters`` times in MTU-1500-sized chunks
(358 elements), and reads every shard process's CPU time (/proc) and datagram counters
(Prometheus). On a machine with fewer cores than workers + shards the wall time says little;
the per-shard CPU cost per datagram, and the share of the datagrams each shard took, say what
S cores would carry: capacity = S / (CPU seconds per datagram of one shard).

    python experiments/shard_cost.py --shards 1 2 --workers 2 --size 4000000 --iters 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import urllib.request


def _free_base(count: int) -> int:
    for base in range(42000, 60000, 101):
        try:
            socks = []
            for i in range(count):
                for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                    s = socket.socket(socket.AF_INET, kind)
                    socks.append(s)
                    s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _packets_in(url: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("switchml_packets_in_total "):
                return float(line.split()[1])
    return 0.0


def _worker(rank: int, addrs, spec_text: str, size: int, iters: int, q) -> None:
    import numpy as np

    from switchml.control import decode_job_spec
    from switchml.transport.udp import WorkerClient
    with WorkerClient(addrs, decode_job_spec(spec_text), rank) as w:
        x = np.ones(size, np.float32)
        w.allreduce(x)  # warm-up
        t0 = time.perf_counter()
        for _ in range(iters):
            w.allreduce(x)
        q.put(time.perf_counter() - t0)


def _shard_pids(port: int, shards: int) -> list[int]:
    pids = []
    for i in range(shards):
        want = ["--port", str(port + i), "--shard", f"{i}/{shards}"] if shards > 1 else None
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                argv = open(f"/proc/{entry}/cmdline", "rb").read().decode().split("\0")
            except OSError:
                continue
            if want and any(argv[j:j + 4] == want for j in range(len(argv))):
                pids.append(int(entry))
    return pids


def measure(shards: int, workers: int, size: int, iters: int) -> dict:
    from switchml.control import encode_job_spec, new_job_spec
    port = _free_base(shards)
    metrics = _free_base(shards) + 5000
    proc = subprocess.Popen([sys.executable, "-m", "switchml", "switch", "--shards",
                             str(shards), "--port", str(port), "--metrics-port", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for _ in range(1 + (shards if shards > 1 else 0)):
            proc.stdout.readline()
        time.sleep(0.5)
        pids = _shard_pids(port, shards) if shards > 1 else [proc.pid]
        addrs = [("127.0.0.1", port + i) for i in range(shards)]
        spec = encode_job_spec(new_job_spec(workers, window=128, elements_per_packet=358))
        cpu0 = [_cpu_s(p) for p in pids]
        pk0 = [_packets_in(f"http://127.0.0.1:{metrics + i}/metrics") for i in range(shards)]
        q: mp.Queue = mp.Queue()
        ps = [mp.Process(target=_worker, args=(r, addrs if shards > 1 else addrs[0], spec,
                                               size, iters, q)) for r in range(workers)]
        for p in ps:
            p.start()
        walls = [q.get(timeout=600) for _ in ps]
        for p in ps:
            p.join()
        cpu = [_cpu_s(p) - c for p, c in zip(pids, cpu0)]
        pk = [_packets_in(f"http://127.0.0.1:{metrics + i}/metrics") - p0
              for i, p0 in enumerate(pk0)]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    us = [1e6 * c / p if p else None for c, p in zip(cpu, pk)]
    return {"shards": shards, "workers": workers, "elements": size, "iters": iters,
            "wall_s": max(walls), "datagrams_in": pk, "share": [p / sum(pk) for p in pk],
            "cpu_s": cpu, "cpu_us_per_datagram": us,
            "derived_capacity_datagrams_per_s": sum(1e6 / u for u in us if u)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size", type=int, default=4_000_000, help="float32 elements")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    rows = []
    for s in a.shards:
        r = measure(s, a.workers, a.size, a.iters)
        rows.append(r)
        per = [int(x) for x in r["datagrams_in"]]
        us = [round(u, 2) for u in r["cpu_us_per_datagram"]]
        print(f"S={s}: wall {r['wall_s']:.2f} s, datagrams per shard {per}, CPU us/datagram "
              f"per shard {us}, derived capacity "
              f"{r['derived_capacity_datagrams_per_s']:.3g} datagrams/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "cpus": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    main()
