"""The soak benchmark (``switchml bench soak``): a short run with loss and worker churn."""

from __future__ import annotations

import pytest

from switchml.bench.soak import SoakConfig, run_soak


@pytest.mark.slow
def test_short_soak_has_no_wrong_results_and_returns_every_slot():
    report = run_soak(SoakConfig(duration_s=8.0, jobs=2, workers=2, numel=20_000,
                                 loss_rate=0.02, churn_interval_s=3.0, kill_fraction=1.0,
                                 lease_timeout_s=4.0, op_timeout_s=3.0, seed=1))
    # (A 2 s lease lost both jobs in 2 of 4 fresh-clone CI runs. Likely, not proven: with a
    # keep-alive every 1 s, a 2 s stall of the 2-core machine while a new job's processes
    # start is enough. The
    # switch's lease timer runs on its own thread, and after a stall it can expire a job whose
    # datagrams are still waiting in the socket: a known weakness, docs/operations.md.)
    assert report.operations > 50
    assert report.wrong_results == 0
    assert report.workers_killed >= 1
    assert report.switch_stats["jobs"] == 0 and report.switch_stats["slots_in_use"] == 0
    assert report.switch_stats["internal_errors"] == 0
