"""Fuzz a parameter server and a Gaia leader with hostile messages over loopback TCP while a
legitimate job runs through the server, and watch the targets' memory.

    python experiments/links_fuzz.py --messages 1000000 --json fuzz.json

The targets run in a child process (plain TCP on loopback: TLS would refuse every one of these
connections at the handshake, before a message is parsed, so the fuzz aims at the parser).
``--senders`` threads open connections and send random frames: valid headers of every type
with random fields and sizes, absurd announced lengths, wrong magic, random bytes, valid
HELLOs followed by junk. Meanwhile two legitimate workers sum vectors through the server and
check every result. At the end: the targets' process is alive and answering, every sum was
right, and the targets' RSS (sampled through the run) stayed flat.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import threading
import time
from pathlib import Path

import numpy as np

from switchml.ps.wire import HEADER, MAGIC, MessageType

TYPES = [int(t) for t in MessageType] + [0, 11, 200]


def targets(q) -> None:
    from switchml.gaia.mirror import Mirror
    from switchml.ps.server import ParameterServer, ServerConfig
    # Four worker ids, two of them the legitimate job's: hostile HELLOs as 2 or 3 get in, so
    # their later frames are parsed too (each step takes the first two gradients: backup 2).
    server = ParameterServer(0, ServerConfig(workers=4, backup=2, optimizer="sum",
                                             timeout_s=30)).start()
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    ports = [probe.getsockname()[1], 1]
    probe.close()
    mirror = Mirror(dc=0, leaders=[("127.0.0.1", p) for p in ports], timeout_s=5)
    mirror.expect_entries(1000)
    mirror.listen()
    q.put((server.address, ("127.0.0.1", ports[0])))
    while True:
        time.sleep(3600)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def frame(rng: np.random.Generator) -> bytes:
    kind = rng.integers(0, 10)
    if kind == 0:
        return rng.bytes(int(rng.integers(1, 64)))
    mtype = int(rng.choice(TYPES))
    size = int(rng.choice([0, 4, 8, 24, 7, 100, 4096, 5000]))
    payload = rng.bytes(size)
    announced = int(rng.choice([size, size, size, 1 << 20, 1 << 33, (1 << 34) + 1]))
    magic = MAGIC if kind > 1 else b"XXXX"
    head = HEADER.pack(magic, mtype, int(rng.integers(0, 256)), int(rng.integers(0, 4)),
                       int(rng.integers(0, 4)), int(rng.integers(0, 8)), announced)
    return head + payload[:announced]


def sender(addr, count: int, seed: int, sent: list[int], stop: threading.Event) -> None:
    rng = np.random.default_rng(seed)
    n = 0
    while n < count and not stop.is_set():
        try:
            s = socket.create_connection(addr, timeout=2)
        except OSError:
            time.sleep(0.01)
            continue
        try:
            if rng.random() < 0.5:  # a valid HELLO first: the next frames are parsed further
                s.sendall(HEADER.pack(MAGIC, int(MessageType.HELLO), 0,
                                      int(rng.integers(0, 4)), 0, 0, 0))
                n += 1
            for _ in range(int(rng.integers(1, 8))):
                s.sendall(frame(rng))
                n += 1
        except OSError:
            pass
        finally:
            s.close()
    sent.append(n)


def legit(addr, rounds: list[int], errors: list[str], stop: threading.Event) -> None:
    from switchml.ps.allreduce import PSAllreduce
    out = {}

    def worker(w: int) -> None:
        try:
            ar = PSAllreduce([addr], worker=w, numel=4096, workers=4, timeout_s=30)
            x = np.full(4096, w + 1.0, np.float32)
            o = np.empty_like(x)
            k = 0
            while not stop.is_set():
                x[:] = w + 1.0 + k
                ar(x, o)
                if not np.all(o == 3.0 + 2 * k):
                    errors.append(f"worker {w} round {k}: wrong sum {o[0]}")
                k += 1
                time.sleep(0.01)
            out[w] = k
            ar.close()
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(f"worker {w}: {type(exc).__name__}: {exc}")

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rounds.append(min(out.values()) if len(out) == 2 else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--senders", type=int, default=4)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=targets, args=(q,), daemon=True)
    proc.start()
    ps_addr, gaia_addr = q.get(timeout=60)
    stop, legit_stop = threading.Event(), threading.Event()
    sent: list[int] = []
    rounds: list[int] = []
    errors: list[str] = []
    lt = threading.Thread(target=legit, args=(ps_addr, rounds, errors, legit_stop))
    lt.start()
    per = a.messages // (2 * a.senders)
    threads = [threading.Thread(target=sender, args=(addr, per, i, sent, stop))
               for i, addr in enumerate([ps_addr, gaia_addr] * a.senders)]
    t0 = time.monotonic()
    rss = [(0.0, rss_kb(proc.pid))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(2)
        rss.append((time.monotonic() - t0, rss_kb(proc.pid)))
        print(f"{rss[-1][0]:6.0f} s  targets' RSS {rss[-1][1] / 1024:.1f} MiB", flush=True)
    legit_stop.set()
    lt.join(60)
    alive = proc.is_alive()
    proc.kill()
    mid = [kb for _, kb in rss[len(rss) // 4:]]
    summary = {"messages": sum(sent), "seconds": time.monotonic() - t0,
               "targets_alive": alive, "legit_rounds": rounds[0] if rounds else 0,
               "legit_errors": errors, "rss_first_mib": rss[1][1] / 1024 if len(rss) > 1 else 0,
               "rss_min_after_warmup_mib": min(mid) / 1024, "rss_max_mib": max(mid) / 1024,
               "rss_last_mib": rss[-1][1] / 1024}
    print(json.dumps(summary))
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "rss": rss}, indent=1))


if __name__ == "__main__":
    main()
