"""What UDP GSO/GRO runs do inside the testbed (root). Standalone experiment, not a test.

A sender in worker 0's namespace sends ``--runs`` GSO runs of ``--segments`` datagrams of
``--size`` bytes (one ``sendmsg`` with a UDP_SEGMENT control message each) to a receiver with
UDP_GRO on, either where the switch runs, the router namespace (``--to switch``, at worker 0's
gateway address), or in worker 1's namespace (``--to worker``, through the router).
``--from switch --to worker`` sends from the router namespace to worker 1. The receiver reports how
many distinct datagrams arrived, in how many ``recvmsg`` calls, how many runs arrived whole /
partly / not at all, and its rate; the nft counters say how many packets the loss rules
dropped. ``--ethtool`` applies ``ethtool -K`` settings first (``NS:DEV:feature=on|off``; NS
is rt, ps, w0, w1, ...;
DEV h0 or s0 is worker 0's link, host or router end).
``--no-offload-setup`` leaves the veth offloads at the kernel's defaults (the testbed before
it set them), to show what the defaults do.

    python experiments/testbed_gso.py --loss 0.5
    python experiments/testbed_gso.py --loss 0.5 --ethtool w0:h0:tx-udp-segmentation=off
    python experiments/testbed_gso.py --rate-mbit 1000 --runs 20000 --to worker
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

from switchml.testbed import LinkSpec, Testbed, Topology

RECEIVER = """
import json, resource, socket, struct, time
SOL_UDP, UDP_GRO = 17, 104
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 25)
s.setsockopt(SOL_UDP, UDP_GRO, 1)
s.bind(("0.0.0.0", 6000)); print("ready", flush=True)
buf = bytearray(1 << 16); seen = set(); calls = 0; batches = {}; t0 = t1 = None
s.settimeout(30.0)
try:
    while True:
        n, anc, flags, addr = s.recvmsg_into([buf], socket.CMSG_SPACE(4))
        s.settimeout(1.0)
        t1 = time.perf_counter()
        if t0 is None:
            t0 = t1; r = resource.getrusage(resource.RUSAGE_SELF); c0 = r.ru_utime + r.ru_stime
        r = resource.getrusage(resource.RUSAGE_SELF); c1 = r.ru_utime + r.ru_stime
        seg = n
        for lvl, kind, data in anc:
            if lvl == SOL_UDP and kind == UDP_GRO:
                fmt = "=i" if len(data) >= 4 else "=H"
                seg = struct.unpack(fmt, data[:struct.calcsize(fmt)])[0]
        calls += 1; k = 0
        for off in range(0, n, seg):
            seen.add(struct.unpack_from("!I", buf, off)[0]); k += 1
        batches[k] = batches.get(k, 0) + 1
except socket.timeout:
    pass
print(json.dumps({"seen": sorted(seen), "calls": calls, "batches": batches,
                  "seconds": (t1 - t0) if t0 else 0.0,
                  "cpu_s": (c1 - c0) if t0 else 0.0}))
"""

SENDER = """
import socket, struct, time, resource
SOL_UDP, UDP_SEGMENT = 17, 103
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, {sndbuf})
s.connect(({dst!r}, 6000))
runs, segs, size, pace = {runs}, {segments}, {size}, {pace}
pad = bytes(size - 4); anc = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))]
t0 = time.perf_counter()
for r in range(runs):
    data = b"".join(struct.pack("!I", r * segs + i) + pad for i in range(segs))
    while True:
        try:
            s.sendmsg([data], anc); break
        except BlockingIOError:
            time.sleep(0.001)
    if pace: time.sleep(pace)
print(time.perf_counter() - t0)
"""


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="0: unshaped")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--segments", type=int, default=40)
    ap.add_argument("--size", type=int, default=1400)
    ap.add_argument("--pace", type=float, default=0.0005, help="seconds between runs")
    ap.add_argument("--sndbuf", type=int, default=1 << 19,
                    help="sender SO_SNDBUF; below tbf's queue, the sender blocks instead of "
                         "tbf dropping (the kernel doubles it)")
    ap.add_argument("--from", dest="source", choices=("worker", "switch"), default="worker",
                    help="sender: worker 0, or the switch (router namespace; with --to worker)")
    ap.add_argument("--to", choices=("switch", "worker"), default="switch")
    ap.add_argument("--ethtool", action="append", default=[], metavar="NS:DEV:feature=on|off")
    ap.add_argument("--show", action="store_true", help="print ethtool -k of the links")
    ap.add_argument("--no-offload-setup", action="store_true",
                    help="build the testbed as if ethtool were missing (kernel defaults)")
    a = ap.parse_args()
    link = LinkSpec(bandwidth_bps=a.rate_mbit * 1e6 or None, loss_rate=a.loss, mtu=a.mtu)
    if a.no_offload_setup:  # what the testbed does without ethtool
        import shutil
        real = shutil.which
        shutil.which = lambda name, *k, **kw: None if name == "ethtool" else real(name, *k, **kw)
    with Testbed(Topology(workers=2, link=link)) as tb:
        if a.no_offload_setup:
            shutil.which = real
        names = {"rt": tb.router_ns, "ps": tb.ps_ns,
                 **{f"w{i}": tb.worker_ns(i) for i in range(2)}}
        for spec in a.ethtool:
            ns, dev, setting = spec.split(":")
            feature, value = setting.split("=")
            tb.run(names[ns], ["ethtool", "-K", f"{tb.prefix}{dev}", feature, value])
        if a.show:
            for ns, dev in (("w0", "h0"), ("rt", "s0"), ("rt", "s1"), ("w1", "h1")):
                out = tb.run(names[ns], ["ethtool", "-k", f"{tb.prefix}{dev}"])
                keep = [ln.strip() for ln in out.splitlines() if any(
                    k in ln for k in ("udp-segmentation", "generic-receive", "gro-list",
                                      "udp-fwd", "generic-segmentation"))]
                print(f"{ns}:{dev}: " + "; ".join(keep))
        if a.to == "worker" and a.source == "switch":
            tx_ns = tb.switch_ns
        else:
            tx_ns = tb.worker_ns(0)
        rx_ns = tb.switch_ns if a.to == "switch" else tb.worker_ns(1)
        dst = tb.topology.switch_ip(0) if a.to == "switch" else tb.topology.worker_ip(1)
        rx = tb.popen(rx_ns, _py(RECEIVER), stdout=subprocess.PIPE, text=True)
        assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
        send_s = float(tb.run(tx_ns, _py(SENDER.format(
            dst=dst, sndbuf=a.sndbuf, runs=a.runs, segments=a.segments, size=a.size, pace=a.pace))))
        res = json.loads(rx.stdout.readline())
        total = a.runs * a.segments
        seen = set(res["seen"])
        per_run = [sum(1 for i in range(a.segments) if r * a.segments + i in seen)
                   for r in range(a.runs)]
        whole = sum(1 for k in per_run if k == a.segments)
        none = sum(1 for k in per_run if k == 0)
        rate = len(seen) * (a.size + 28 + 14) * 8 / res["seconds"] if res["seconds"] else 0
        print(json.dumps({
            "from": a.source, "to": a.to, "loss": a.loss, "rate_mbit": a.rate_mbit, "mtu": a.mtu,
            "ethtool": a.ethtool, "offloads_set": tb.batching, "datagrams_sent": total,
            "received": len(seen),
            "lost": total - len(seen), "lost_fraction": round(1 - len(seen) / total, 4),
            "nft_drops": tb.loss_counter(), "recv_calls": res["calls"],
            "datagrams_per_call": round(len(seen) / max(res["calls"], 1), 2),
            "batch_sizes": dict(sorted(res["batches"].items(), key=lambda kv: -kv[1])[:6]),
            "runs_whole": whole, "runs_partial": a.runs - whole - none, "runs_lost": none,
            "send_s": round(send_s, 3),
            "rx_cpu_percent": (round(100 * res["cpu_s"] / res["seconds"], 1) if res["seconds"]
                               else 0),
            "rx_mbit_on_wire": round(rate / 1e6, 1)}))


if __name__ == "__main__":
    main()
