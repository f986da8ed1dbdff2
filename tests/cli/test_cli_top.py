"""``switchml top``: what a switch's jobs wait for, from its metrics, live in a real terminal."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from switchml.cli import main
from switchml.control import new_job_spec
from switchml.control.metrics import read_metrics, start_exporter
from switchml.protocol.config import WorkerConfig
from switchml.transport.udp import SwitchServer, WorkerClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def stalled_job():
    """A switch with its metrics, and a 3-rank job whose ranks 0 and 1 all-reduce while rank
    2 has joined and sends nothing: every open round waits for rank 2."""
    server = SwitchServer(host="127.0.0.1", port=0).start()
    port = _free_port()
    http, _ = start_exporter(server.stats, server.dataplane.config.pool_slots, "127.0.0.1", port)
    spec = new_job_spec(3, switch=server.address, window=4, elements_per_packet=256)
    clients = [WorkerClient(server.address, spec, r, WorkerConfig(op_timeout_s=60))
               for r in range(3)]
    handles = [clients[r].allreduce_async(np.ones(10_000, np.float32)) for r in (0, 1)]
    try:
        yield f"http://127.0.0.1:{port}/metrics", spec
    finally:
        for c in clients:
            threading.Thread(target=c.close, daemon=True).start()
        http.shutdown()
        server.stop()
        del handles


def _wait_for(what, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    return what()


def test_metrics_name_the_rank_each_job_waits_for(stalled_job):
    url, spec = stalled_job
    key = f"{spec.job_id},2"
    m = _wait_for(lambda: (lambda m: m if key in m.get("switchml_job_rank_missing_rounds", {})
                           else None)(read_metrics(url)))
    assert m is not None, "rank 2 never showed as missing"
    job = str(spec.job_id)
    assert m["switchml_job_ranks"][job] == 3 and m["switchml_job_members"][job] == 3
    # ranks 0 and 1 filled the window (4 slots): 4 open rounds, each lacking rank 2 only
    assert m["switchml_job_open_rounds"][job] == 4
    assert m["switchml_job_quorum"][job] == 3  # no quorum: a round needs every rank
    assert {k for k in m["switchml_job_rank_missing_rounds"] if k.startswith(job)} == {key}
    assert m["switchml_job_rank_missing_rounds"][key] == 4
    assert m["switchml_job_rank_silent_seconds"][key] >= 0  # it joined (and keeps alive)


def test_once_prints_a_frame(stalled_job, capsys):
    url, spec = stalled_job
    _wait_for(lambda: f"{spec.job_id},2" in read_metrics(url).get(
        "switchml_job_rank_missing_rounds", {}))
    assert main(["top", "--once", "--interval-s", "0.2", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "3 / 3" in out and "rank 2 (4 rounds" in out and str(spec.job_id) in out


def test_once_says_when_nothing_listens(capsys):
    assert main(["top", "--once", "--url", f"http://127.0.0.1:{_free_port()}/metrics"]) == 2
    assert "can't read" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt install tmux)")
def test_live_in_a_real_terminal(stalled_job, tmp_path):
    """tmux runs ``switchml top`` in a 150x40 terminal; the pane shows the stalled job and who
    it waits for, refreshes in place, and Ctrl-C ends it."""
    url, spec = stalled_job
    session = f"switchml-top-{uuid.uuid4().hex[:8]}"
    command = f"{sys.executable} -m switchml top --interval-s 0.3 --url {url}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "40",
                    command], check=True)

    def pane() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                              capture_output=True, text=True).stdout

    try:
        shown = _wait_for(lambda: (lambda p: p if "rank 2 (4 rounds" in p else None)(pane()))
        assert shown, pane()
        (tmp_path / "top.txt").write_text(shown)
        assert "switchml top" in shown and "3 / 3" in shown and str(spec.job_id) in shown
        # in place: one header on the screen, however many refreshes
        time.sleep(1.0)
        assert pane().count("switchml top ") == 1
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        gone = _wait_for(lambda: subprocess.run(["tmux", "has-session", "-t", session],
                                                capture_output=True).returncode != 0, 10)
        assert gone, "switchml top did not end on Ctrl-C"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
