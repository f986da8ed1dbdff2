"""Quorum groups (``switchml.torch.new_quorum_group``): a straggler does not set the pace, and
every rank still ends each step with the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch_procs as tp

pytestmark = pytest.mark.slow  # spawns a process group


@pytest.mark.timeout(120)
@pytest.mark.parametrize("deadline", [False, True], ids=["3-of-4", "4-of-4-or-3-at-50ms"])
def test_a_quorum_group_goes_on_without_its_straggler_and_every_rank_agrees(deadline):
    """Rank 3 sleeps half a second before each all-reduce and each backward. A quorum of 3
    completes every round without it; a quorum of all 4 with a 50 ms deadline and a minimum
    of 3 does too, 50 ms after each round opens."""
    world, slow, delay_s, steps = 4, 3, 0.5, 5
    quorum, extra = (4, (3, 0.05)) if deadline else (3, ())
    with tp.Procs(deadline_s=100) as procs:
        procs.start_ranks(tp.quorum_body, world, quorum, slow, delay_s, steps, *extra)
        res = procs.results(list(range(world)))
    for step in range(steps):
        # Ranks 0-2 (values 1, 2, 3) make each sum; AVG divides by the 3 it holds, on every
        # rank, the straggler's included.
        for r in range(world):
            assert np.array_equal(res[r]["sums"][step], np.full(20000, 2.0, np.float32)), (r, step)
        for r in range(world):
            if r != slow:  # never waited for the straggler's half second
                assert res[r]["seconds"][step] < delay_s / 2, res[r]["seconds"]
    for r in range(world):
        # DDP over the group with quorum_hook: the same parameters everywhere, bit for bit.
        assert res[r]["params"].tobytes() == res[0]["params"].tobytes()
        assert (res[r]["exact"] == 10.0).all()  # the default group stays exact: 1+2+3+4
        if r != slow:  # (DDP rebuilds its buckets at its second step: a gloo broadcast that
            # waits for every rank, once)
            assert max(res[r]["step_s"][2:]) < delay_s / 2, res[r]["step_s"]
    assert res[0]["stats"]["switch_ops"]["allreduce_partial"] >= steps
    assert res[slow]["stats"]["worker"]["results_left_out"] > 0


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_avg_in_a_quorum_group_divides_each_block_by_its_contributors(staged):
    """``StagedTensor.finish`` with per-block counts (no process group: the division alone).
    Uniform counts divide by one scalar; different counts divide block by block."""
    import torch

    from switchml.torch.staging import StagedTensor, StagingPool
    sums = torch.tensor([6.0, 6.0, 6.0, 8.0, 8.0, 8.0, 9.0])  # blocks of 3: counts 3, 2, 3
    t = sums.clone() if not staged else sums.clone().to(torch.bfloat16)
    plan = StagedTensor(t, pool=StagingPool(), dtype=torch.float32 if staged else None)
    plan.array[:] = sums.numpy()  # the switch's sum landed in the array the kernels wrote
    plan.finish(4, True, np.array([3, 2, 3]), 3)
    assert t.float().tolist() == [2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 3.0]
    u = sums.clone()
    StagedTensor(u).finish(4, True, np.array([2, 2, 2]), 3)
    assert u.tolist() == [3.0, 3.0, 3.0, 4.0, 4.0, 4.0, 4.5]
    v = sums.clone()
    StagedTensor(v).finish(4, True, None, 0)  # no quorum: the world size
    assert v.tolist() == [1.5, 1.5, 1.5, 2.0, 2.0, 2.0, 2.25]


@pytest.mark.timeout(120)
def test_a_rank_that_dies_mid_training_does_not_stop_a_quorum_group():
    """Rank 3 of 4 exits abruptly at step 3 of 8 (DDP over a quorum group of 3): the others
    finish every step, none waiting anything like the group's timeout, with the same
    parameters, bit for bit."""
    world, die_rank, die_step, steps = 4, 3, 3, 8
    with tp.Procs(deadline_s=100) as procs:
        procs.start_ranks(tp.quorum_dying_body, world, die_rank, die_step, steps)
        res = procs.results([0, 1, 2])
    for r in (0, 1, 2):
        assert len(res[r]["step_s"]) == steps
        assert max(res[r]["step_s"][die_step:]) < 5.0, res[r]["step_s"]
        assert res[r]["params"].tobytes() == res[0]["params"].tobytes()
