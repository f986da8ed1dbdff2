"""Placement and step rules of the parameter servers, without sockets."""

from __future__ import annotations

import numpy as np
import pytest

from switchml.protocol.errors import ConfigError
from switchml.ps import format_placement, place
from switchml.ps.rules import AsyncStepRule, Decision, SyncStepRule


def test_placement_is_round_robin_by_tensor_and_splits_large_tensors():
    shards = place([("a", 10), ("b", 25), ("c", 3)], 2, max_shard_elements=10)
    # a whole, b in three pieces (9, 8, 8), c whole; servers take turns over the pieces
    assert [(s.name, s.offset, s.numel, s.server) for s in shards] == [
        ("a", 0, 10, 0), ("b", 0, 9, 1), ("b", 9, 8, 0), ("b", 17, 8, 1), ("c", 0, 3, 0)]
    assert [s.shard_id for s in shards] == list(range(5))
    text = format_placement(shards, 2)
    assert "per server: ps0=21, ps1=17" in text and "b[9:]" in text


def test_placement_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="at least one parameter server"):
        place([("a", 1)], 0)
    with pytest.raises(ConfigError, match="no parameters"):
        place([], 1)


def test_sync_step_takes_first_n_minus_b_and_drops_late_ones():
    rule = SyncStepRule(workers=3, backup=1)
    g = [np.full(4, float(w + 1), np.float32) for w in range(3)]
    assert rule.offer(worker=2, step=0, grad=g[2]) is Decision.ACCEPTED
    assert rule.offer(worker=0, step=0, grad=g[0]) is Decision.COMPLETED
    total, who = rule.take_sum()
    assert who == [0, 2] and total.tolist() == [4.0] * 4 and rule.step == 1
    # worker 1's gradient for step 0 comes late: dropped and counted
    assert rule.offer(worker=1, step=0, grad=g[1]) is Decision.DROPPED_LATE
    assert rule.dropped == 1 and rule.step == 1


def test_sync_without_backup_waits_for_all_and_sums_in_worker_order():
    rule = SyncStepRule(workers=3)
    vals = [np.array([1e8], np.float32), np.array([1.0], np.float32),
            np.array([-1e8], np.float32)]
    assert rule.offer(worker=2, step=0, grad=vals[2]) is Decision.ACCEPTED
    assert rule.offer(worker=1, step=0, grad=vals[1]) is Decision.ACCEPTED
    assert rule.offer(worker=0, step=0, grad=vals[0]) is Decision.COMPLETED
    total, _ = rule.take_sum()
    # worker order: (1e8 + 1) - 1e8 = 0 in float32, whatever the arrival order (2, 1, 0 would
    # give (-1e8 + 1) + 1e8 = 0 too, but 2, 0, 1 would give 1): fixed order, fixed result
    assert total.tolist() == [np.float32(np.float32(1e8) + np.float32(1.0)) - np.float32(1e8)]


def test_sync_rejects_double_and_future_pushes():
    rule = SyncStepRule(workers=2)
    rule.offer(worker=0, step=0, grad=np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="twice"):
        rule.offer(worker=0, step=0, grad=np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="must pull first"):
        rule.offer(worker=1, step=3, grad=np.zeros(1, np.float32))
    with pytest.raises(ConfigError):
        SyncStepRule(workers=2, backup=2)


def test_async_applies_every_gradient():
    rule = AsyncStepRule(workers=2)
    for i in range(3):
        assert rule.offer(worker=i % 2, step=0, grad=np.ones(1, np.float32)) is Decision.COMPLETED
        _, who = rule.take_sum()
        assert who == [i % 2]
    assert rule.step == 3 and rule.dropped == 0
