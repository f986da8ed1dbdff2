"""Hierarchical aggregation over the testbed (root): two racks, each a star around its router
with its rack switch, under a spine switch; exact sums, and the one-rack baseline alongside."""

from __future__ import annotations

import pytest


def test_loss_on_the_tree_testbed_is_refused_not_ignored():
    """The tree testbed applies no loss: asking for it says so (before building anything)
    instead of measuring loss-free links under a lossy label."""
    from switchml.bench.testbed import TestbedBenchConfig
    from switchml.bench.testbed_tree import run_testbed_tree
    cfg = TestbedBenchConfig(workers=2, sizes_bytes=(1 << 20,), loss_rate=0.01)
    with pytest.raises(ValueError, match="the tree testbed applies no loss"):
        run_testbed_tree(cfg, racks=2)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_racks_under_a_spine_sum_exactly_on_the_testbed():
    from switchml.bench.testbed import TestbedBenchConfig
    from switchml.bench.testbed_tree import run_testbed_tree
    cfg = TestbedBenchConfig(workers=2, sizes_bytes=(1 << 20,), iters=2, warmup=1,
                             systems=("switchml",), rate_bps=1e9, mtu=1500)
    rows = run_testbed_tree(cfg, racks=2)
    by = {r["system"]: r for r in rows}
    assert set(by) == {"switchml-tree", "switchml-rack"}
    tree = by["switchml-tree"]
    assert tree["workers"] == 4 and tree["max_abs_error"] == 0.0
    assert by["switchml-rack"]["max_abs_error"] == 0.0
    for rack in tree["rack_switches"]:
        assert rack["error"] is None
        assert rack["tree"]["upstream_sent"] > 0
        assert rack["tree"]["parent_results"] == rack["tree"]["upstream_sent"]
