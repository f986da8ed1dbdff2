"""Topology data and its tc/nft translation: pure, no root needed."""

from __future__ import annotations

import pytest

from switchml.protocol.errors import ConfigError
from switchml.testbed.topology import (
    GSO_RUN_BYTES,
    LinkSpec,
    Topology,
    ethtool_args,
    nft_host_loss_ruleset,
    nft_loss_ruleset,
    tbf_args,
)


def test_tbf_arguments_carry_rate_burst_and_queue():
    link = LinkSpec(bandwidth_bps=1e9, mtu=9000, queue_s=0.02)
    assert tbf_args(link) == ["tbf", "rate", "1000000000bit", "burst", "125000", "latency",
                              "20ms"]
    small = LinkSpec(bandwidth_bps=1e6, mtu=65000)
    assert int(tbf_args(small)[4]) >= 2 * 65000  # the bucket holds at least two frames
    assert tbf_args(LinkSpec(bandwidth_bps=None)) == []


def test_the_bucket_holds_a_whole_gso_run():
    # a smaller bucket makes tbf cut the run and pace its datagrams one by one: no GRO batches
    assert int(tbf_args(LinkSpec(bandwidth_bps=100e6, mtu=1500))[4]) >= GSO_RUN_BYTES
    assert GSO_RUN_BYTES >= 65536 + 64 * 66  # 64 KiB of payload, 64 segments' headers


def test_loss_rules_drop_once_per_link_and_never_on_output():
    rule = "numgen random mod 1000000 < 10000 counter drop"
    # the router: uplink loss, once for the link a packet arrives on (input: to the switch;
    # forward: worker to worker), never on output (a GSO run is still whole there, and a
    # drop there gives the sender EPERM)
    text = nft_loss_ruleset("smlloss", 0.01)
    assert "table inet smlloss" in text
    assert text.count(rule) == 2
    assert "hook input" in text and "hook forward" in text and "hook output" not in text
    assert f'iifname != "lo" {rule}' in text
    assert "oifname" not in text  # the downlink's loss is the receiving host's
    # each receiving host: downlink loss at its input
    host = nft_host_loss_ruleset("smlloss", 0.01)
    assert "table inet smlloss" in host and host.count(rule) == 1
    assert f'iifname != "lo" {rule}' in host
    assert "hook input" in host and "hook output" not in host and "hook forward" not in host


def test_every_end_sends_wire_packets_and_hosts_merge_only_without_loss():
    assert ethtool_args("h0", True) == ["h0", "tso", "off", "tx-udp-segmentation", "off",
                                        "gro", "on"]
    assert ethtool_args("h0", True, 0.0)[-2:] == ["gro", "on"]
    # with loss the host's input rule must see single datagrams: GRO merges before netfilter
    assert ethtool_args("h0", True, 0.01) == ["h0", "tso", "off", "tx-udp-segmentation", "off",
                                              "gro", "off"]
    assert ethtool_args("s0", False)[-2:] == ["gro", "on"]  # no loss rules: batches
    assert ethtool_args("s0", False, 0.01)[-2:] == ["gro", "off"]


def test_addresses_are_per_link():
    topo = Topology(workers=3)
    assert [topo.worker_ip(i) for i in range(3)] == ["10.201.0.2", "10.201.1.2", "10.201.2.2"]
    assert topo.gateway_ip(2) == "10.201.2.1"
    # the switch runs in the router: each worker talks to its own gateway address
    assert topo.switch_ip(2) == topo.gateway_ip(2) == "10.201.2.1"
    assert topo.switch_ip(0) == topo.switch_ip() == "10.201.0.1"
    assert topo.ps_ip == "10.201.250.2"


def test_the_default_mtu_is_ethernets():
    from switchml.bench.testbed import TestbedBenchConfig, elements_for_mtu
    from switchml.bench.testbed_train import TrainBenchConfig
    from switchml.cli import build_parser
    assert LinkSpec().mtu == 1500
    assert TestbedBenchConfig().mtu == TrainBenchConfig().mtu == 1500
    parser = build_parser()
    assert parser.parse_args(["testbed"]).mtu == 1500
    # bench allreduce's --mtu defaults to the testbed's 1500 with --testbed, the path MTU
    # without (loopback): it is left unset and resolved when the benchmark is built.
    from switchml.bench.testbed import DEFAULT_MTU
    assert parser.parse_args(["bench", "allreduce", "--testbed"]).mtu is None
    assert DEFAULT_MTU == 1500
    assert parser.parse_args(["bench", "train"]).mtu == 1500
    assert parser.parse_args(["bench", "allreduce", "--testbed", "--mtu", "9000"]).mtu == 9000
    # IPv4 20 + UDP 8 + switchml 40 bytes of headers, 4-byte elements
    assert elements_for_mtu(1500) == 358 and 20 + 8 + 40 + 4 * 358 <= 1500 < 20 + 8 + 40 + 4 * 359
    assert elements_for_mtu(9000) == 2233
    assert elements_for_mtu(65535) == 16366  # the UDP limit
    assert TestbedBenchConfig(mtu=9000).elements_per_packet == 2233


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
