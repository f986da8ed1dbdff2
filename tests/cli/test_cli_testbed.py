"""``switchml testbed`` (``cli/testbed.py``): the topology it builds and what it prints, with the
namespaces replaced by a stand-in (the real ones need root: tests/testbed)."""

from __future__ import annotations

import pytest

from switchml import testbed as library
from switchml.cli import main, testbed
from switchml.testbed import GeoTopology, LinkSpec, Topology


def test_flags_become_the_topology(parse):
    args = parse("testbed", "-n", "3", "--rate-mbit", "250", "--loss", "0.01", "--mtu", "9000")
    assert args.func is testbed.run
    assert testbed.config_from_args(args) == Topology(
        workers=3, link=LinkSpec(bandwidth_bps=250e6, loss_rate=0.01, mtu=9000))
    assert testbed.config_from_args(parse("testbed", "--rate-mbit", "0")).link.bandwidth_bps \
        is None
    geo = testbed.geo_config_from_args(parse("testbed", "--dcs", "2x3", "--wan-mbit", "10",
                                             "--wan-rtt-ms", "150"))
    assert geo == GeoTopology(dcs=(3, 3), lan=LinkSpec(bandwidth_bps=1e9),
                              wan=LinkSpec(bandwidth_bps=10e6), wan_rtt_s=0.15)


class _FakeTestbed:
    """Enough of :class:`switchml.testbed.Testbed` for the command's printout."""

    built: list[Topology] = []

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.prefix, self.switch_ns, self.ps_ns, self.router_ns = "p", "p-sw", "p-ps", "p-r"
        self.batching = False

    def worker_ns(self, i: int) -> str:
        return f"p-w{i}"

    def __enter__(self) -> _FakeTestbed:
        self.built.append(self.topology)
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_the_runner_builds_holds_and_removes_it(monkeypatch, stopped_at_once, capsys):
    stopped_at_once(testbed)
    monkeypatch.setattr(library, "Testbed", _FakeTestbed)
    _FakeTestbed.built.clear()
    assert main(["testbed", "-n", "2", "--rate-mbit", "100"]) == 0
    assert [t.workers for t in _FakeTestbed.built] == [2]
    out = capsys.readouterr().out
    assert "testbed p is up: 2 workers" in out and "ip netns exec p-w1" in out
    assert "off (no ethtool): SWITCHML_GSO=0 in there" in out
    assert out.rstrip().endswith("testbed removed")


def test_cleanup_removes_what_killed_runs_left(record, capsys):
    record(library, "check_environment")
    record(library, "cleanup_stale", ["sm1-w0", "sm1-r"])
    assert main(["testbed", "--cleanup"]) == 0
    assert "removed 2 stale namespace(s): sm1-w0, sm1-r" in capsys.readouterr().out


def test_without_root_it_says_so(record, capsys):
    record(library, "check_environment", library.TestbedError("needs root"))
    assert main(["testbed", "--cleanup"]) == 2
    assert "switchml: error: needs root" in capsys.readouterr().err


def test_a_bad_layout_is_refused(parse):
    from switchml.protocol.errors import ConfigError
    with pytest.raises(ConfigError):
        testbed.geo_config_from_args(parse("testbed", "--dcs", "two"))
