"""What receiving a worker's bytes costs through AF_XDP, against the UDP socket (root).

The cost-per-byte budget (docs/benchmarks.md, section 0) leaves the workers' kernel side as
the largest line: about what the data-movement floor costs, which does no protocol work. Below
it only a cheaper path than the kernel's UDP stack goes. This experiment sizes the receive half
of that line on this machine: two namespaces joined by a veth pair set up as the testbed's
links are (wire frames on the veth, GRO on at the receiver), a sender pacing 1,472-byte UDP
datagrams (switchml's at MTU 1500) as GSO runs of 44 at ``--rate-mbit``, and a receiver that
takes them either

* ``udp``: with a UDP socket, ``UDP_GRO``, one ``recvmsg`` of up to 64 KB per call (as the
  worker's loop does); or
* ``xdp``: with an AF_XDP socket in copy mode. An XDP program on the veth redirects every frame
  into it (``bpf_redirect_map`` on an XSKMAP); the receiver reads the RX ring and gives the
  frames back on the fill ring, in batches, sleeping ``--batch-sleep-us`` between them.

Neither reads the payload. Reported per mode: datagrams per second received, the receiver
process's CPU and the whole machine's busy CPU (``/proc/stat``: user, system, softirq, irq;
the sender's share is the same in both modes) in nanoseconds per received byte, and per
element (4 bytes), to set beside the budget's ns per element.

    python experiments/afxdp_receive.py --rate-mbit 1000 --seconds 5 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HZ = os.sysconf("SC_CLK_TCK")
NS_S, NS_R = "afx-send", "afx-recv"
DEV_S, DEV_R = "afx-s0", "afx-r0"
IP_S, IP_R = "10.201.0.1", "10.201.0.2"
PORT = 47001
PAYLOAD, SEGMENTS = 1472 - 28, 44  # the UDP payload of a 1,472-byte IP datagram; a GSO run

AF_XDP, SOL_XDP = 44, 283
XDP_MMAP_OFFSETS, XDP_RX_RING, XDP_UMEM_REG = 1, 2, 4
XDP_UMEM_FILL_RING, XDP_UMEM_COMPLETION_RING, XDP_STATISTICS = 5, 6, 7
XDP_PGOFF_RX_RING, XDP_UMEM_PGOFF_FILL_RING = 0, 0x100000000
XDP_COPY = 1 << 1
BPF_MAP_CREATE, BPF_MAP_UPDATE_ELEM, BPF_MAP_TYPE_XSKMAP = 0, 2, 17
FN_REDIRECT_MAP, XDP_PASS = 51, 2
FRAME, NFRAMES, RING = 2048, 8192, 4096


def _run(*cmd: str, ns: str | None = None, check: bool = True) -> str:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    return subprocess.run(full, check=check, capture_output=True, text=True).stdout


def _machine() -> int:
    f = open("/proc/stat").readline().split()[1:]
    return sum(int(f[i]) for i in (0, 1, 2, 5, 6))  # user nice system irq softirq


# -- the receivers --------------------------------------------------------------------------------

def _report(nbytes: int, frames: int, t0: float, r0: resource.struct_rusage) -> None:
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"bytes": nbytes, "frames": frames, "seconds": time.monotonic() - t0,
                      "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime}),
          flush=True)


def _recv_udp(seconds: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(socket.IPPROTO_UDP, 104, 1)  # UDP_GRO
    s.bind((IP_R, PORT))
    buf = bytearray(65536)
    print("ready", flush=True)
    s.recv_into(buf)  # the first batch starts the clock
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    nbytes = frames = 0
    end = t0 + seconds
    s.settimeout(1.0)
    while time.monotonic() < end:
        n, anc, _flags, _addr = s.recvmsg_into([buf], 64)
        seg = n
        for level, kind, data in anc:
            if level == socket.IPPROTO_UDP and kind == 104:
                seg = struct.unpack("=H", data[:2])[0] if len(data) == 2 else \
                    struct.unpack("=i", data[:4])[0]
        nbytes += n
        frames += -(-n // seg) if seg else 1
    _report(nbytes, frames, t0, r0)


def _bpf(cmd: int, attr: bytes) -> int:
    from switchml.testbed.xdp import _bpf as bpf
    return bpf(cmd, attr)


def _redirect_program(map_fd: int) -> bytes:
    """Every frame to the XSKMAP entry of its receive queue (XDP_PASS where none)."""
    from switchml.testbed.xdp import _insn
    return b"".join([
        _insn(0x61, 2, 1, 16),                # r2 = ctx->rx_queue_index
        _insn(0x18, 1, 1, 0, map_fd),         # r1 = the map (ld_imm64, BPF_PSEUDO_MAP_FD)
        _insn(0x00),
        _insn(0xB7, 3, 0, 0, XDP_PASS),       # r3 = XDP_PASS: the action without an entry
        _insn(0x85, 0, 0, 0, FN_REDIRECT_MAP),  # bpf_redirect_map(r1, r2, r3)
        _insn(0x95),
    ])


def _ring(fd: int, offsets: tuple[int, int, int], pgoff: int, size: int, entry: int):
    prod, cons, desc = offsets
    m = mmap.mmap(fd, desc + size * entry, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                  mmap.PROT_READ | mmap.PROT_WRITE, offset=pgoff)
    p = np.frombuffer(m, np.uint32, 1, prod)
    c = np.frombuffer(m, np.uint32, 1, cons)
    return m, p, c


def _recv_xdp(seconds: float, sleep_us: float) -> None:
    from switchml.testbed.xdp import _load
    map_fd = _bpf(BPF_MAP_CREATE, struct.pack("<IIIII", BPF_MAP_TYPE_XSKMAP, 4, 4, 1, 0))
    prog_fd = _load(_redirect_program(map_fd))
    pin_dir = tempfile.mkdtemp(prefix="afx-bpf-")
    subprocess.run(["mount", "-t", "bpf", "bpf", pin_dir], check=True)
    path = os.path.join(pin_dir, "redirect")
    name = ctypes.create_string_buffer(path.encode())
    _bpf(6, struct.pack("<QI", ctypes.addressof(name), prog_fd))  # BPF_OBJ_PIN
    xsk = socket.socket(AF_XDP, socket.SOCK_RAW, 0)
    umem = mmap.mmap(-1, FRAME * NFRAMES, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    umem_addr = ctypes.addressof(ctypes.c_char.from_buffer(umem))
    xsk.setsockopt(SOL_XDP, XDP_UMEM_REG, struct.pack("<QQIIII", umem_addr, FRAME * NFRAMES,
                                                      FRAME, 0, 0, 0))
    for opt in (XDP_UMEM_FILL_RING, XDP_UMEM_COMPLETION_RING, XDP_RX_RING):
        xsk.setsockopt(SOL_XDP, opt, struct.pack("<I", RING))
    off = struct.unpack("<16Q", xsk.getsockopt(SOL_XDP, XDP_MMAP_OFFSETS, 128))
    rx_off, fr_off = off[0:3], off[8:11]  # (producer, consumer, desc) of rx, tx, fill, comp
    ifindex = socket.if_nametoindex(DEV_R)
    fd = xsk.fileno()
    rx_m, rx_p, rx_c = _ring(fd, rx_off, XDP_PGOFF_RX_RING, RING, 16)
    fr_m, fr_p, fr_c = _ring(fd, fr_off, XDP_UMEM_PGOFF_FILL_RING, RING, 8)
    rx_desc = np.frombuffer(rx_m, np.dtype([("addr", "<u8"), ("len", "<u4"), ("opt", "<u4")]),
                            RING, rx_off[2])
    fill = np.frombuffer(fr_m, np.uint64, RING, fr_off[2])
    fill[:] = np.arange(RING, dtype=np.uint64) * FRAME
    fr_p[0] = RING
    libc = ctypes.CDLL(None, use_errno=True)
    sxdp = struct.pack("<HHIII", AF_XDP, XDP_COPY, ifindex, 0, 0)
    if libc.bind(fd, ctypes.c_char_p(sxdp), len(sxdp)) != 0:
        raise OSError(ctypes.get_errno(), f"bind AF_XDP: {os.strerror(ctypes.get_errno())}")
    key, val = ctypes.c_uint32(0), ctypes.c_uint32(fd)
    _bpf(BPF_MAP_UPDATE_ELEM, struct.pack("<IIQQQ", map_fd, 0, ctypes.addressof(key),
                                          ctypes.addressof(val), 0))
    subprocess.run(["ip", "link", "set", "dev", DEV_R, "xdpdrv", "pinned", path], check=True)
    try:
        print("ready", flush=True)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        mask = RING - 1
        nbytes = frames = 0
        t0 = r0 = None
        end = None
        while end is None or time.monotonic() < end:
            prod, cons = int(rx_p[0]), int(rx_c[0])
            n = (prod - cons) & 0xFFFFFFFF
            if n == 0:
                poller.poll(1000)
                continue
            idx = (cons + np.arange(n, dtype=np.int64)) & mask
            d = rx_desc[idx]
            if t0 is None:  # the first batch starts the clock
                t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
                end = t0 + seconds
            else:
                nbytes += int(d["len"].sum()) - 42 * n  # UDP payload, as the socket counts
                frames += n
            fp = int(fr_p[0])
            fill[(fp + np.arange(n, dtype=np.int64)) & mask] = d["addr"] & ~np.uint64(FRAME - 1)
            fr_p[0] = (fp + n) & 0xFFFFFFFF
            rx_c[0] = (cons + n) & 0xFFFFFFFF
            if sleep_us:
                time.sleep(sleep_us * 1e-6)
        _report(nbytes, frames, t0, r0)
    finally:
        subprocess.run(["ip", "link", "set", "dev", DEV_R, "xdpdrv", "off"])
        subprocess.run(["umount", pin_dir])
        os.rmdir(pin_dir)


def _send(rate_mbit: float, seconds: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    s.setsockopt(socket.IPPROTO_UDP, 103, PAYLOAD)  # UDP_SEGMENT
    s.connect((IP_R, PORT))
    run = bytes(PAYLOAD * SEGMENTS)
    interval = SEGMENTS * (PAYLOAD + 28) * 8 / (rate_mbit * 1e6)
    t = time.monotonic()
    end = t + seconds
    while t < end:
        try:
            s.send(run)
        except OSError:
            pass
        t += interval
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)


# -- the harness ----------------------------------------------------------------------------------

def _setup() -> None:
    _teardown()
    for ns in (NS_S, NS_R):
        _run("ip", "netns", "add", ns)
    _run("ip", "link", "add", DEV_S, "netns", NS_S, "type", "veth", "peer", "name", DEV_R,
         "netns", NS_R)
    for ns, dev, ip in ((NS_S, DEV_S, IP_S), (NS_R, DEV_R, IP_R)):
        _run("ip", "addr", "add", f"{ip}/24", "dev", dev, ns=ns)
        _run("ip", "link", "set", dev, "up", ns=ns)
        _run("ip", "link", "set", "lo", "up", ns=ns)
        # As the testbed's links: wire frames on the veth (GSO cut after the qdisc), GRO on.
        _run("ethtool", "-K", dev, "tso", "off", "tx-udp-segmentation", "off", "gro", "on",
             ns=ns)
    # No ARP: the XDP receiver takes every frame.
    mac_r = _run("cat", f"/sys/class/net/{DEV_R}/address", ns=NS_R).strip()
    mac_s = _run("cat", f"/sys/class/net/{DEV_S}/address", ns=NS_S).strip()
    _run("ip", "neigh", "replace", IP_R, "lladdr", mac_r, "dev", DEV_S, "nud", "permanent",
         ns=NS_S)
    _run("ip", "neigh", "replace", IP_S, "lladdr", mac_s, "dev", DEV_R, "nud", "permanent",
         ns=NS_R)


def _teardown() -> None:
    for ns in (NS_S, NS_R):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _measure(mode: str, a: argparse.Namespace) -> dict:
    role = ["--role", f"recv-{mode}", "--seconds", str(a.seconds),
            "--batch-sleep-us", str(a.batch_sleep_us)]
    rx = subprocess.Popen(["ip", "netns", "exec", NS_R, sys.executable, __file__, *role],
                          stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None
    if rx.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {mode} receiver did not start")
    tx = subprocess.Popen(["ip", "netns", "exec", NS_S, sys.executable, __file__, "--role",
                           "send", "--rate-mbit", str(a.rate_mbit),
                           "--seconds", str(a.seconds + 2)])
    time.sleep(0.5)
    m0, t0 = _machine(), time.monotonic()
    time.sleep(a.seconds)
    m1, t1 = _machine(), time.monotonic()
    out = json.loads(rx.stdout.readline())
    rx.wait(timeout=30)
    tx.wait(timeout=30)
    rate = out["bytes"] / out["seconds"]  # bytes per second received
    machine_ns = (m1 - m0) / HZ / (t1 - t0) / rate * 1e9
    proc_ns = (out["user_s"] + out["sys_s"]) / out["bytes"] * 1e9
    return {"mode": mode, "datagrams_per_s": out["frames"] / out["seconds"],
            "mbit_per_s": rate * 8 / 1e6, "receiver_ns_per_byte": proc_ns,
            "receiver_user_ns_per_byte": out["user_s"] / out["bytes"] * 1e9,
            "receiver_sys_ns_per_byte": out["sys_s"] / out["bytes"] * 1e9,
            "machine_ns_per_byte": machine_ns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=1000, help="the sender's pace")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two modes")
    ap.add_argument("--batch-sleep-us", type=float, default=2000,
                    help="the XDP receiver's sleep between ring batches")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "send":
        return _send(a.rate_mbit, a.seconds)
    if a.role == "recv-udp":
        return _recv_udp(a.seconds)
    if a.role == "recv-xdp":
        return _recv_xdp(a.seconds, a.batch_sleep_us)
    if os.geteuid() != 0:
        sys.exit("root is needed (namespaces, XDP)")
    rows = []
    _setup()
    try:
        for _ in range(a.rounds):
            for mode in ("udp", "xdp"):
                row = _measure(mode, a)
                rows.append(row)
                print(f"{mode}: {row['datagrams_per_s']:8.0f} datagrams/s "
                      f"({row['mbit_per_s']:.0f} Mbit/s of payload); receiver "
                      f"{row['receiver_ns_per_byte']:.3f} ns/byte (user "
                      f"{row['receiver_user_ns_per_byte']:.3f}, system "
                      f"{row['receiver_sys_ns_per_byte']:.3f}); machine "
                      f"{row['machine_ns_per_byte']:.3f} ns/byte "
                      f"({4 * row['machine_ns_per_byte']:.2f} ns per element)", flush=True)
    finally:
        _teardown()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rate_mbit": a.rate_mbit, "seconds": a.seconds, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
