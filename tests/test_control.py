"""Job set-up (``switchml.control``): a new job's chunks fit the path MTU unless told otherwise."""

from __future__ import annotations

import pytest

from switchml.control import decode_job_spec, encode_job_spec, new_job_spec
from switchml.protocol.wire import HEADER_SIZE, elements_for_mtu
from switchml.transport.sockets import local_mtu, path_mtu

LOOPBACK = ("127.0.0.1", 48864)
IP_UDP = 20 + 8


def _datagram_bytes(k: int) -> int:
    return IP_UDP + HEADER_SIZE + 4 * k


def test_a_default_job_fits_an_ethernet_path():
    """``new_job_spec(n)`` knows no path: its datagrams fit 1500 bytes (they were 64 KB)."""
    spec = new_job_spec(2)
    assert spec.elements_per_packet == 358
    assert _datagram_bytes(spec.elements_per_packet) <= 1500
    assert spec.window == 128  # about 256 KiB in flight


def test_a_job_for_a_switch_fits_this_hosts_path_to_it(monkeypatch):
    monkeypatch.delenv("SWITCHML_MTU", raising=False)
    mtu = path_mtu(LOOPBACK)
    assert mtu is not None and local_mtu(LOOPBACK) == mtu
    spec = new_job_spec(2, switch=LOOPBACK)
    assert spec.elements_per_packet == elements_for_mtu(mtu)  # 16366 at loopback's 65536
    assert _datagram_bytes(spec.elements_per_packet) <= max(mtu, 65535)
    # The shards of a sharded switch: the smallest MTU of them.
    assert new_job_spec(2, switch=[LOOPBACK, ("127.0.0.1", 48865)]).elements_per_packet == (
        spec.elements_per_packet)


@pytest.mark.parametrize(("mtu", "k"), [(1500, 358), (9000, 2233)])
def test_switchml_mtu_overrides_the_route_as_for_the_torch_backend(monkeypatch, mtu, k):
    monkeypatch.setenv("SWITCHML_MTU", str(mtu))
    assert local_mtu(LOOPBACK) == mtu
    assert new_job_spec(2, switch=LOOPBACK).elements_per_packet == k


def test_an_explicit_chunk_size_wins():
    assert new_job_spec(2, switch=LOOPBACK, elements_per_packet=64).elements_per_packet == 64
    assert new_job_spec(2, elements_per_packet=16000).window == 16


def test_a_spec_survives_its_text_form():
    spec = new_job_spec(3, switch=LOOPBACK)
    assert decode_job_spec(encode_job_spec(spec)) == spec
