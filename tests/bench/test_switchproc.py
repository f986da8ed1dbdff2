"""``bench/switchproc.py``: the benchmarks' switch in a child process."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from switchml.bench.switchproc import SwitchProcess


def test_a_switch_process_that_dies_before_listening_is_reported_at_once():
    # A bad setting fails in the child (ConfigError there); the parent said so only after
    # waiting its whole 30 s start timeout.
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 1 before it listened"):
        SwitchProcess(mp.get_context("spawn"), lease_timeout_s=-1.0)
    assert time.monotonic() - t0 < 30.0 / 3


def test_a_switch_process_listens_and_answers_for_its_counters():
    switch = SwitchProcess(mp.get_context("spawn"))
    try:
        host, port = switch.address
        assert host == "127.0.0.1" and port > 0
        assert switch.stats()["packets_in"] == 0
    finally:
        switch.stop()
    assert not switch.proc.is_alive()
