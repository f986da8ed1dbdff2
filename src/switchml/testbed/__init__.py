"""Emulated network testbed: Linux network namespaces, veth links, tc tbf and nftables loss.

``Topology`` (pure data, see topology.py) describes a star: one namespace per worker, one for the
switch (which also routes worker-to-worker traffic, like the rack switch it emulates) and one for
a parameter server host. ``Testbed`` (netns.py) builds it, runs processes inside it and removes
exactly what it created. Needs root; everything else in switchml does not.
"""

from switchml.testbed.netns import (
    GeoTestbed,
    Testbed,
    TestbedError,
    check_environment,
    cleanup_stale,
)
from switchml.testbed.topology import GeoTopology, LinkSpec, Topology

__all__ = ["GeoTestbed", "GeoTopology", "LinkSpec", "Testbed", "TestbedError", "Topology",
           "check_environment", "cleanup_stale"]
