"""Topology data and its tc/nft translation: pure, no root needed."""

from __future__ import annotations

import pytest

from switchml.protocol.errors import ConfigError
from switchml.testbed.topology import LinkSpec, Topology, nft_loss_ruleset, tbf_args


def test_tbf_arguments_carry_rate_burst_and_queue():
    link = LinkSpec(bandwidth_bps=1e9, mtu=9000, queue_s=0.02)
    assert tbf_args(link) == ["tbf", "rate", "1000000000bit", "burst", "125000", "latency",
                              "20ms"]
    small = LinkSpec(bandwidth_bps=1e6, mtu=65000)
    assert int(tbf_args(small)[4]) >= 2 * 65000  # the bucket holds at least two frames
    assert tbf_args(LinkSpec(bandwidth_bps=None)) == []


def test_loss_rules_drop_where_packets_arrive():
    text = nft_loss_ruleset("smlloss", 0.01, ("input", "forward"))
    assert "table inet smlloss" in text
    assert text.count("numgen random mod 1000000 < 10000 counter drop") == 2
    assert "hook input" in text and "hook forward" in text and "hook output" not in text


def test_addresses_are_per_link():
    topo = Topology(workers=3)
    assert [topo.worker_ip(i) for i in range(3)] == ["10.201.0.2", "10.201.1.2", "10.201.2.2"]
    assert topo.switch_ip(2) == "10.201.2.1"
    assert topo.ps_ip == "10.201.250.2"


@pytest.mark.parametrize("kwargs, match", [
    ({"bandwidth_bps": 10.0}, "bandwidth_bps"),
    ({"loss_rate": 1.0}, "loss_rate"),
    ({"loss_rate": -0.1}, "loss_rate"),
    ({"mtu": 70000}, "mtu"),
    ({"queue_s": 0.0}, "queue_s"),
])
def test_bad_links_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LinkSpec(**kwargs)


def test_bad_topologies_are_refused():
    with pytest.raises(ConfigError, match="workers"):
        Topology(workers=0)
    with pytest.raises(ConfigError, match="subnet"):
        Topology(workers=2, subnet="10.1.2")
