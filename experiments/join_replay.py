"""Two PyTorch jobs share one switch while a process on the same host sniffs every datagram to
the switch and replays them from its own port (issue 22's hijack): does a job hang, or does
any rank's membership move to the replayer?

    sudo python experiments/join_replay.py --runs 50 --mode old       # datagrams >= 1 s old
    sudo python experiments/join_replay.py --runs 10 --mode joins     # every JOIN, 0.3 s later
    sudo python experiments/join_replay.py --runs 10 --mode none      # undisturbed baseline

Root: the replayer sniffs loopback with an AF_PACKET socket (as tcpdump does). Each run
starts ``switchml switch`` (with a random secret unless ``--open``), two jobs of two ranks
(DDP training of a small MLP for ``--steps`` steps, then an exact integer all-reduce), and the
replayer. A run is a **hijack** if the switch logs ``member_joined`` at the replayer's port, a
**hang** if a job does not finish within ``--timeout-s``, **wrong** if a sum is wrong. Prints a
table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

RANK_SCRIPT = r"""
import json, os, sys, time
import torch, torch.distributed as dist
import switchml.torch  # registers "switchml"
rank, job = int(os.environ["RANK"]), os.environ["JOB"]
t0 = time.monotonic()
import datetime
dist.init_process_group("switchml", init_method=f"file://{os.environ['STORE']}", rank=rank,
                        world_size=2,
                        timeout=datetime.timedelta(seconds=float(os.environ["OP_TIMEOUT_S"])))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
for _ in range(int(os.environ["STEPS"])):
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
t = (rank + 1) * torch.arange(100_000, dtype=torch.int32)
dist.all_reduce(t)
ok = bool(torch.equal(t, 3 * torch.arange(100_000, dtype=torch.int32)))
dist.destroy_process_group()
print(json.dumps({"job": job, "rank": rank, "ok": ok, "seconds": time.monotonic() - t0}))
"""


class Replayer(threading.Thread):
    """Sniffs UDP datagrams to ``port`` on loopback and re-sends them from its own socket:
    ``old``: a random captured datagram at least 1 s old, every 5 ms; ``joins``: every JOIN
    (type 18) 0.3 s after it was seen."""

    def __init__(self, port: int, mode: str) -> None:
        super().__init__(daemon=True)
        self.port, self.mode = port, mode
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
        self.sniff.bind(("lo", 0))
        self.sniff.settimeout(0.005)
        self.stop = threading.Event()
        self.captured: list[tuple[float, bytes]] = []
        self.replayed = 0

    def run(self) -> None:
        due: list[tuple[float, bytes]] = []
        last = 0.0
        while not self.stop.is_set():
            try:
                frame = self.sniff.recv(65535)
                self._take(frame, due)
            except TimeoutError:
                pass
            now = time.monotonic()
            if self.mode == "joins":
                while due and due[0][0] <= now:
                    self._send(due.pop(0)[1])
            elif self.mode == "old" and now - last >= 0.005:
                last = now
                old = [d for t, d in self.captured[-4000:] if now - t >= 1.0]
                if old:
                    self._send(random.choice(old))

    def _take(self, frame: bytes, due: list) -> None:
        ip = frame[14:]  # Ethernet header on lo
        if len(ip) < 28 or ip[9] != 17:
            return
        ihl = (ip[0] & 0x0F) * 4
        src_port, dst_port = struct.unpack_from("!HH", ip, ihl)
        if dst_port != self.port or src_port == self.address[1]:
            return
        payload = ip[ihl + 8:]
        now = time.monotonic()
        self.captured.append((now, payload))
        if self.mode == "joins" and len(payload) > 3 and payload[3] == 18:
            due.append((now + 0.3, payload))

    def _send(self, payload: bytes) -> None:
        try:
            self.sock.sendto(payload, ("127.0.0.1", self.port))
            self.replayed += 1
        except OSError:
            pass


def one_run(args: argparse.Namespace, tmp: Path, i: int) -> dict:
    env = dict(os.environ)
    metrics_port = 19000 + i % 1000
    cmd = [sys.executable, "-m", "switchml", "switch", "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", str(metrics_port)]
    if not args.open:
        secret_file = tmp / "secret"
        secret_file.write_text(secrets.token_hex(32))
        cmd += ["--secret-file", str(secret_file)]
        env["SWITCHML_SECRET"] = secret_file.read_text()
    sw = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env)
    line = sw.stdout.readline()
    port = int(re.search(r":(\d+)", line).group(1))
    env["SWITCHML_SWITCH"] = f"127.0.0.1:{port}"
    replayer = Replayer(port, args.mode)
    if args.mode != "none":
        replayer.start()
    t0 = time.monotonic()
    ranks = []
    for job in ("a", "b"):
        store = tmp / f"store-{i}-{job}"
        for rank in (0, 1):
            ranks.append(subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True,
                env={**env, "RANK": str(rank), "JOB": job, "STORE": str(store),
                     "STEPS": str(args.steps), "OP_TIMEOUT_S": str(args.op_timeout_s)}))
    results, hung, errors = [], 0, []
    for p in ranks:
        try:
            out, err = p.communicate(timeout=max(1.0, args.timeout_s - (time.monotonic() - t0)))
            if p.returncode == 0 and out.strip():
                results.append(json.loads(out.strip().splitlines()[-1]))
            else:
                errors.append(err.strip().splitlines()[-1] if err.strip() else f"rc {p.returncode}")
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            hung += 1
    seconds = time.monotonic() - t0
    replayer.stop.set()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        drops = {k: int(float(v)) for k, v in re.findall(
            r'switchml_drops_total\{reason="([a-z_]+)"\} ([0-9.e+]+)', metrics)}
    except OSError as exc:
        drops = {"metrics unavailable": str(exc)}
    sw.terminate()
    _, log = sw.communicate(timeout=10)
    joined_at = re.findall(r"event=member_joined job=\d+ rank=\d+ address=127\.0\.0\.1:(\d+)", log)
    hijacks = sum(int(p) == replayer.address[1] for p in joined_at)
    return {"run": i, "mode": args.mode, "seconds": seconds, "hung_ranks": hung,
            "errors": errors, "wrong": sum(not r["ok"] for r in results),
            "finished_ranks": len(results), "hijacks": hijacks,
            "replayed": replayer.replayed, "members_joined": len(joined_at), "drops": drops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--mode", choices=["old", "joins", "none"], default="old")
    ap.add_argument("--steps", type=int, default=30, help="DDP steps per job")
    ap.add_argument("--timeout-s", type=float, default=90.0, help="a run longer than this hangs")
    ap.add_argument("--op-timeout-s", type=float, default=20.0)
    ap.add_argument("--open", action="store_true", help="run the switch without a secret")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0 and args.mode != "none":
        sys.exit("the replayer sniffs loopback (AF_PACKET): run as root, or --mode none")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.runs):
            row = one_run(args, Path(d), i)
            rows.append(row)
            print(f"run {i:3d}: {row['seconds']:6.1f} s  hijacks {row['hijacks']}  hung ranks "
                  f"{row['hung_ranks']}  wrong {row['wrong']}  finished {row['finished_ranks']}/4"
                  f"  replayed {row['replayed']}  drops {row['drops']}"
                  + (f"  errors {row['errors']}" if row["errors"] else ""), flush=True)
    secs = sorted(r["seconds"] for r in rows)
    summary = {"runs": len(rows), "mode": args.mode, "secret": not args.open,
               "hijacks": sum(r["hijacks"] for r in rows),
               "runs_with_a_hang": sum(r["hung_ranks"] > 0 for r in rows),
               "runs_with_errors": sum(bool(r["errors"]) for r in rows),
               "wrong": sum(r["wrong"] for r in rows),
               "median_seconds": secs[len(secs) // 2], "max_seconds": secs[-1]}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
