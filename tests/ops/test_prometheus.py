"""The shipped Prometheus alert rules and Grafana dashboard (``deploy/``), against a real
Prometheus (Debian's ``prometheus``; ``.ci/run`` installs it) scraping a real switch.

One scene exercises everything: a switch whose 16-slot pool two jobs fill; job A's two ranks
all-reduce in a loop with 5% of their datagrams lost (NACKs, results re-sent); job B's rank 1
joins in a process of its own and is then stopped (SIGSTOP) while rank 0 waits in an
all-reduce; a stray datagram is dropped. Then every query of every dashboard panel must return
data, and every alert rule must fire: the job stalled and the rank lagging (job B), loss above
1% (job A), the slots exhausted (A and B).
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "switchml-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "switchml-dashboard.json"
ALERTS = {"SwitchmlJobStalled", "SwitchmlRankLagging", "SwitchmlLossHigh",
          "SwitchmlSlotsExhausted"}

RANK1 = """
import sys, time
from switchml.control import decode_job_spec
from switchml.transport.udp import WorkerClient
with WorkerClient(("127.0.0.1", int(sys.argv[1])), decode_job_spec(sys.argv[2]), 1) as w:
    print("joined", flush=True)
    time.sleep(600)
"""


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _query(prom: str, expr: str) -> list:
    q = urllib.parse.urlencode({"query": expr})
    return _get(f"{prom}/api/v1/query?{q}")["data"]["result"]


def _dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_the_dashboard_names_every_concern_the_operations_doc_lists():
    """Jobs, members, rate per job, loss and recovery, drops by reason, slot use, per-rank
    lag: each a panel whose query reads the metric that measures it."""
    exprs = " ".join(_dashboard_queries())
    for metric in ("switchml_jobs", "switchml_job_members", "switchml_elements_aggregated_total",
                   "switchml_nacks_sent_total", "switchml_results_resent_total",
                   "switchml_drops_total", "switchml_slots_in_use",
                   "switchml_job_rank_missing_rounds", "switchml_job_rank_silent_seconds"):
        assert metric in exprs, metric


@pytest.fixture
def prometheus(tmp_path, free_port):
    """A switch (16 slots) with its metrics, and a Prometheus scraping it every second with
    the shipped rules: ``(switch port, Prometheus URL)``."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("needs Debian's prometheus (apt-get install prometheus; .ci/run does)")
    port, metrics, web = free_port(), free_port(), free_port()
    switch = subprocess.Popen([sys.executable, "-m", "switchml", "switch", "--port", str(port),
                               "--metrics-port", str(metrics), "--pool-slots", "16",
                               "--member-timeout-s", "120"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "listening" in switch.stdout.readline()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {RULES}\n"
        "scrape_configs:\n  - job_name: switchml\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metrics}']\n")
    prom = subprocess.Popen([binary, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{web}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2)
                break
            except OSError:
                assert prom.poll() is None, prom.stderr.read()[-2000:]
                assert time.monotonic() < deadline, "prometheus did not get ready"
                time.sleep(0.2)
        yield port, url
    finally:
        for p in (prom, switch):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_every_dashboard_query_returns_data_and_every_alert_fires(prometheus):
    from switchml.control import encode_job_spec, new_job_spec
    from switchml.protocol.config import WorkerConfig
    from switchml.transport.faults import LossyEndpoint
    from switchml.transport.udp import WorkerClient

    port, prom = prometheus
    switch = ("127.0.0.1", port)
    stop = threading.Event()
    errors: list[str] = []
    lossy = WorkerConfig(op_timeout_s=30, initial_rto_s=0.02, max_rto_s=0.1)

    def job_a(rank: int, spec) -> None:  # the lossy job, all-reducing until told to stop
        try:
            with WorkerClient(switch, spec, rank, lossy,
                              wrap=lambda s: LossyEndpoint(s, 0.05, seed=rank)) as w:
                x = np.full(20_000, rank + 1, np.float32)
                while not stop.is_set():
                    assert float(w.allreduce(x)[0]) == 3.0
        except Exception as exc:  # noqa: BLE001
            errors.append(f"job A rank {rank}: {exc!r}")

    spec_a = new_job_spec(2, window=8, elements_per_packet=64)
    ranks_a = [threading.Thread(target=job_a, args=(r, spec_a), daemon=True) for r in range(2)]
    for t in ranks_a:
        t.start()

    spec_b = new_job_spec(2, window=8, elements_per_packet=64)
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1, str(port), encode_job_spec(spec_b)],
                             stdout=subprocess.PIPE, text=True)
    waiter = None
    try:
        assert rank1.stdout.readline().strip() == "joined"
        rank1.send_signal(signal.SIGSTOP)  # silent from now on: no request, no keep-alive
        b0 = WorkerClient(switch, spec_b, 0, WorkerConfig(op_timeout_s=120))
        waiter = threading.Thread(target=lambda: _swallow(b0.allreduce, np.ones(1000, np.float32)),
                                  daemon=True)
        waiter.start()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"not a switchml datagram", switch)  # a drop, by reason

        queries = _dashboard_queries()
        missing = set(queries)
        deadline = time.monotonic() + 60
        while missing and time.monotonic() < deadline:
            missing = {q for q in missing if not _query(prom, q)}
            time.sleep(1)
        assert not missing, f"dashboard queries without data: {sorted(missing)}"

        firing: set[str] = set()
        deadline = time.monotonic() + 60
        while firing != ALERTS and time.monotonic() < deadline:
            alerts = _get(f"{prom}/api/v1/alerts")["data"]["alerts"]
            firing = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
            time.sleep(1)
        assert firing == ALERTS, f"fired: {sorted(firing)}; expected {sorted(ALERTS)}"
        stalled = [a for a in alerts if a["labels"]["alertname"] == "SwitchmlRankLagging"]
        assert {a["labels"]["rank"] for a in stalled} == {"1"}  # the stopped rank, only
        assert {a["labels"]["job_id"] for a in stalled} == {str(spec_b.job_id)}
        assert not errors, errors
    finally:
        stop.set()
        rank1.kill()
        rank1.wait(timeout=10)
        if waiter is not None:
            b0.close()
        for t in ranks_a:
            t.join(timeout=30)


def _swallow(call, *args) -> None:
    try:
        call(*args)
    except Exception:  # noqa: BLE001  (its rank 1 is stopped: it fails when the test ends)
        pass
