"""Per-datagram CPU cost of the sans-I/O core, without sockets.

n workers and one switch exchange an all-reduce in memory; datagrams are handed over in
batches of ``--batch`` (as a GRO buffer or recvmmsg would deliver them) and the time spent in
the switch's and the workers' receive calls is divided by the datagrams they took. Cited in
docs/benchmarks.md ("The per-packet budget, measured in process").

    python experiments/per_packet_cost.py --batch 40
    python experiments/per_packet_cost.py --batch 1
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from switchml.protocol.config import JobSpec
from switchml.protocol.endpoint import Batch
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.worker import WorkerEndpoint


def _batches(datagrams: list[bytes], size: int) -> list[list[bytes]]:
    """Runs of up to ``size`` datagrams that a GRO buffer could hold (equal sizes, the last
    may be shorter)."""
    out: list[list[bytes]] = []
    for i in range(0, len(datagrams), size):
        run = datagrams[i:i + size]
        if all(len(d) == len(run[0]) for d in run[:-1]) and len(run[-1]) <= len(run[0]):
            out.append(run)
        else:
            out.extend([d] for d in run)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--elements-per-packet", type=int, default=358)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--batch", type=int, default=40)
    a = ap.parse_args()
    n = a.workers
    spec = JobSpec(job_id=7, token=99, num_workers=n, window=a.window,
                   elements_per_packet=a.elements_per_packet)
    sw = SwitchDataplane()
    addrs = [(f"10.0.0.{r + 1}", 5000) for r in range(n)]
    swa = ("10.0.0.100", 48864)
    keys = [(r + 1) << 16 | 5000 for r in range(n)]  # stable sender numbers, as recvmmsg gives
    ws = [WorkerEndpoint(spec=spec, rank=r, switch_address=swa) for r in range(n)]
    for w in ws:
        w.join(0.0)
    for _ in range(2):  # JOIN, CHALLENGE, JOIN with the proof, JOINED
        for r, w in enumerate(ws):
            for d, _ in w.datagrams_to_send(0.0):
                sw.receive_datagram(bytes(d), addrs[r], 0.0)
        for d, addr in sw.datagrams_to_send(0.0):
            ws[addrs.index(addr)].receive_datagram(bytes(d), swa, 0.0)
    for w in ws:
        while w.next_event() is not None:
            pass
    numel = a.mib * 2**20 // 4
    xs = [np.random.default_rng(r).standard_normal(numel).astype(np.float32) for r in range(n)]
    # Written once first, as a training job reuses its buffers: first-touch page faults
    # (the kernel zeroing fresh pages) are not the per-packet cost.
    outs = [np.ones(numel, np.float32) for _ in range(n)]
    for r, w in enumerate(ws):
        w.start_allreduce(xs[r], outs[r], 0.0)
    pending = [[bytes(d) for d, _ in w.datagrams_to_send(0.0)] for w in ws]
    t_sw = t_w = 0.0
    n_sw = n_w = 0
    done = 0
    while done < n:
        back: list[list[bytes]] = [[] for _ in range(n)]
        for r in range(n):
            for run in _batches(pending[r], a.batch):
                buf = np.frombuffer(bytearray(b"".join(run)), np.uint8)
                # As the UDP switch gets them: with sender numbers stable across calls.
                batch = Batch.of_segments(buf, len(buf), len(run[0]), addrs[r])
                batch = batch._replace(senders=np.full(batch.count, keys[r], np.int64),
                                       stable_senders=True)
                t = time.perf_counter()
                sw.receive_many(batch, 0.0)
                # What the UDP switch takes: GSO runs planned by a kernel.
                out, runs = sw.runs_to_send(0.0, max_segments=64, max_bytes=65000)
                t_sw += time.perf_counter() - t
                n_sw += len(run)
                for d, addr in out:
                    back[addrs.index(addr)].append(bytes(d))
                for bufs, size, addr in runs:
                    for b in bufs:
                        back[addrs.index(addr)].extend(bytes(b[o:o + size])
                                                       for o in range(0, len(b), size))
            pending[r] = []
        for r, w in enumerate(ws):
            for run in _batches(back[r], a.batch):
                buf = np.frombuffer(bytearray(b"".join(run)), np.uint8)
                batch = Batch.of_segments(buf, len(buf), len(run[0]), swa)
                t = time.perf_counter()
                w.receive_many(batch, 0.0)
                # What the UDP transport takes: GSO runs planned by a kernel.
                out, runs = w.runs_to_send(0.0, max_segments=64, max_bytes=65000)
                t_w += time.perf_counter() - t
                n_w += len(run)
                pending[r].extend(bytes(d) for d, _ in out)
                for bufs, size, _ in runs:
                    for b in bufs:
                        pending[r].extend(bytes(b[o:o + size]) for o in range(0, len(b), size))
            while (ev := w.next_event()) is not None:
                done += type(ev).__name__ == "OperationCompleted"
    expected = np.sum(np.stack(xs).astype(np.float64), axis=0)
    err = float(np.max(np.abs(outs[0] - expected)))
    print(f"n={n}, k={a.elements_per_packet}, batches of {a.batch}: switch "
          f"{1e6 * t_sw / n_sw:.2f} us per request, worker {1e6 * t_w / n_w:.2f} us per result "
          f"(and the request it releases); {n_sw} requests, max abs error {err:.2e}")


if __name__ == "__main__":
    main()
