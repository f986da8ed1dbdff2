"""GeoTopology as plain data (no root)."""

from __future__ import annotations

import pytest

from switchml.protocol.errors import ConfigError
from switchml.testbed import GeoTopology, LinkSpec


def test_workers_are_numbered_across_data_centres():
    g = GeoTopology(dcs=(2, 3))
    assert g.workers == 5
    assert [g.dc_of(i) for i in range(5)] == [0, 0, 1, 1, 1]
    assert g.workers_of(1) == [2, 3, 4]
    assert g.worker_ip(3) == "10.202.3.2" and g.gateway_ip(3) == "10.202.3.1"
    assert g.wan_router_ip(1) == "10.202.201.2" and g.wan_core_ip(1) == "10.202.201.1"
    assert g.wan.bandwidth_bps == 50e6 and g.lan.bandwidth_bps == 1e9


def test_bad_geo_topologies_are_refused():
    with pytest.raises(ConfigError, match="data centres"):
        GeoTopology(dcs=())
    with pytest.raises(ConfigError, match="data centres"):
        GeoTopology(dcs=(2, 0))
    with pytest.raises(ConfigError, match="no loss"):
        GeoTopology(wan=LinkSpec(bandwidth_bps=50e6, loss_rate=0.01))
    with pytest.raises(ConfigError, match="out of range"):
        GeoTopology().dc_of(4)
    with pytest.raises(ConfigError, match="wan_rtt_s must be in"):
        GeoTopology(wan_rtt_s=-0.05)
