"""The geo testbed for real (root): WAN rate between data centres, LAN rate inside one, WAN
byte counters, teardown."""

from __future__ import annotations

import subprocess

import pytest

from switchml.testbed import GeoTestbed, GeoTopology, LinkSpec

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _rate(tcp_rate, tb: GeoTestbed, src: int, dst: int) -> tuple[float, int]:
    return tcp_rate(tb, tb.worker_ns(src), tb.worker_ns(dst), tb.geo.worker_ip(dst), 5202, 1.5)


def test_wan_between_data_centres_lan_inside_and_wan_bytes_counted(namespaces, tcp_rate):
    wan, lan = 20e6, 200e6
    topo = GeoTopology(dcs=(2, 2), lan=LinkSpec(bandwidth_bps=lan), wan=LinkSpec(bandwidth_bps=wan))
    with GeoTestbed(topo) as tb:
        created = set(tb.namespaces)
        assert created == {f"{tb.prefix}{n}" for n in ("rt", "d0", "d1", "w0", "w1", "w2", "w3")}
        w0 = tb.wan_bytes()
        inside, _ = _rate(tcp_rate, tb, 0, 1)
        assert tb.wan_bytes() - w0 < 100_000  # LAN traffic stays off the WAN
        across, sent = _rate(tcp_rate, tb, 1, 2)
        assert 0.85 * wan <= across <= 1.1 * wan, across
        assert 0.85 * lan <= inside <= 1.1 * lan, inside
        assert tb.wan_bytes() - w0 >= sent  # every payload byte crossed the WAN (plus headers)
    assert not (created & namespaces())  # torn down


def test_a_killed_geo_testbed_is_cleaned_up_with_its_data_centre_routers(py, namespaces):
    import signal

    from switchml.testbed import cleanup_stale

    owner = subprocess.Popen(py("""
        import time
        from switchml.testbed import GeoTestbed, GeoTopology
        tb = GeoTestbed(GeoTopology(dcs=(1, 1))).__enter__()
        print(tb.prefix, flush=True)
        time.sleep(300)
    """), stdout=subprocess.PIPE, text=True)
    prefix = owner.stdout.readline().strip()
    assert prefix, "the owner did not build its testbed"
    stale = {f"{prefix}{n}" for n in ("rt", "d0", "d1", "w0", "w1")}
    try:
        assert stale <= namespaces()
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert stale <= set(cleanup_stale())
        assert not stale & namespaces()
    finally:
        owner.kill()
        for ns in stale & namespaces():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _udp_rtts(py, tb: GeoTestbed, src: int, dst: int, count: int = 15) -> list[float]:
    """Round trips of ``count`` UDP echoes from worker ``src`` to worker ``dst``, seconds."""
    import json
    echo = tb.popen(tb.worker_ns(dst), py("""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 5303))
        print("ready", flush=True)
        while True:
            data, peer = s.recvfrom(2048); s.sendto(data, peer)
    """), stdout=subprocess.PIPE, text=True)
    assert echo.stdout.readline().strip() == "ready"
    out = tb.run(tb.worker_ns(src), py(f"""
        import socket, time, json
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
        rtts = []
        for i in range({count}):
            t0 = time.perf_counter(); s.sendto(bytes(100), ("{tb.geo.worker_ip(dst)}", 5303))
            s.recvfrom(2048); rtts.append(time.perf_counter() - t0)
        print(json.dumps(rtts))
    """))
    echo.kill()
    return json.loads(out)


def test_the_wan_round_trip_gains_the_delay_lines_delay(py, namespaces, tcp_rate):
    import statistics
    import time
    wan = 20e6
    topo = GeoTopology(dcs=(2, 2), wan=LinkSpec(bandwidth_bps=wan), wan_rtt_s=0.1)
    with GeoTestbed(topo) as tb:
        created = set(tb.namespaces)
        across = statistics.median(_udp_rtts(py, tb, 0, 2))
        inside = statistics.median(_udp_rtts(py, tb, 0, 1))
        assert 0.1 <= across <= 0.13, across  # one pass through the core each way
        assert inside < 0.01, inside  # the LAN is not delayed
        packets, cpu0 = tb.delay_line_packets(), tb.delay_line_cpu_s()
        assert packets["given_back"] >= 30  # 15 echoes, each way through the core
        rate, _ = tcp_rate(tb, tb.worker_ns(1), tb.worker_ns(3), tb.geo.worker_ip(3), 5204, 3.0)
        assert 0.7 * wan <= rate <= 1.1 * wan, rate  # the WAN's rate holds behind the delay
        time.sleep(0.2)  # the last packets out of the line
        after = tb.delay_line_packets()
        assert after["given_back"] > packets["given_back"] + 3 * wan / 8 / 1500 * 0.5
        assert after["taken"] == after["given_back"] and after["queue_drops"] == 0  # no loss
        assert tb.delay_line_cpu_s() > cpu0
        line = tb._delay_line
    assert line is not None and line.poll() is not None  # stopped with the testbed
    assert not (created & namespaces())
