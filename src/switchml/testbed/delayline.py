"""A user-space delay line: every packet routed into a TUN device comes back out of it
``delay_s`` later, in order.

This kernel has no ``netem`` (and no ``fq`` or ``etf``), the qdiscs that add propagation delay,
so the geo testbed adds a WAN's round trip this way (:class:`~switchml.testbed.GeoTestbed`,
``wan_rtt_s``): in the WAN core's namespace, policy routing sends every packet that arrives
from a data centre's WAN link to the TUN device; this process reads it, holds it for
``delay_s`` and writes it back into the TUN device, where the kernel receives it and forwards it
by the main table to the other data centre. Each packet between data centres passes the core
once, so a round trip between them gains ``2 * delay_s``.

The cost is one ``read`` and one ``write`` system call per packet in this process, and a
``select`` per wake-up: measured, 27-53 us of CPU per packet on the development machine
(the fewer packets per wake-up, the more each costs), 4-8% of a core while training across a
50 Mbit/s WAN (docs/benchmarks.md, section 5.3).

Run as ``python -m switchml.testbed.delayline DEVICE DELAY_S`` inside the namespace that holds
the (persistent, ``ip tuntap add ... mode tun``) device; it runs until stopped, and on SIGTERM
or SIGINT prints its counters as one JSON line (the geo testbed logs them at teardown).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import os
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass

__all__ = ["DelayLine", "DelayStats", "open_tun"]

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000

READS_PER_WAKE = 256
"""Packets read per wake-up at most, so that a flood cannot hold back the ones due."""

MAX_QUEUED = 65536
"""Packets held at once; beyond this one is dropped and counted (at 50 Mbit/s and 150 ms the
line holds about 650 full-size packets)."""


def open_tun(name: str) -> int:
    """A non-blocking file descriptor for the existing TUN device ``name`` (no
    packet-information header: each read is one IP packet).

    Raises:
        OSError: no such device here (TUNSETIFF would create one), or it cannot be attached.
    """
    if "/" in name or not os.path.exists(f"/sys/class/net/{name}"):
        raise OSError(errno.ENODEV, f"no network device {name!r} in this namespace (create it "
                                    "with: ip tuntap add dev NAME mode tun)")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError as exc:
        os.close(fd)
        raise OSError(exc.errno, f"cannot attach to TUN device {name!r}: {exc.strerror}") from None
    return fd


@dataclass
class DelayStats:
    packets: int = 0
    """Packets delayed and written back."""
    bytes: int = 0
    dropped: int = 0
    """Packets dropped because ``MAX_QUEUED`` were held, or because the write back failed."""
    late_max_s: float = 0.0
    """The most a packet left after its due time (this process's scheduling)."""


class DelayLine:
    """Hold each packet read from ``fd`` for ``delay_s`` and write it back, in arrival order
    (a constant delay keeps FIFO order, so one deque is the whole schedule)."""

    def __init__(self, fd: int, delay_s: float, *, clock: object = time.monotonic) -> None:
        if not 0.0 <= delay_s <= 10.0:
            raise ValueError(f"delay_s must be in [0, 10] seconds, got {delay_s}")
        self.fd = fd
        self.delay_s = delay_s
        self.clock = clock
        self.stats = DelayStats()
        self._held: collections.deque[tuple[float, bytes]] = collections.deque()

    def take(self, now: float) -> None:
        """Read the packets waiting on the device (at most ``READS_PER_WAKE``); each is due at
        ``now + delay_s``."""
        due = now + self.delay_s
        for _ in range(READS_PER_WAKE):
            try:
                packet = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            if len(self._held) >= MAX_QUEUED:
                self.stats.dropped += 1
                continue
            self._held.append((due, packet))

    def release(self, now: float) -> None:
        """Write back every packet whose time has come."""
        held = self._held
        while held and held[0][0] <= now:
            due, packet = held.popleft()
            self.stats.late_max_s = max(self.stats.late_max_s, now - due)
            try:
                os.write(self.fd, packet)
            except OSError:
                self.stats.dropped += 1
                continue
            self.stats.packets += 1
            self.stats.bytes += len(packet)

    def next_due(self) -> float | None:
        return self._held[0][0] if self._held else None

    def run(self, stop: list[bool]) -> None:
        """Until ``stop[0]``: wait for a packet or the next due time, take, release."""
        clock = self.clock
        while not stop[0]:
            due = self.next_due()
            timeout = 0.5 if due is None else max(0.0, due - clock())  # type: ignore[operator]
            select.select([self.fd], [], [], timeout)
            now = clock()  # type: ignore[operator]
            self.take(now)
            self.release(now)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m switchml.testbed.delayline DEVICE DELAY_S", file=sys.stderr)
        return 2
    line = DelayLine(open_tun(argv[0]), float(argv[1]))
    stop = [False]

    def _stop(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print("ready", flush=True)
    line.run(stop)
    s = line.stats
    print(json.dumps({"packets": s.packets, "bytes": s.bytes, "dropped": s.dropped,
                      "late_max_s": s.late_max_s}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
