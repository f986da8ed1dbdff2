"""The data-movement floor (``bench/floor.py``) and the CPU figures every benchmark reports."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest

from switchml.bench.cpu import (
    cpu_per_gelem,
    machine_busy_s,
    ratio_text,
    sample_processes,
    span_cpu_percent,
)
from switchml.bench.floor import hub, worker


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_floor_moves_every_byte_through_the_hub_and_back():
    r, w = os.pipe()
    stop = os.fdopen(r)
    port = _free_udp_port()
    echoed: list[int] = []
    t = threading.Thread(target=lambda: echoed.append(hub(port, stop)), daemon=True)
    t.start()
    try:
        time.sleep(0.3)  # the hub binds before it prints "ready"
        data, dgram = 1_000_000, 1472
        res = worker(("127.0.0.1", port), data, datagram_bytes=dgram, window_bytes=256 << 10)
    finally:
        os.close(w)  # closing the pipe stops the hub
        t.join(timeout=10)
    per = dgram - 40
    assert res["datagrams"] == -(-data // per)
    assert res["timeouts"] == 0
    # It sent whole GSO runs: every datagram it counted came back, and no more.
    assert echoed and echoed[0] >= res["datagrams"] * dgram


def test_cpu_per_gelem_by_hand():
    # 4 workers of 2.5 CPU-s each over 5 x 10^8 elements each: 20 CPU-s per 10^9 elements;
    # the machine was busy 30 s over the span: 60.
    f = cpu_per_gelem(worker_cpu_s=[2.5] * 4, machine_busy=(100.0, 130.0), elements=5e8)
    assert f == pytest.approx({"worker_cpu_s_per_gelem": 20.0, "machine_cpu_s_per_gelem": 60.0})
    assert "machine_cpu_s_per_gelem" not in cpu_per_gelem(
        worker_cpu_s=[1.0], machine_busy=None, elements=1e9)
    assert ratio_text(12.0, 24.0) == "12.0 (0.50x)"
    assert ratio_text(12.0, None) == "12.0" and ratio_text(None, 3.0) == "-"


def test_machine_busy_grows_with_work():
    b0 = machine_busy_s()
    x = 0
    for i in range(3_000_000):
        x += i
    assert machine_busy_s() > b0 > 0


def test_span_cpu_percent_by_hand():
    # Two workers' samples of the switch, [t0, cpu0, t1, cpu1]: from the first start (t = 10,
    # 5.0 CPU-s) to the last end (t = 13, 6.5 CPU-s) it ran 1.5 s of 3: 50% of a core. The
    # second worker's own start and the first one's end do not count.
    assert span_cpu_percent([[10.0, 5.0, 12.0, 6.0], [10.5, 5.2, 13.0, 6.5]]) == \
        pytest.approx(50.0)
    assert span_cpu_percent([]) is None
    assert span_cpu_percent([[10.0, 5.0, 10.0, 5.0]]) is None  # no time between


def test_sample_processes_reads_what_getrusage_does():
    # This process's CPU over a busy loop, read from /proc by pid, against getrusage's (whole
    # ticks: within two of them)
    def own() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    tick = 1 / os.sysconf("SC_CLK_TCK")
    t0, c0, r0 = *sample_processes([os.getpid()]), own()
    x = 0
    for i in range(5_000_000):
        x += i
    t1, c1, r1 = *sample_processes([os.getpid()]), own()
    assert t1 > t0 and c1 - c0 > 0
    assert c1 - c0 == pytest.approx(r1 - r0, abs=2 * tick + 0.01)
    # two pids: their CPU summed
    assert sample_processes([os.getpid(), os.getpid()])[1] >= 2 * c1 - 2 * tick
    # a process that is gone (reaped): no sample, not an error
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert sample_processes([gone.pid]) is None
