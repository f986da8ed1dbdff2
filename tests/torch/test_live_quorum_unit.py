"""``LiveQuorum`` around its state stream, in one process: a replacement that no live rank
serves fails within its timeout, naming why, on every use (not None the second time); one
that closes while it waits stops listening at once; a state host beyond loopback without a
secret is refused before anything joins."""

from __future__ import annotations

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
