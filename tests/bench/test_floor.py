"""The data-movement floor (``bench/floor.py``) and the CPU figures every benchmark reports."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from switchml.bench.cpu import cpu_per_gelem, machine_busy_s, ratio_text
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
