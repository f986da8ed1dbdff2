"""The switch's metrics endpoint (``control/metrics.py``, ``start_exporter``) against strangers
on its port: half-open requests neither grow its threads without bound nor keep a scrape out,
and a silent connection is closed after ``SCRAPE_TIMEOUT_S``."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from switchml.control import metrics
from switchml.control.metrics import read_metrics, start_exporter
from switchml.transport.udp import SwitchServer


@pytest.fixture(params=[None])
def exporter(monkeypatch, request):
    """An exporter of MAX_SCRAPES 8 and SCRAPE_TIMEOUT_S 1 s (or the test's ``timeout``)."""
    monkeypatch.setattr(metrics, "MAX_SCRAPES", 8)
    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_S", request.param or 1.0)
    server = SwitchServer(host="127.0.0.1", port=0).start()
    http, _ = start_exporter(server.stats, server.dataplane.config.pool_slots, "127.0.0.1", 0)
    try:
        yield http
    finally:
        http.shutdown()
        http.server_close()
        server.stop()


@pytest.mark.parametrize("exporter", [10.0], indirect=True)  # none times out meanwhile
def test_half_open_requests_are_bounded_and_a_scrape_still_answers(exporter):
    host, port = exporter.server_address[:2]
    threads0 = threading.active_count()
    half_open = []
    for _ in range(40):  # each sends part of a request line, then nothing
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(b"GET /metr")
        half_open.append(s)
    deadline = time.monotonic() + 5
    while exporter.evicted < 40 - 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    # at most MAX_SCRAPES of them hold a thread: each newcomer closed the oldest
    assert exporter.evicted == 40 - 8
    time.sleep(0.1)  # (the evicted ones' threads end)
    assert threading.active_count() - threads0 <= 8 + 1
    t0 = time.monotonic()
    scraped = read_metrics(f"http://{host}:{port}/metrics", timeout_s=5)
    assert "switchml_jobs" in scraped and time.monotonic() - t0 < 1.0
    # the oldest were closed by the server: their reads end
    half_open[0].settimeout(5)
    assert half_open[0].recv(1) == b""
    for s in half_open:
        s.close()


def test_a_silent_connection_is_closed_after_the_scrape_timeout(exporter):
    host, port = exporter.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /metrics HTTP/1.1\r\n")  # the headers never end
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
        took = time.monotonic() - t0
    assert 0.9 <= took < 1.0 + 2.0, took
    assert exporter.failed >= 1  # counted, not printed


def _hostile_http(answer):
    """A one-connection-at-a-time server on 127.0.0.1 that reads the request and runs
    ``answer(conn)``; returns (url, stop)."""
    lst = socket.create_server(("127.0.0.1", 0))
    lst.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = lst.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(4096)
                    answer(conn, stop)
                except OSError:
                    pass
        lst.close()
    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{lst.getsockname()[1]}/metrics", stop


def _not_http(conn, stop):
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")


def _endless(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
    line = b"# " + b"x" * 1022 + b"\n"
    while not stop.is_set():
        conn.sendall(line * 64)


def _drip(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    while not stop.wait(0.2):
        conn.sendall(b"#")


def _not_prometheus(conn, stop):
    body = b"\xff\xfe this is not a metrics page {{{"
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize("answer, match", [
    (_not_http, "not an HTTP answer"),
    (_endless, "sent more than 1 MiB"),
    (_drip, "did not send its page within 1 s"),
    (_not_prometheus, "not Prometheus text")])
def test_reading_a_hostile_endpoint_ends_in_a_clear_error_in_bounded_time(monkeypatch, answer,
                                                                          match):
    """``switchml stats`` and ``top`` read a URL the user gives: something that is not a
    switch's metrics page, however it misbehaves, gives a ValueError that says so, within
    the timeout (checked between reads) and ``MAX_METRICS_BYTES``."""
    monkeypatch.setattr(metrics, "MAX_METRICS_BYTES", 1 << 20)
    url, stop = _hostile_http(answer)
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match=match):
            read_metrics(url, timeout_s=1.0)
    finally:
        stop.set()
    assert time.monotonic() - t0 < 1.0 + 1.0 + 1.0  # the deadline, and one read's timeout


def test_switchml_stats_on_something_that_is_not_a_switch_says_so(capsys):
    from switchml.cli import main
    url, stop = _hostile_http(_not_http)
    try:
        assert main(["stats", "--url", url, "--once"]) == 2
    finally:
        stop.set()
    err = capsys.readouterr().err
    assert "switchml: error:" in err and "not a switchml metrics endpoint" in err
    assert "Traceback" not in err
