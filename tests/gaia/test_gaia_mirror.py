"""Gaia between two data centres over loopback TCP (one worker each, threads)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from switchml.gaia.mirror import GaiaError, Mirror


def _leaders(free_ports) -> list[tuple[str, int]]:
    return [("127.0.0.1", port) for port in free_ports(2)]


def _two_mirrors(leaders, timeout_s: float) -> tuple[Mirror, Mirror]:
    """Data centres 0 and 1 connected (1 started in a thread: each waits for the other)."""
    m1 = Mirror(dc=1, leaders=leaders, staleness=0, timeout_s=timeout_s)
    starter = threading.Thread(target=m1.start)
    starter.start()
    m0 = Mirror(dc=0, leaders=leaders, staleness=0, timeout_s=timeout_s).start()
    starter.join(10)
    return m0, m1


def test_two_data_centres_train_and_share_only_significant_entries(free_ports, run_threads):
    import torch
    from torch import nn

    from switchml.gaia.trainer import GaiaSync
    from switchml.workloads import digits_split as load_data
    from switchml.workloads import mlp_model
    xtr, ytr, xte, yte = load_data(0)
    leaders = _leaders(free_ports)
    out: dict[int, dict] = {}

    models = []
    for _ in range(2):  # here, not in the threads: torch's global generator is shared
        torch.manual_seed(0)
        models.append(mlp_model((256,)))

    def dc(j: int) -> None:
        model = models[j]
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        mirror = Mirror(dc=j, leaders=leaders, staleness=1, timeout_s=20).start()
        gaia = GaiaSync(model, mirror=mirror, threshold=0.05, decay=False)
        gen = torch.Generator().manual_seed(j)
        for _ in range(60):
            idx = torch.randint(0, len(ytr), (32,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            gaia.after_step()
        gaia.finish()
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        out[j] = {"acc": acc, "sent": gaia.entries_published, "applied": gaia.entries_applied,
                  "n": gaia._prev.size, "clocks": list(mirror.clock.clocks),
                  "bytes": mirror.counters["bytes_sent"], "flat": gaia._flat()}
        mirror.close()

    run_threads(dc, 2, 60)
    assert set(out) == {0, 1}
    # after the final exchange both data centres hold every update made anywhere
    np.testing.assert_allclose(out[0]["flat"], out[1]["flat"], atol=1e-5)
    for j in range(2):
        assert out[j]["acc"] > 0.85
        # every entry published by one side was applied by the other (none lost)...
        assert out[1 - j]["applied"] == out[j]["sent"]
        # ...and far fewer than the dense updates (8 bytes an entry + framing)
        assert out[j]["sent"] < 0.5 * 60 * out[j]["n"]
        # (a header per message, 3 a clock; an announce adds its count and tensor bitmap)
        assert out[j]["bytes"] < 8 * out[j]["sent"] + 61 * (3 * 24 + 9) + 100
        assert out[j]["clocks"][j] == 61  # 60 steps and the final exchange


def test_a_dead_data_centre_is_named_within_bounded_time(free_ports):
    m0, m1 = _two_mirrors(_leaders(free_ports), timeout_s=20)
    m0.clock.finish()
    m0.publish(1, np.zeros(0, np.int32), np.zeros(0, np.float32))
    # data centre 1 dies: its sockets close without a goodbye
    m1._out[0].shutdown(socket.SHUT_RDWR)
    m1._out[0].close()
    t0 = time.monotonic()
    with pytest.raises(GaiaError, match=r"data centre 1 \(leader 127\.0\.0\.1:\d+\)"):
        m0.exchange(lambda i, v: None)
    assert time.monotonic() - t0 < 5
    m0.close()


def test_a_silent_data_centre_times_out_naming_it(free_ports):
    m0, m1 = _two_mirrors(_leaders(free_ports), timeout_s=0.5)
    m0.clock.finish()
    with pytest.raises(GaiaError, match=r"waited 0.5 s for data centre 1"):
        m0.exchange(lambda i, v: None)
    m0.close()
    m1.close()
