"""The benchmark's process waiter (no root needed): big outputs, failures, deadlines."""

from __future__ import annotations

import subprocess
import time

import pytest

from switchml.bench.testbed import _wait_all
from switchml.testbed import TestbedError


@pytest.fixture
def start(py):
    """A function: start ``code`` in this interpreter, stdout and stderr piped."""
    return lambda code: subprocess.Popen(py(code), stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)


def test_a_process_that_writes_more_than_a_pipe_holds_does_not_stall(start):
    big = "import json; print('x' * 300_000); print(json.dumps({'rank': %d}))"
    t0 = time.monotonic()
    rows = _wait_all([start(big % r) for r in range(3)], timeout_s=30)
    assert rows == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert time.monotonic() - t0 < 15


def test_the_first_failure_kills_the_others_and_raises_its_stderr(start):
    slow = start("import time; time.sleep(60)")
    bad = start("import sys; print('boom: no switch', file=sys.stderr); sys.exit(3)")
    t0 = time.monotonic()
    with pytest.raises(TestbedError, match="failed \\(3\\).*boom: no switch"):
        _wait_all([slow, bad], timeout_s=30)
    assert time.monotonic() - t0 < 15
    assert slow.wait(timeout=5) is not None  # killed


def test_the_deadline_kills_everything(start):
    procs = [start("import time; time.sleep(60)") for _ in range(2)]
    with pytest.raises(TestbedError, match="did not finish in 1 s"):
        _wait_all(procs, timeout_s=1)
    assert all(p.wait(timeout=5) is not None for p in procs)


def test_a_testbed_server_is_ready_by_its_listening_line_or_ready_and_not_otherwise(start):
    """A switch says it listens with ``switchml switch``'s line (``control.announce``, the
    launchers' one contract); other servers say ``ready``; anything else is a failure."""
    from switchml.bench.testbed import _expect_ready
    for line in ("switchml switch listening on udp 0.0.0.0:48864", "ready"):
        proc = start(f"print({line!r}); import time; time.sleep(0.2)")
        assert _expect_ready(proc, "no", timeout_s=10) is proc
        proc.wait(5)
    for line in ("listening", "switchml switch listening on udp nowhere"):
        proc = start(f"print({line!r})")
        with pytest.raises(TestbedError, match="did not start"):
            _expect_ready(proc, "the switch did not start", timeout_s=10)
        proc.wait(5)
