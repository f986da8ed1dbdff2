"""``LiveQuorum`` around its state stream, in one process: a replacement that no live rank
serves fails within its timeout, naming why, on every use (not None the second time); one
that closes while it waits stops listening at once; a state host beyond loopback without a
secret is refused before anything joins."""

from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist

from switchml.protocol.errors import ConfigError, OperationFailed
from switchml.torch.live import LiveQuorum
from switchml.transport.udp import SwitchServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def job():
    with SwitchServer(host="127.0.0.1", port=0) as server:
        store = dist.HashStore()
        switch = f"{server.address[0]}:{server.address[1]}"
        first = LiveQuorum(store, 0, 2, 1, switch=switch, timeout_s=2.0)
        yield store, switch
        first.close()


def test_a_replacement_nobody_serves_fails_in_time_on_every_use(job):
    store, switch = job
    t0 = time.monotonic()
    new = LiveQuorum(store, 1, 2, 1, switch=switch, replacement=True, timeout_s=2.0)
    for _ in range(2):  # (the second use raises too: it is not a rank without a state)
        with pytest.raises(OperationFailed, match="no live rank sent the state within 2 s"):
            new.state  # noqa: B018 - the property waits
    with pytest.raises(OperationFailed, match="no live rank"):
        new.skip_step()
    assert time.monotonic() - t0 < 10
    new.close()


def test_a_replacement_that_closes_while_it_waits_stops_listening_at_once(job):
    store, switch = job
    new = LiveQuorum(store, 1, 2, 1, switch=switch, replacement=True, timeout_s=30.0)
    t0 = time.monotonic()
    new.close()
    assert time.monotonic() - t0 < 5  # (not the 30 s it would have waited)
    with pytest.raises(OperationFailed, match="closed while it waited"):
        new.state  # noqa: B018


def test_a_state_host_beyond_loopback_needs_a_secret(job):
    store, switch = job
    with pytest.raises(ConfigError, match="SWITCHML_SECRET"):
        LiveQuorum(store, 1, 2, 1, switch=switch, replacement=True, timeout_s=2.0,
                   state_host="10.9.8.7")


def test_a_live_job_whose_switch_dies_goes_on_over_gloo_without_its_dead_rank():
    """Three ranks, quorum 2, ``failover="gloo"``; rank 2 never comes (dead). Ranks 0 and 1
    average through the switch; then the switch dies. Their next all-reduce gets no answer
    for the timeout, they wait the timeout for rank 2 to say it is alive, write the roster
    without it, and average over a gloo group of the two: each gets the mean of the two
    ranks' tensors, exactly."""
    import threading

    import torch
    store = dist.HashStore()
    with SwitchServer(host="127.0.0.1", port=0) as server:
        switch = f"{server.address[0]}:{server.address[1]}"
        ranks = [LiveQuorum(store, r, 3, 2, switch=switch, timeout_s=1.5, failover="gloo")
                 for r in (0, 1)]

        def both(values: list[float]) -> list[torch.Tensor]:
            out = [torch.full((1000,), v) for v in values]
            threads = [threading.Thread(target=ranks[r].allreduce, args=(out[r],))
                       for r in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            return out

        first = both([1.0, 3.0])
        assert all(torch.equal(t, torch.full((1000,), 2.0)) for t in first), first
    t0 = time.monotonic()
    second = both([5.0, 10.0])  # the switch is gone: over gloo, exactly
    took = time.monotonic() - t0
    assert all(torch.equal(t, torch.full((1000,), 7.5)) for t in second), second
    assert 1.5 < took < 1.5 + 1.5 + 5.0, took  # its timeout, the roster's, then gloo
    for q in ranks:
        fo = q.stats()["failover"]
        assert fo["switch_overs"] == 1 and fo["active"] and fo["ops_over_gloo"] == 1, fo
        q.close()
    assert json.loads(store.get("switchml/live/failover/roster/0/list")) == [0, 1]
