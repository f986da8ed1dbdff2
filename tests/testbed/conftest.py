"""Helpers of the root testbed tests, as session fixtures whose value is the helper function
(the ``root`` mark's skip, ``py`` and the other shared helpers are in tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess

import pytest


@pytest.fixture(scope="session")
def namespaces():
    """A function: the network namespaces that exist now."""
    def namespaces() -> set[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return {line.split()[0] for line in out.splitlines() if line.strip()}
    return namespaces


@pytest.fixture(scope="session")
def tcp_rate(py):
    """A function: ``tcp_rate(tb, src_ns, dst_ns, dst_ip, port, seconds)`` sends TCP from
    namespace ``src_ns`` to a sink at ``dst_ip:port`` in ``dst_ns`` for ``seconds``; returns
    the rate the sink measured (bit/s, from its first byte) and the bytes it received."""
    def tcp_rate(tb, src_ns: str, dst_ns: str, dst_ip: str, port: int,
                 seconds: float) -> tuple[float, int]:
        sink = tb.popen(dst_ns, py(f"""
            import socket, time, json
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", {port})); s.listen(1); print("ready", flush=True)
            c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
            while True:
                k = c.recv_into(buf)
                if not k: break
                if t0 is None: t0 = time.perf_counter()
                n += k
            print(json.dumps({{"bytes": n, "seconds": time.perf_counter() - t0}}))
        """), stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "ready"
        tb.run(src_ns, py(f"""
            import socket, time
            c = socket.create_connection(("{dst_ip}", {port}))
            data = bytes(1 << 16); end = time.perf_counter() + {seconds}
            while time.perf_counter() < end: c.sendall(data)
            c.close()
        """))
        res = json.loads(sink.stdout.readline())
        sink.wait(timeout=10)
        return res["bytes"] * 8 / res["seconds"], res["bytes"]
    return tcp_rate
