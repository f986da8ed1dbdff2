"""Where each nanosecond of an aggregated element goes: a CPU budget of a testbed run (root).

Runs ``switchml bench allreduce --testbed`` (switchml only, many timed operations) and, in the
middle of its timed phase, samples for ``--seconds``:

* every thread of the worker and switch processes: user and system time (``/proc/PID/task``);
* the whole machine: user, system, softirq and irq time (``/proc/stat``);
* with ``--perf``, ``perf record -a`` (Debian's linux-perf), split per thread into the kernel,
  the interpreter (libpython), the compiled kernels (numba's JIT code), numpy and libc.

Everything is reported in nanoseconds of CPU per aggregated element (per worker, as the
benchmark's CPU-s per 10^9 elements: the four workers' CPU summed, divided by the elements one
worker aggregated), with the rate the bench measured. Cited in docs/benchmarks.md (section 0).

    python experiments/cpu_budget.py --mtu 1500 --perf
    python experiments/cpu_budget.py --mtu 9000
    python experiments/cpu_budget.py --mtu 1500 --loss 0.01 --perf
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

HZ = os.sysconf("SC_CLK_TCK")


def _threads(pattern: str) -> dict[int, tuple[str, int, int]]:
    """tid -> (role, utime, stime) in ticks, for every thread of processes matching."""
    out: dict[int, tuple[str, int, int]] = {}
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        if "switchml.bench.nsproc" not in cmd:
            continue
        role = cmd[cmd.index("switchml.bench.nsproc") + 1]
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(tid)] = (role, int(f[11]), int(f[12]))
    return out


def _machine() -> dict[str, int]:
    f = open("/proc/stat").readline().split()[1:]
    return {"user": int(f[0]) + int(f[1]), "system": int(f[2]), "irq": int(f[5]),
            "softirq": int(f[6]), "idle": int(f[3]) + int(f[4])}


def _perf_split(path: str, tids: dict[int, str]) -> dict[tuple[str, str], float]:
    """(role, part) -> share of all samples, from ``perf report --sort pid,dso`` (whose
    "pid" is the thread)."""
    rep = subprocess.run(["perf", "report", "-i", path, "--no-children", "--sort", "pid,dso",
                          "-g", "none", "--stdio"], capture_output=True, text=True).stdout
    split: dict[tuple[str, str], float] = collections.Counter()
    for line in rep.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\d+):\S+\s+(.*)$", line)
        if not m:
            continue
        share, tid, dso = float(m.group(1)) / 100, int(m.group(2)), m.group(3).strip()
        role = tids.get(tid, "other")
        part = ("kernel" if "kernel" in dso else "interpreter" if "libpython" in dso
                else "compiled kernels" if dso.startswith("[JIT]") else "numpy"
                if "multiarray" in dso else "libc" if "libc" in dso else "other")
        split[(role, part)] += share
    return split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--rate-mbit", type=float, default=1000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--loss", type=float, default=0.0,
                    help="random loss on every link (the bench's --loss)")
    ap.add_argument("--perf", action="store_true", help="also split the CPU with perf record")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "bench.json")
        bench = subprocess.Popen(
            [sys.executable, "-m", "switchml", "bench", "allreduce", "--testbed",
             "-n", str(a.workers), "--mtu", str(a.mtu), "--rate-mbit", str(a.rate_mbit),
             "--size", "64MiB", "--iters", "40", "--warmup", "1", "--systems", "switchml",
             "--loss", str(a.loss), "--json", js],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Wait for the timed phase: the workers exist and have spent a second of CPU.
        deadline = time.time() + 120
        while time.time() < deadline:
            t = _threads("nsproc switchml")
            if t and sum(u + s for _, u, s in t.values()) > 4 * HZ:
                break
            time.sleep(0.5)
        time.sleep(2)
        perf_path = os.path.join(tmp, "perf.data")
        t0, m0 = {**_threads("nsproc switchml"), **_threads("nsproc switch ")}, _machine()
        if a.perf:
            subprocess.run(["perf", "record", "-a", "-o", perf_path, "--", "sleep",
                            str(a.seconds)], capture_output=True)
        else:
            time.sleep(a.seconds)
        t1, m1 = {**_threads("nsproc switchml"), **_threads("nsproc switch ")}, _machine()
        bench.wait(timeout=600)
        import json
        row = json.load(open(js))["results"][0]
        rate = row["ate_per_s"]  # elements per second per worker
        gelem = rate * a.seconds  # elements one worker aggregated in the window
        ns = 1e9 / gelem / HZ  # ticks -> ns per element
        print(f"testbed n={a.workers}, {a.rate_mbit:g} Mbit/s, MTU {a.mtu}, loss {a.loss:g}: "
              f"{rate:.3g} ATE/s per worker ({row['fraction_of_line_rate']:.0%} of B/32); "
              "CPU in ns per aggregated element (all workers summed, as CPU-s per 10^9)")
        per: dict[tuple[str, str], float] = collections.Counter()
        for tid, (role, u1, s1) in t1.items():
            _, u0, s0 = t0.get(tid, (role, u1, s1))
            kind = "switch" if role == "switch" else "worker"
            per[(kind, "user")] += (u1 - u0) * ns
            per[(kind, "system")] += (s1 - s0) * ns
        for k in ("worker", "switch"):
            print(f"  {k:6s} processes: user {per[(k, 'user')]:6.1f}  system "
                  f"{per[(k, 'system')]:6.1f}")
        d = {k: (m1[k] - m0[k]) * ns for k in m0}
        print(f"  machine: user {d['user']:.1f}  system {d['system']:.1f}  softirq "
              f"{d['softirq']:.1f}  irq {d['irq']:.1f}  (busy "
              f"{d['user'] + d['system'] + d['softirq'] + d['irq']:.1f})")
        if a.perf:
            roles = {tid: ("switch" if r == "switch" else "worker") for tid, (r, _, _) in
                     t1.items()}
            split = _perf_split(perf_path, roles)
            busy = d["user"] + d["system"] + d["softirq"] + d["irq"] + d["idle"]
            for role in ("worker", "switch", "other"):
                parts = {p: v * busy for (r, p), v in split.items() if r == role}
                print(f"  perf, {role}: " + ", ".join(f"{p} {v:.1f}" for p, v in
                                                      sorted(parts.items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    main()
