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
