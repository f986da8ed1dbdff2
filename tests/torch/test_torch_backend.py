"""The "switchml" torch.distributed backend against gloo, in one spawned group of 3 ranks.

The group runs every check once (``backend_checks.backend_body``: each check a function of its
own, registered in ``backend_checks.CHECKS``); each test below reads one check's outcome on every
rank. Collectives per check: see the checks in backend_checks.py.
"""

from __future__ import annotations

import backend_checks as bc
import pytest
import torch_procs as tp

WORLD = 3
OTHER_CHECKS = [
    "half_precision_bytes_and_bits",
    "allreduce_bucket_bits_and_residual",
    "allreduce_bitwise_same_on_all_ranks",
    "complex64_sum",
    "async_op_work_and_future",
    "all_reduce_coalesced",
    "min_max_product_delegated_and_counted",
    "other_collectives_delegated",
    "tensor_collectives_counted",
    "stats_api",
    "new_group_subset",
    "functional_collectives",
    "device_mesh",
    "ddp_over_torch_compile",
    "overlap_async_returns_before_completion",
    "overlap_ddp_buckets_during_backward",
]
ALL_CHECKS = [f"allreduce[{c}]" for c in bc.ALLREDUCE_CASES] + [
    getattr(c, "values", (c,))[0] for c in OTHER_CHECKS]

pytestmark = [pytest.mark.timeout(200), pytest.mark.slow]


@pytest.fixture(scope="module")
def group():
    """Run the whole group to the end (processes gone) before any test looks at it."""
    with tp.Procs(deadline_s=170) as procs:
        procs.start_ranks(bc.backend_body, WORLD)
        results = procs.results(WORLD)
    return {"results": results, "leftover": procs.leftover,
            "leftover_switches": procs.leftover_switches}


def _outcome(group, name):
    return {rank: res["checks"].get(name, "check did not run")
            for rank, res in group["results"].items()}


def test_every_check_ran(group):
    for rank, res in group["results"].items():
        assert sorted(res["checks"]) == sorted(ALL_CHECKS), f"rank {rank}"


@pytest.mark.parametrize("case", bc.ALLREDUCE_CASES)
def test_allreduce_matches_gloo_within_bound(group, case):
    """dtype x op x shape: in place, through the switch, exact for ints, within the bound."""
    failures = {r: m for r, m in _outcome(group, f"allreduce[{case}]").items() if m}
    assert not failures, failures


@pytest.mark.parametrize("name", OTHER_CHECKS)
def test_backend_check(group, name):
    failures = {r: m for r, m in _outcome(group, name).items() if m}
    assert not failures, failures


def test_stats_count_switch_and_delegated_ops(group):
    for rank, res in group["results"].items():
        stats = res["stats"]
        # the 72 dtype x op x shape cases, plus the other checks' SUM/AVG calls
        assert stats["switch_ops"]["allreduce"] >= len(bc.ALLREDUCE_CASES), (rank, stats)
        for key in ("allreduce:MIN", "allreduce:MAX", "allreduce:PRODUCT", "broadcast",
                    "allgather", "barrier"):
            assert stats["delegated"].get(key, 0) >= 1, (rank, key, stats["delegated"])


def test_group_left_no_process_behind(group):
    assert group["leftover_switches"] == []
    assert group["leftover"] == []
