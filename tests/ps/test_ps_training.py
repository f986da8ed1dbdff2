"""Parameter-server training end to end over TCP on loopback."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from switchml.ps import ParameterServer, PSClient, PSError, ServerConfig, place
from switchml.ps.launch import PSRunConfig, run_ps_training


def test_same_seed_no_backup_is_bit_identical_and_another_seed_is_not():
    cfg = PSRunConfig(in_process=True, servers=2, workers=3, steps=15, max_shard_elements=5000)
    a, b = run_ps_training(cfg), run_ps_training(cfg)
    assert a["digest"] == b["digest"] and a["dropped_late"] == 0
    assert a["steps_applied"] == 15 * len(place([("", 16384), ("", 256), ("", 2560),
                                                  ("", 10)], 2, max_shard_elements=5000))
    c = run_ps_training(PSRunConfig(in_process=True, servers=2, workers=3, steps=15, seed=1,
                                    max_shard_elements=5000))
    assert c["digest"] != a["digest"]


def test_backup_workers_drop_the_stragglers_gradients_and_count_them():
    cfg = PSRunConfig(in_process=True, servers=2, workers=3, backup=1, steps=12,
                      slow_worker=2, slow_s=0.05)
    r = run_ps_training(cfg)
    assert r["dropped_late"] > 0
    assert r["iterations"][2] < 12  # the straggler skipped steps
    assert r["test_accuracy"] > 0.25  # learning (chance: 0.1)


def test_async_mode_trains():
    r = run_ps_training(PSRunConfig(in_process=True, servers=1, workers=2, mode="async",
                                    steps=40))
    assert r["iterations"] == {0: 40, 1: 40} and r["test_accuracy"] > 0.7


def test_a_dead_worker_is_named_to_the_others_quickly():
    with ParameterServer(0, ServerConfig(workers=2, timeout_s=30)) as ps:
        shards = place([("w", 4)], 1)
        a = PSClient([ps.address], worker=0, workers=2)
        b = PSClient([ps.address], worker=1, workers=2)
        a.init(shards, {0: np.zeros(4, np.float32)})
        a.push(shards, 0, {0: np.ones(4, np.float32)})
        b.close(bye=False)  # worker 1 dies before pushing
        t0 = time.monotonic()
        with pytest.raises(PSError, match=r"worker 1 \(connection lost"):
            a.pull(shards, 1, {0: np.empty(4, np.float32)})
        assert time.monotonic() - t0 < 5
        a.close()


def test_a_missing_gradient_times_out_naming_the_worker():
    with ParameterServer(0, ServerConfig(workers=2, timeout_s=0.5)) as ps:
        shards = place([("w", 4)], 1)
        with PSClient([ps.address], worker=0, workers=2) as a, \
                PSClient([ps.address], worker=1, workers=2):
            a.init(shards, {0: np.zeros(4, np.float32)})
            a.push(shards, 0, {0: np.ones(4, np.float32)})
            with pytest.raises(PSError, match=r"no gradient from worker\(s\) \[1\]"):
                a.pull(shards, 1, {0: np.empty(4, np.float32)})


def test_a_dead_server_is_named_within_the_timeout():
    # A server that accepts and answers HELLO, then never answers again: a hung server.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    addr = lsock.getsockname()
    real = ParameterServer(0, ServerConfig(workers=1)).start()
    try:
        import threading

        from switchml.ps.wire import MessageType, recv_message, send_message
        conns = []

        def fake() -> None:
            c, _ = lsock.accept()
            conns.append(c)
            recv_message(c)
            send_message(c, MessageType.HELLO)

        t = threading.Thread(target=fake, daemon=True)
        t.start()
        client = PSClient([real.address, addr], worker=0, workers=1, timeout_s=0.5)
        shards = place([("a", 2), ("b", 2)], 2)
        client.init(shards, {0: np.zeros(2, np.float32), 1: np.zeros(2, np.float32)})
        t0 = time.monotonic()
        with pytest.raises(PSError, match=r"ps1 at 127\.0\.0\.1:\d+ did not answer"):
            client.pull(shards, 0, {0: np.empty(2, np.float32), 1: np.empty(2, np.float32)})
        assert time.monotonic() - t0 < 3
        client.close(bye=False)
        # and a server that is not there at all
        with pytest.raises(PSError, match="cannot reach parameter server ps0"):
            PSClient([("127.0.0.1", 1)], worker=0, workers=1, connect_timeout_s=0.3)
    finally:
        real.stop()
        lsock.close()
