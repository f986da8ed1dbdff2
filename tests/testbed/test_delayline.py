"""The WAN delay line (``switchml.testbed.delayline``) on a datagram socket pair, which hands
over whole packets as a TUN device does: each packet comes back ``delay_s`` later, in order,
and what it cannot hold is dropped and counted."""

from __future__ import annotations

import socket

import pytest

from switchml.testbed import delayline
from switchml.testbed.delayline import DelayLine


def _pair():
    outside, line_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    line_end.setblocking(False)
    outside.setblocking(False)
    return outside, line_end


def _received(sock):
    got = []
    while True:
        try:
            got.append(sock.recv(65536))
        except BlockingIOError:
            return got


def test_each_packet_comes_back_after_the_delay_in_order():
    outside, end = _pair()
    line = DelayLine(end.fileno(), 0.075)
    for p in (b"a" * 1400, b"b", b"c" * 60):
        outside.send(p)
    line.take(now=10.0)
    outside.send(b"later")
    line.take(now=10.05)
    line.release(now=10.07)
    assert _received(outside) == []  # not yet: due at 10.075
    assert line.next_due() == pytest.approx(10.075)
    line.release(now=10.08)
    assert _received(outside) == [b"a" * 1400, b"b", b"c" * 60]
    assert line.next_due() == pytest.approx(10.125)
    line.release(now=10.2)
    assert _received(outside) == [b"later"]
    assert (line.stats.packets, line.stats.bytes, line.stats.dropped) == (4, 1466, 0)
    assert line.stats.late_max_s == pytest.approx(0.075)  # "later" left at 10.2, due 10.125


def test_a_full_line_drops_and_counts(monkeypatch):
    monkeypatch.setattr(delayline, "MAX_QUEUED", 2)
    outside, end = _pair()
    line = DelayLine(end.fileno(), 0.01)
    for i in range(5):
        outside.send(bytes([i]))
    line.take(now=0.0)
    line.release(now=1.0)
    assert _received(outside) == [b"\x00", b"\x01"]
    assert (line.stats.packets, line.stats.dropped) == (2, 3)


def test_a_wrong_delay_or_device_says_what_is_wrong():
    with pytest.raises(ValueError, match="delay_s must be in"):
        DelayLine(0, -0.1)
    # a name that is no device here: refused, not created (TUNSETIFF would make one)
    with pytest.raises(OSError, match="no network device 'smnosuchdl' in this namespace"):
        delayline.open_tun("smnosuchdl")


def test_the_loop_delays_until_stopped():
    import threading
    import time
    outside, end = _pair()
    line = DelayLine(end.fileno(), 0.05)
    stop = [False]
    runner = threading.Thread(target=line.run, args=(stop,))
    runner.start()
    try:
        t0 = time.monotonic()
        outside.send(b"ping")
        outside.setblocking(True)
        outside.settimeout(2)
        assert outside.recv(100) == b"ping"
        assert time.monotonic() - t0 >= 0.05
    finally:
        stop[0] = True
        runner.join(timeout=2)
    assert not runner.is_alive() and line.stats.packets == 1
