"""Jobs at once over the testbed (root): four workers split into two jobs of two that share
the switch (as HSDP's shard groups do), each with its own inputs; every worker's sums are its
own job's, exactly, and gloo's two rings run alongside."""

from __future__ import annotations

import pytest


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_jobs_at_once_each_sum_their_own_inputs_on_the_testbed():
    from switchml.bench.testbed import TestbedBenchConfig, run_testbed_allreduce
    cfg = TestbedBenchConfig(workers=4, jobs=2, sizes_bytes=(4 << 20,), iters=2, warmup=1,
                             systems=("switchml", "gloo"), rate_bps=1e9, mtu=1500)
    rows = run_testbed_allreduce(cfg)
    by = {r["system"]: r for r in rows}
    assert by["switchml"]["jobs"] == 2 and by["switchml"]["workers"] == 2
    # (job j's inputs are offset by 100 j: a request taken into the other job shows)
    assert by["switchml"]["max_abs_error"] == 0.0
    assert by["gloo"]["ate_per_s"] > 0
    # the row says its wire width (sim --compare predicts 32-bit rows only), and the switch's
    # share of a core over the workers' timed loops
    assert by["switchml"]["bits"] == 32 and "bits" not in by["gloo"]
    assert 0 < by["switchml"]["switch_cpu_percent"] <= 100 * 2 + 10
    drops = rows[-1]["switch_final"]["drops"]
    assert not {"wrong_source", "bad_token", "unknown_job", "not_joined"} & set(drops), drops
